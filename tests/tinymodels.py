"""Tiny random models and a byte-level tokenizer, built and saved by the tests themselves.

Random weights with a large initializer range give peaked logits, so greedy argmax
ties (which no implementation can resolve identically) do not occur in practice.
"""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "Riverside Dental is open Monday to Friday from 8 a.m. to 6 p.m. and Saturday 9 to 1.",
    "A cleaning costs $89, a check-up $59. Dr. Patel has a slot on Tuesday at 10:30 a.m.",
    "Your order #4521 shipped yesterday and arrives on Thursday. Café, naïve, jalapeño — ünïcödé ✓ 日本語.",
    "Hello! How can I help you today? I can book, move or cancel an appointment for you.",
]


def build_tokenizer(path: Path, vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(path)
    return fast


def build_model(path: Path, arch: str = "qwen2", seed: int = 0, vocab_size: int = 320, hidden: int = 64,
                layers: int = 2, heads: int = 4, kv_heads: int = 2, init_range: float = 0.3,
                tokenizer_from: Path | None = None, eos_token_id: int = 0) -> Path:
    """Save a random causal LM (with the tests' tokenizer) to `path` with save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cfg_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    cfg = cfg_cls(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
        initializer_range=init_range, tie_word_embeddings=False, eos_token_id=eos_token_id, bos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    model.save_pretrained(path)
    if tokenizer_from is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(path)
    else:
        build_tokenizer(path, vocab_size)
    return path
