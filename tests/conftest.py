import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).parent))

# Hypothesis profiles, chosen by HYPOTHESIS_PROFILE:
# - "dev" (default): random examples, a new draw every run (failures are saved in .hypothesis/).
# - "ci" (.ci/run sets it): derandomized, so every CI run tries the same examples and a
#   red run can be reproduced exactly; no example database.
# - "long": a longer randomized hunt, each property's example count times 20:
#       HYPOTHESIS_PROFILE=long python -m pytest -q tests/test_fuzz_properties.py tests/test_sentences.py
settings.register_profile("dev", print_blob=True)
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("long", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def examples(n: int) -> int:
    """A property's example count, scaled up under the "long" profile (an explicit
    @settings(max_examples=...) overrides the profile, so the scale lives here)."""
    return n * 20 if settings.get_current_profile_name() == "long" else n


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Tiny random models saved with save_pretrained: two Qwen2 targets, a Llama target,
    an unrelated small draft, and a draft with a different tokenizer."""
    import torch

    from tinymodels import build_model, build_tokenizer

    # Many tiny ops: one thread avoids oversubscribing the two cores other tests share.
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("tiny")
    build_tokenizer(root / "tok")
    paths = {
        "target": build_model(root / "target", seed=1, tokenizer_from=root / "tok"),
        "target2": build_model(root / "target2", seed=7, hidden=48, heads=4, kv_heads=4, tokenizer_from=root / "tok"),
        "llama": build_model(root / "llama", arch="llama", seed=3, tokenizer_from=root / "tok"),
        "draft": build_model(root / "draft", seed=2, hidden=32, layers=1, tokenizer_from=root / "tok"),
    }
    other_tok = root / "othertok"
    from tinymodels import CORPUS

    import tinymodels

    saved = list(tinymodels.CORPUS)
    try:
        tinymodels.CORPUS[:] = [s[::-1] for s in CORPUS]  # a different corpus -> different merges and ids
        build_tokenizer(other_tok)
    finally:
        tinymodels.CORPUS[:] = saved
    paths["draft_other_tok"] = build_model(root / "draft_other", seed=5, hidden=32, layers=1, tokenizer_from=other_tok)
    return {k: str(v) for k, v in paths.items()}


def require_models() -> bool:
    """SPECVOICE_REQUIRE_MODELS=1 (set by scripts/test.sh): a missing model fails, not skips."""
    return os.environ.get("SPECVOICE_REQUIRE_MODELS") == "1"


def require_model(name: str) -> Path:
    """The pulled model's folder, or skip (fail under SPECVOICE_REQUIRE_MODELS=1)."""
    from modelstore import is_present, model_dir

    if not is_present(name):
        reason = f"model {name!r} not pulled into {model_dir(name)}: run `specvoice models pull {name}`"
        if require_models():
            pytest.fail(reason)
        pytest.skip(reason)
    return model_dir(name)


def speech_data_dir() -> Path:
    """The LJ Speech clips: $SPECVOICE_SPEECH_DATA, else ../shared/data/speech beside the repo."""
    env = os.environ.get("SPECVOICE_SPEECH_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "speech"


def speech_clips() -> list[tuple[Path, str]]:
    """(WAV file, transcript) of every clip in the manifest, or skip (fail under
    SPECVOICE_REQUIRE_MODELS=1, like a missing model)."""
    import json

    folder = speech_data_dir()
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        reason = f"speech clips not found at {folder} (set SPECVOICE_SPEECH_DATA)"
        if require_models():
            pytest.fail(reason)
        pytest.skip(reason)
    return [(folder / c["file"], c["transcript"]) for c in json.loads(manifest.read_text())["clips"]]
