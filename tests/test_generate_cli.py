"""`specvoice generate`: streamed text, JSON with ids, groups and stats."""

import json
import subprocess
import sys


def run_cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "demo.cli", "generate", *args], capture_output=True, text=True, timeout=timeout
    )


def test_generate_json_groups_concatenate(tiny_models):
    out = run_cli("--prompt", "Hello! How can I help you today? Hello! How", "--target", tiny_models["target"],
                  "--draft", tiny_models["target"], "--drafter", "model", "--gamma", "3", "--dtype", "float32",
                  "--max-new-tokens", "20", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [t for g in data["groups"] for t in g] == data["token_ids"]
    assert len(data["token_ids"]) == 20
    assert all(1 <= len(g) <= 4 for g in data["groups"])
    assert data["stats"]["tokens_per_pass"] > 1.5  # the draft equals the target: all accepted
    assert data["finish_reason"] == "length"


def test_generate_streams_text_and_stats(tiny_models):
    out = run_cli("--prompt", "Riverside Dental is open", "--target", tiny_models["target"], "--drafter", "ngram",
                  "--gamma", "auto", "--dtype", "int8", "--max-new-tokens", "12")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    assert "tokens in" in out.stderr and "target passes" in out.stderr


def test_generate_messages_file_and_bad_file(tiny_models, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a list"}')
    out = run_cli("--messages", str(bad), "--target", tiny_models["target"], "--drafter", "none")
    assert out.returncode == 2 and "list of {role, content}" in out.stderr


def test_generate_missing_model_names_the_fix(tmp_path):
    out = run_cli("--prompt", "hi", "--target", str(tmp_path / "nope"), "--drafter", "none")
    assert out.returncode == 1
    assert "model path not found" in out.stderr


def test_generate_with_a_json_schema_prints_json_that_the_schema_allows(tiny_models, tmp_path):
    schema = {"type": "object", "properties": {"day": {"enum": ["Monday", "Saturday"]}, "ok": {"type": "boolean"}},
              "required": ["day", "ok"], "additionalProperties": False}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(schema))
    out = run_cli("--prompt", "Riverside Dental is open", "--target", tiny_models["target"], "--drafter", "ngram",
                  "--gamma", "4", "--dtype", "float32", "--max-new-tokens", "40", "--json-schema", str(path), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["finish_reason"] == "eos"
    value = json.loads(data["text"])
    assert value["day"] in ("Monday", "Saturday") and isinstance(value["ok"], bool)
    assert data["stats"]["forced_tokens"] > 0


def test_generate_with_a_regex_streams_matching_text(tiny_models):
    import re

    out = run_cli("--prompt", "Hello!", "--target", tiny_models["target"], "--drafter", "ngram", "--gamma", "auto",
                  "--dtype", "float32", "--max-new-tokens", "30", "--regex", "(Yes|No), we are (open|closed)\\.")
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(r"(Yes|No), we are (open|closed)\.", out.stdout.strip()), out.stdout
    assert "forced by the constraint" in out.stderr


def test_generate_bad_constraints_say_what_is_wrong(tiny_models, tmp_path):
    out = run_cli("--prompt", "Hi", "--target", tiny_models["target"], "--drafter", "none", "--regex", "(unclosed")
    assert out.returncode == 1 and "regex constraint does not compile" in out.stderr and "unclosed" in out.stderr
    assert out.stdout.strip() == ""
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    out = run_cli("--prompt", "Hi", "--target", tiny_models["target"], "--drafter", "none", "--json-schema", str(bad))
    assert out.returncode == 2 and "is not JSON" in out.stderr
    out = run_cli("--prompt", "Hi", "--target", tiny_models["target"], "--drafter", "none", "--grammar", str(tmp_path / "missing.lark"))
    assert out.returncode == 2 and "cannot read" in out.stderr
    lark = tmp_path / "g.lark"
    lark.write_text("start: nothing_defined\n")
    out = run_cli("--prompt", "Hi", "--target", tiny_models["target"], "--drafter", "none", "--grammar", str(lark))
    assert out.returncode == 1 and "nothing_defined" in out.stderr
