"""What the greedy engine tests (test_engine_exact, test_engine_static) compare against:
the prompts, the gamma = 0 outputs of every tiny target, and Hugging Face's greedy generate."""

from __future__ import annotations

from collections.abc import Callable

import torch

PROMPTS = [
    "A cleaning costs $89, a check-up $59. Dr. Patel has a slot on Tuesday at 10:30 a.m. A cleaning costs",
    "Hello! How can I help you today? Café, naïve, jalapeño — 日本語. Hello! How can",
]


def gamma0_outputs(tiny_models, engine: Callable, ids_of: Callable) -> dict:
    """{(target, dtype, prompt): token ids} of each tiny target at gamma = 0, from
    `engine(path, dtype=dtype)` and `ids_of(engine, prompt text)`."""
    out = {}
    for name in ("target", "target2", "llama"):
        for dtype in ("float32", "int8"):
            eng = engine(tiny_models[name], dtype=dtype)
            for p in PROMPTS:
                out[name, dtype, p] = ids_of(eng, p)
    return out


def assert_hf_greedy(path, eng, outputs: dict, name: str, new: int) -> None:
    """Each prompt's float32 output in `outputs` is Hugging Face's greedy generate of `new` tokens."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for p in PROMPTS:
        prompt = eng.encode(p)
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new, min_new_tokens=new,
                          eos_token_id=None, pad_token_id=0)
        assert outputs[name, "float32", p] == ref[0, len(prompt):].tolist()
