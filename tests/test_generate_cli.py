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
