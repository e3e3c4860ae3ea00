"""GGUF -> safetensors, once: later loads take under a second instead of minutes.

`transformers` can read a GGUF checkpoint, but only by de-quantising every tensor on each
load (minutes for the 1.5B on two cores). We do that once and store the result as a
plain Hugging Face folder (config.json, model.safetensors, tokenizer files), which
`AutoModelForCausalLM.from_pretrained(folder)` opens directly. A model loaded from GGUF
refuses `save_pretrained`, so the weights are written with safetensors directly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.float16) -> None:
    """Write `gguf_path` as a Hugging Face model folder in `out_dir`, weights cast to `dtype`."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # De-quantise to float32 first: casting straight to float16 inside the GGUF loader
    # is not supported for every quantisation type, and fp32 -> fp16 afterwards is exact
    # enough (Q4 weights carry far less precision than fp16).
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)

    state = model.state_dict()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if tied:
        # Tied heads share the embedding's storage, which safetensors refuses to write twice;
        # from_pretrained re-ties lm_head to the embedding when the config says so.
        state.pop("lm_head.weight", None)
    # `.to(dtype)` copies, so no two saved tensors share storage even when untied.
    tensors = {name: t.detach().to(dtype).contiguous() for name, t in state.items()}
    weights = out_dir / "model.safetensors"
    save_file(tensors, str(weights), metadata={"format": "pt"})
    # safetensors creates the file owner-only; give it the same mode as every other file here.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(weights, 0o666 & ~umask)

    model.config.dtype = dtype  # what the saved weights are, so dtype="auto" loads them as-is
    model.config.save_pretrained(out_dir)
    _drop_quantization_config(out_dir / "config.json")
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _drop_quantization_config(config_path: Path) -> None:
    """The GGUF loader tags the config as a GGUF-quantised model; the saved weights are dense.

    Left in, it would send `from_pretrained(out_dir)` down the quantised path (which refuses
    `.float()` and looks for a GGUF file that is gone).
    """
    config = json.loads(config_path.read_text())
    if config.pop("quantization_config", None) is not None:
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
