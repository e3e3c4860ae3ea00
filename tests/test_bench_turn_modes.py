"""`specvoice bench pipeline --turn-modes`: the modes' configs, the default line set and
the second (espeak-ng) voice. Fast, no models; the espeak test runs the real binary."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from bench import pipeline as bench
from pipeline.config import load_config
from voice.audio import STT_RATE


@pytest.fixture(scope="module")
def config():
    return load_config(None)


@pytest.mark.parametrize("mode, turn_mode, preemptive, streaming", [
    ("baseline", "silence", False, False),
    ("streaming_stt", "silence", False, True),
    ("smart_turn", "smart_turn", False, False),
    ("preemptive", "smart_turn", True, True),
    ("silence_preemptive", "silence", True, False),
    ("smart_preemptive", "smart_turn", True, False),
    ("silence_preemptive_no_ahead", "silence", True, False),
    ("silence_preemptive_words_only", "silence", True, False),
])
def test_mode_config_sets_turn_and_streaming_stt(config, mode, turn_mode, preemptive, streaming):
    cfg = bench._mode_config(config, mode)
    assert (cfg.turn.mode, cfg.turn.preemptive, cfg.stt.streaming) == (turn_mode, preemptive, streaming)
    assert cfg.turn.speak_ahead == (mode != "silence_preemptive_no_ahead")
    if mode == "silence_preemptive_words_only":  # the LLM's end-of-words score off, on in the config
        assert cfg.turn.words_end_threshold == 0.0 < config.turn.words_end_threshold
    else:
        assert cfg.turn.words_end_threshold == config.turn.words_end_threshold
    # The rest of the config is untouched (same STT model, same LLM), except that
    # streaming needs Whisper's word timestamps.
    if streaming and config.stt.engine != "whisper":
        assert (cfg.stt.engine, cfg.stt.model) == ("whisper", "whisper-base")
    else:
        assert (cfg.stt.engine, cfg.stt.model) == (config.stt.engine, config.stt.model)
    assert cfg.llm == config.llm
    assert cfg.turn.max_silence_ms == config.turn.max_silence_ms


def test_mode_config_does_not_change_the_given_config(config):
    before = (config.turn.mode, config.turn.preemptive, config.stt.streaming)
    bench._mode_config(config, "preemptive")
    assert (config.turn.mode, config.turn.preemptive, config.stt.streaming) == before


def test_silence_is_an_alias_of_baseline(config):
    assert bench.parse_turn_modes("silence,smart_turn,preemptive") == (["baseline", "smart_turn", "preemptive"], [])
    assert bench.parse_turn_modes("silence,baseline") == (["baseline"], [])
    a, b = bench._mode_config(config, "silence"), bench._mode_config(config, "baseline")
    assert (a.turn, a.stt) == (b.turn, b.stt)


def test_all_is_every_mode_and_unknown_names_are_reported():
    every = ["baseline", "streaming_stt", "smart_turn", "preemptive", "silence_preemptive", "smart_preemptive",
             "silence_preemptive_no_ahead", "silence_preemptive_words_only", "silence_preemptive_early"]
    assert bench.parse_turn_modes("all") == (every, [])
    assert bench.parse_turn_modes(" preemptive , all") == (["preemptive", *[m for m in every if m != "preemptive"]], [])
    assert bench.parse_turn_modes("baseline,fast") == (["baseline"], ["fast"])
    assert bench.parse_turn_modes(None) == ([], [])


def test_default_line_set_counts():
    lines = bench.default_lines()
    assert len(lines) >= 15
    paused = [line for line in lines if line["split"]]
    assert len(paused) >= 5
    for line in paused:
        first, second = line["split"]
        assert line["text"] == f"{first} {second}" and first and second
    assert len({line["name"] for line in lines}) == len(lines)
    voices = [line["voice"] for line in lines]
    assert voices.count("espeak-ng") == len(lines) // 3 and voices[2] == "espeak-ng" and voices[0] == "piper"
    # Some paused lines are spoken by the second voice too.
    assert any(line["voice"] == "espeak-ng" for line in paused)


def test_default_line_set_options():
    assert all(line["voice"] == "piper" for line in bench.default_lines(other_voice_every=0))
    lines = bench.default_lines(turns=2, paused=1, trailing=0, other_voice_every=1)
    assert [line["kind"] for line in lines] == ["question", "question", "paused"]
    assert all(line["voice"] == "espeak-ng" for line in lines)


def test_human_lines_come_after_the_synthetic_ones_and_each_voice_is_summarised_apart():
    lines = bench.default_lines(turns=2, paused=1, trailing=0, other_voice_every=2, human=3)
    assert [line["voice"] for line in lines] == ["piper", "espeak-ng", "piper", "human", "human", "human"]
    first, second = lines[3]["split"]
    assert lines[3]["text"] == f"{first} {second}" and first.endswith(" of") and lines[3]["clip"].endswith(".wav")
    # Three lines, the second answered in two turns (cut in two): its turns count for its voice.
    report = {"turns_per_line": [1, 2, 1], "turns": [{"metrics": {"voice_to_voice": x}} for x in (1.0, 2.0, 3.0, 4.0)]}
    voices = bench.per_voice([{"voice": "piper"}, {"voice": "human"}, {"voice": "piper"}], report)
    assert voices["human"]["cut"] == 1 and voices["human"]["voice_to_voice_ms"]["n"] == 2
    assert {k: voices["piper"][k] for k in ("lines", "cut", "cutoff_rate", "voice_to_voice_ms")} == {
        "lines": 2, "cut": 0, "cutoff_rate": 0.0,
        "voice_to_voice_ms": {"p50": bench._pct([1000.0, 4000.0], 0.5), "p90": bench._pct([1000.0, 4000.0], 0.9), "n": 2}}


def test_help_defaults_keep_the_pause_in_range():
    import argparse

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--turn-modes", "all"])
    assert 500 <= args.pause_ms <= 900 and args.other_voice_every == 3
    assert args.paused_lines == len(bench.PAUSED) >= 5
    help_text = parser.format_help()
    for mode in bench.TURN_MODES:
        assert mode in help_text


def test_stt_after_endpoint_falls_back_to_stt_latency():
    assert bench._stt_after_endpoint({"stt_after_endpoint": 0.01, "stt_latency": 0.3}) == 0.01
    assert bench._stt_after_endpoint({"stt_latency": 0.3}) == 0.3
    report = {"turns": [{"metrics": {"stt_latency": 0.3, "voice_to_voice": 1.0}},
                        {"metrics": {"stt_latency": 0.2, "stt_after_endpoint": 0.02, "voice_to_voice": 1.2}}],
              "turns_per_line": [1, 1], "summary": {}, "report_path": "r.json"}
    s = bench._mode_summary(report, 2)
    assert s["stt_after_endpoint_ms"]["n"] == 2 and s["stt_after_endpoint_source"] == "stt_after_endpoint"
    assert s["stt_after_endpoint_ms"]["p50"] == pytest.approx(
        bench._pct([300.0, 20.0], 0.5)) and s["cutoff_rate"] == 0.0 and s["lines"] == 2


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed (apt-get install espeak-ng)")
def test_espeak_line_is_float32_at_the_stt_rate_and_takes_a_pause(tmp_path):
    first, second = bench.PAUSED[0]
    pcm, rate = bench.espeak_speak(f"{first} {second}", tmp_path)
    assert rate == STT_RATE == 16000
    assert pcm.dtype == np.float32 and pcm.ndim == 1 and len(pcm) > rate // 2
    assert float(np.max(np.abs(pcm))) > 0.01
    paused = bench._insert_pause(pcm, rate, len(first) / len(f"{first} {second}"), 0.7)
    assert paused.dtype == np.float32 and len(paused) == len(pcm) + int(rate * 0.7)
    assert list(tmp_path.iterdir()) == []  # its temporary WAV is gone


def test_espeak_missing_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "ESPEAK", "espeak-ng-not-installed-here")
    assert not bench.espeak_available()
    with pytest.raises(FileNotFoundError, match="apt-get install espeak-ng"):
        bench.espeak_speak("Hello.", tmp_path)


def fake_piper(text):
    """Piper's chunks for `text`, faked: 50 ms of a 220 Hz tone a word, at 22.05 kHz."""
    from types import SimpleNamespace

    rate = 22050
    t = np.arange(int(rate * 0.05 * len(text.split()))) / rate
    yield SimpleNamespace(pcm=(0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), sample_rate=rate)


def test_run_turn_modes_writes_lines_and_per_mode_summary(config, tmp_path, monkeypatch, capsys):
    """The whole --turn-modes run with a fake Piper and a fake call: WAVs for every default
    line (espeak-ng for every third, where installed), the table, and the JSON."""
    import argparse
    import json
    from types import SimpleNamespace

    played = {}

    async def play_lines(cfg, models, end_of_turn, wavs, report_dir, label):
        played[label] = (cfg.turn.mode, cfg.turn.preemptive, cfg.stt.streaming, list(wavs),
                         cfg.turn.words_done_silence_ms)
        turns = [{"user_text": "x", "agent_text": "y", "metrics": {"voice_to_voice": 1.0, "stt_latency": 0.2}}
                 for _ in wavs]
        return {"turns": turns, "turns_per_line": [1] * len(wavs), "report_path": "r.json",
                "summary": {"preemptive": {"hit_rate": 1.0, "hits": 1, "turns": 1} if cfg.turn.preemptive else None}}

    monkeypatch.setattr(bench, "_play_lines", play_lines)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--turn-modes", "all", "--out", str(tmp_path / "out.json")])
    modes, _ = bench.parse_turn_modes(args.turn_modes)
    models = SimpleNamespace(tts=SimpleNamespace(synthesize=fake_piper), end_of_turn=object())
    work = tmp_path / "work"
    work.mkdir()
    assert bench._run_turn_modes(args, config, models, work, modes) == 0
    assert {m: v[:3] for m, v in played.items()} == {
        "baseline": ("silence", False, False), "streaming_stt": ("silence", False, True),
        "smart_turn": ("smart_turn", False, False), "preemptive": ("smart_turn", True, True),
        "silence_preemptive": ("silence", True, False), "smart_preemptive": ("smart_turn", True, False),
        "silence_preemptive_no_ahead": ("silence", True, False),
        "silence_preemptive_words_only": ("silence", True, False), "silence_preemptive_early": ("silence", True, False)}
    # Only the early-end mode turns the early end on (it is off by default).
    assert {m for m, v in played.items() if v[4]} == {"silence_preemptive_early"}
    out = json.loads((tmp_path / "out.json").read_text())
    lines = out["lines"]
    assert len(lines) == len(played["baseline"][3]) >= 15 and sum(line["paused"] for line in lines) >= 5
    assert all(Path(line["wav"]).is_file() for line in lines)
    espeak = shutil.which("espeak-ng") is not None
    synthetic = [line for line in lines if line["voice"] != "human"]
    assert sum(line["voice"] == "espeak-ng" for line in lines) == (len(synthetic) // 3 if espeak else 0)
    human = [line for line in lines if line["voice"] == "human"]
    if (bench.speech_dir() / bench.HUMAN[0][0]).is_file():  # the LJ Speech clips (tests/conftest.py)
        assert len(human) == len(bench.HUMAN) and sum(line["paused"] for line in human) == 3
        assert out["modes"]["baseline"]["voices"]["human"]["lines"] == len(human)
    for mode in bench.TURN_MODES:
        s = out["modes"][mode]
        assert s["voice_to_voice_ms"]["p50"] == 1000.0 and s["stt_after_endpoint_ms"]["p50"] == 200.0
        assert s["cutoff_rate"] == 0.0 and s["turns"] == s["lines"] == len(lines)
    assert out["modes"]["preemptive"]["preemptive_hit_rate"] == 1.0
    assert "stt after end" in capsys.readouterr().out


def test_without_tools_runs_each_mode_again_with_tools_off_in_the_same_run(config, tmp_path, monkeypatch):
    import argparse
    import json
    from types import SimpleNamespace

    played = {}

    async def play_lines(cfg, models, end_of_turn, wavs, report_dir, label):
        played[label] = cfg.tools.enabled
        turns = [{"user_text": "x", "agent_text": "y", "metrics": {"voice_to_voice": 1.0, "stt_latency": 0.2}}
                 for _ in wavs]
        return {"turns": turns, "turns_per_line": [1] * len(wavs), "report_path": "r.json", "summary": {}}

    monkeypatch.setattr(bench, "_play_lines", play_lines)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--turn-modes", "baseline", "--without-tools", "--other-voice-every", "0",
                              "--human-lines", "0", "--out", str(tmp_path / "out.json")])
    config = config.model_copy(update={"tools": config.tools.model_copy(update={"enabled": True})})
    models = SimpleNamespace(tts=SimpleNamespace(synthesize=fake_piper), end_of_turn=None)
    (tmp_path / "work").mkdir()
    assert bench._run_turn_modes(args, config, models, tmp_path / "work", ["baseline"]) == 0
    assert played == {"baseline": True, "baseline-no_tools": False}
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["mode_settings"]["baseline-no_tools"]["tools"] is False and out["mode_settings"]["baseline"]["tools"]
    assert out["modes"]["baseline"]["kinds"]["question"]["lines"] == len(bench.QUESTIONS)

