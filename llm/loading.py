"""Load a causal LM and its tokenizer from a Hugging Face id, a local directory or a GGUF file.

Errors say what to do next: a missing path, an id that cannot be fetched offline, a
corrupted or truncated weights file, an unsupported architecture, a draft whose
tokenizer does not match the target's.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from llm.model import Transformer, build_model

log = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """A model that cannot be loaded; the message names the fix."""


class TokenizerMismatchError(ValueError):
    """Draft and target tokenizers disagree, so draft token ids would mean other text."""


@dataclass
class LoadedModel:
    name: str
    model: Transformer
    tokenizer: object
    eos_ids: frozenset[int]
    path: str


def resolve_dtype(dtype: str, device: str) -> tuple[str, torch.dtype]:
    """(linear mode, activation dtype) for a config dtype on a device."""
    if dtype == "auto":
        dtype = "int8" if device == "cpu" else "bfloat16"
    if dtype == "int8":
        if device != "cpu":
            raise ModelLoadError("dtype int8 is the CPU path; use bfloat16 on CUDA")
        return "int8", torch.float32
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    # On CPU, float rows are computed one at a time so a k-token verify is bitwise a
    # one-token step; on GPU a single GEMM per layer (the decoder verifies at fixed width).
    return ("rowwise" if device == "cpu" else "float"), torch_dtype


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        bins = sorted(path.glob("pytorch_model*.bin"))
        if not bins:
            raise ModelLoadError(f"no weights (*.safetensors or pytorch_model*.bin) in {path}")
        state = {}
        for b in bins:
            state.update(torch.load(b, map_location="cpu", weights_only=True))
        return state
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise ModelLoadError(
                f"weights file {f} is corrupted or truncated ({exc}); delete {path} and run "
                f"`specvoice models pull` again (or re-download the model)"
            ) from exc
    return state


def _load_config(path: Path):
    from transformers import AutoConfig

    cfg_file = path / "config.json"
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {cfg_file} ({exc}); the model directory is incomplete") from exc
    # A GGUF conversion leaves its quantization_config behind; the weights are plain floats now.
    raw.pop("quantization_config", None)
    config_cls = AutoConfig.for_model(raw.get("model_type", "llama")).__class__
    return config_cls.from_dict(raw)


def _eos_ids(path: Path | None, config, tokenizer) -> frozenset[int]:
    ids: set[int] = set()

    def add(v):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)

    add(getattr(config, "eos_token_id", None))
    if path is not None and (path / "generation_config.json").is_file():
        try:
            add(json.loads((path / "generation_config.json").read_text()).get("eos_token_id"))
        except (OSError, json.JSONDecodeError):
            pass
    add(getattr(tokenizer, "eos_token_id", None))
    # Chat models end a turn with an end-of-turn token that is not always the tokenizer's eos.
    for special in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(special) if special in tokenizer.get_vocab() else None
        if tid is not None:
            ids.add(int(tid))
    return frozenset(ids)


def _hub_snapshot(model_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
    except Exception as exc:  # noqa: BLE001 - the hub client raises many types
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        raise ModelLoadError(
            f"model {model_id!r} is not a local directory or file, and could not be fetched from the "
            f"Hugging Face hub{' (HF_HUB_OFFLINE=1)' if offline else ''}: {type(exc).__name__}: {str(exc)[:200]}. "
            "Give a local path, a name from `specvoice models list` (after `specvoice models pull`), "
            "or an id you can download."
        ) from exc


def load_model(spec: str, device: str = "cpu", dtype: str = "auto", name: str | None = None) -> LoadedModel:
    """Load `spec`: a local directory, a .gguf file, or a Hugging Face id."""
    from transformers import AutoTokenizer

    mode, torch_dtype = resolve_dtype(dtype, device)
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        from transformers import AutoModelForCausalLM

        log.info("de-quantising %s (slow; `specvoice models pull` caches the result)", path)
        try:
            hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        except Exception as exc:  # noqa: BLE001
            raise ModelLoadError(f"cannot read GGUF file {path}: {exc}; is it complete? Check its SHA-256.") from exc
        config, state = hf.config, hf.state_dict()
        local = None
    else:
        if path.exists():
            if not path.is_dir():
                raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file")
            local = path
        elif spec.startswith((".", "/", "~")) or os.sep in spec and not _looks_like_hub_id(spec):
            raise ModelLoadError(f"model path not found: {path}")
        else:
            local = _hub_snapshot(spec)
        config = _load_config(local)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(local))
        except Exception as exc:  # noqa: BLE001
            raise ModelLoadError(f"cannot load the tokenizer in {local}: {exc}") from exc
        state = _read_state_dict(local)
    try:
        model = build_model(config, state, mode, torch_dtype, device)
    except KeyError as exc:
        raise ModelLoadError(f"weights of {spec} are incomplete: missing {exc}; re-download or re-pull it") from exc
    except ValueError as exc:
        raise ModelLoadError(f"{spec}: {exc}") from exc
    del state
    return LoadedModel(name or spec, model, tokenizer, _eos_ids(local, config, tokenizer), str(local or path))


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/", "~"))


def check_tokenizers_match(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose token ids mean different text than the target's.

    Every token the draft can emit (its vocabulary head) must exist in the target with
    the same id and the same string, and the target must be able to score it."""
    t_vocab, d_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    d_head = draft.model.args.vocab_size
    t_head = target.model.args.vocab_size
    problems = []
    if d_head > t_head and len(d_vocab) > t_head:
        problems.append(f"the draft can emit {len(d_vocab)} token ids but the target scores only {t_head}")
    by_id_t = {i: s for s, i in t_vocab.items()}
    mismatched = [(s, i, by_id_t.get(i)) for s, i in d_vocab.items() if i < d_head and by_id_t.get(i) != s]
    if mismatched:
        s, i, other = mismatched[0]
        problems.append(
            f"{len(mismatched)} of the draft's tokens differ from the target's (e.g. id {i} is {s!r} in the draft, "
            f"{other!r} in the target)"
        )
    if problems:
        raise TokenizerMismatchError(
            f"draft {draft.name} cannot draft for target {target.name}: " + "; ".join(problems)
            + ". Pick a draft from the same model family (same tokenizer), or use --drafter ngram."
        )
