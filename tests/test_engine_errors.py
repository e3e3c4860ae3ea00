"""Bad input to the LLM stage gives a clear error that names the fix."""

import shutil

import pytest

from llm.engine import SpeculativeEngine
from llm.loading import ModelLoadError, TokenizerMismatchError, load_model
from llm.types import SamplingParams


def test_tokenizer_mismatch_is_refused(tiny_models):
    with pytest.raises(TokenizerMismatchError) as exc:
        SpeculativeEngine.load(tiny_models["target"], tiny_models["draft_other_tok"], drafter="model", gamma=2, dtype="float32")
    msg = str(exc.value)
    assert "differ" in msg and "same tokenizer" in msg and "--drafter ngram" in msg


def test_matching_tokenizers_pass(tiny_models):
    SpeculativeEngine.load(tiny_models["target"], tiny_models["draft"], drafter="model", gamma=2, dtype="float32")


def test_prompt_longer_than_context(tiny_models):
    eng = SpeculativeEngine.load(tiny_models["target"], dtype="float32", drafter="none", gamma=0, context_tokens=64)
    with pytest.raises(ValueError, match=r"prompt has 80 tokens but the context holds 64.*llm.context_tokens"):
        list(eng.stream(list(range(1, 81)), SamplingParams(max_new_tokens=4)))


def test_generation_stops_at_the_context_limit(tiny_models):
    eng = SpeculativeEngine.load(tiny_models["target"], dtype="float32", drafter="none", gamma=0, context_tokens=64)
    ids, groups, _ = eng.generate(list(range(1, 61)), SamplingParams(max_new_tokens=50))
    assert len(ids) == 4 and groups[-1].finish_reason == "length"


def test_negative_gamma(tiny_models):
    with pytest.raises(ValueError, match="gamma must be >= 0"):
        SpeculativeEngine.load(tiny_models["target"], dtype="float32", drafter="ngram", gamma=-1)


def test_cli_rejects_negative_gamma():
    from demo.cli import main

    with pytest.raises(SystemExit, match="--gamma must be >= 0"):
        main(["generate", "--prompt", "hi", "--gamma", "-2"])


def test_unknown_drafter(tiny_models):
    with pytest.raises(ValueError, match="unknown drafter"):
        SpeculativeEngine.load(tiny_models["target"], dtype="float32", drafter="telepathy")


def test_model_drafter_needs_a_draft(tiny_models):
    with pytest.raises(ValueError, match="needs a draft model"):
        SpeculativeEngine.load(tiny_models["target"], None, dtype="float32", drafter="model")


def test_missing_local_path():
    with pytest.raises(ModelLoadError, match="model path not found"):
        load_model("/nonexistent/dir/model", dtype="float32")


def test_unknown_hub_id_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelLoadError) as exc:
        load_model("nobody-here/no-such-model-xyz", dtype="float32")
    msg = str(exc.value)
    assert "HF_HUB_OFFLINE=1" in msg and "specvoice models pull" in msg


def test_truncated_weights_file(tiny_models, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_models["target"], broken)
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError) as exc:
        load_model(str(broken), dtype="float32")
    assert "model.safetensors" in str(exc.value) and "corrupted or truncated" in str(exc.value)
    assert "specvoice models pull" in str(exc.value)


def test_corrupted_weights_file(tiny_models, tmp_path):
    broken = tmp_path / "garbage"
    shutil.copytree(tiny_models["target"], broken)
    (broken / "model.safetensors").write_bytes(b"\x00\x01not a safetensors file" * 10)
    with pytest.raises(ModelLoadError, match="corrupted or truncated"):
        load_model(str(broken), dtype="float32")


def test_missing_config(tiny_models, tmp_path):
    broken = tmp_path / "noconfig"
    shutil.copytree(tiny_models["target"], broken)
    (broken / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(broken), dtype="float32")


def test_truncated_gguf(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        load_model(str(gguf), dtype="float32")


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from tinymodels import build_tokenizer

    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=320)).save_pretrained(tmp_path)
    build_tokenizer(tmp_path)
    with pytest.raises(ModelLoadError, match="unsupported model architecture 'gpt2'"):
        load_model(str(tmp_path), dtype="float32")


def test_sampling_params_validated():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
