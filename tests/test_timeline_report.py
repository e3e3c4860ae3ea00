"""Turn timelines, the metrics derived from them, and the call report file."""

from __future__ import annotations

import json
import os

import pytest
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from llm.types import GenerationStats
from pipeline.report import (
    SCHEMA,
    CallReport,
    ReportError,
    load_report,
    percentile,
    report_filename,
    summarize,
    write_report,
)
from pipeline.timeline import (
    EVENTS,
    METRICS,
    V2V_PARTS,
    TurnTimeline,
    compute_metrics,
    compute_metrics_ns,
    validate_order,
)


def full_timeline(t0: float = 100.0, index: int = 0) -> TurnTimeline:
    tl = TurnTimeline(index=index)
    stamps = {
        "speech_start": 0.0, "last_voiced": 1.0, "end_of_speech": 1.5, "transcript": 1.7,
        "llm_request": 1.71, "first_token": 2.0, "first_sentence": 2.3, "tts_request": 2.3,
        "tts_first_audio": 2.45, "first_audio_out": 2.47, "llm_done": 3.0, "playback_done": 5.0,
    }
    for name, dt in stamps.items():
        tl.mark(name, t0 + dt)
    return tl


def test_metrics_from_timeline():
    m = compute_metrics(full_timeline())
    assert m["endpoint_delay"] == pytest.approx(0.5)
    assert m["stt_latency"] == pytest.approx(0.2)
    assert m["ttft"] == pytest.approx(0.29)
    assert m["first_sentence_latency"] == pytest.approx(0.59)
    assert m["tts_first_audio"] == pytest.approx(0.15)
    assert m["voice_to_voice"] == pytest.approx(1.47)
    assert set(m) == set(METRICS)
    assert validate_order(full_timeline()) == []


def test_first_stamp_wins_unless_overwritten():
    tl = TurnTimeline()
    assert tl.mark("first_token", 5.0) == 5.0
    assert tl.mark("first_token", 6.0) == 5.0
    assert tl.mark("first_token", 7.0, overwrite=True) == 7.0
    now = tl.mark("llm_done")
    assert now > 0 and tl.get("llm_done") == now
    with pytest.raises(ValueError, match="unknown timeline event"):
        tl.mark("frist_token")
    with pytest.raises(ValueError):
        tl.mark("barge_in", float("nan"))


def test_missing_events_give_none():
    tl = TurnTimeline()
    tl.mark("llm_request", 1.0)
    tl.mark("first_token", 1.2)
    m = compute_metrics(tl)
    assert m["ttft"] == pytest.approx(0.2)
    assert all(m[k] is None for k in METRICS if k != "ttft")


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=len(EVENTS), max_size=len(EVENTS)))
def test_voice_to_voice_telescopes_exactly(stamps):
    tl = TurnTimeline()
    for name, t in zip(EVENTS, sorted(stamps)):
        tl.mark(name, t)
    ns = compute_metrics_ns(tl)
    assert sum(ns[p] for p in V2V_PARTS) == ns["voice_to_voice"]
    m = compute_metrics(tl)
    assert sum(m[p] for p in V2V_PARTS) == pytest.approx(m["voice_to_voice"], abs=1e-9)
    assert validate_order(tl) == []


def test_validate_order_finds_problems():
    tl = full_timeline()
    tl.mark("first_sentence", 101.0, overwrite=True)  # before first_token (102.0)
    problems = validate_order(tl)
    assert any("first_sentence" in p and "first_token" in p for p in problems)
    tl2 = TurnTimeline()
    tl2.mark("first_sentence", 1.0)
    assert any("first_token is not" in p for p in validate_order(tl2))


def test_percentile_nearest_rank():
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.9) == 3.0
    values = [float(v) for v in range(1, 11)]  # 1..10
    assert percentile(values, 0.5) == 5.0
    assert percentile(values, 0.9) == 9.0
    assert percentile(values, 1.0) == 10.0
    assert percentile([5.0, 1.0, 3.0], 0.5) == 3.0


def stats(new_tokens, passes, drafted, accepted, total_s):
    return GenerationStats(new_tokens=new_tokens, passes=passes, drafted=drafted, accepted=accepted, total_s=total_s)


def make_report(call_id="CA123") -> CallReport:
    report = CallReport(call_id=call_id, config={"llm": {"gamma": "auto"}},
                        models={"llm_target": "t", "llm_draft": "d", "drafter": "hybrid", "stt": "s", "tts": "p"},
                        t0=100.0)
    report.add_turn(full_timeline(100.0), "hello", "Hi there. How can I help?", llm=stats(10, 4, 12, 6, 1.0))
    tl = full_timeline(110.0, index=1)
    tl.mark("barge_in", 112.6)
    report.add_turn(tl, "when are you open", "We open at 8 a.m. and", agent_text_heard="We open",
                    interrupted=True, llm=stats(30, 10, 40, 20, 2.0))
    return report


def test_report_turns_and_summary():
    report = make_report()
    report.finish("caller_hangup")
    report.finish("error", error="late")  # first finish wins
    data = report.to_dict()
    assert data["schema"] == SCHEMA
    assert data["end_reason"] == "caller_hangup" and data["error"] is None
    turn = data["turns"][1]
    assert turn["index"] == 1 and turn["interrupted"] and turn["agent_text_heard"] == "We open"
    assert turn["timeline"]["speech_start"] == pytest.approx(10.0)
    assert turn["timeline"]["barge_in"] == pytest.approx(12.6)
    assert turn["metrics"]["voice_to_voice"] == pytest.approx(1.47)
    assert data["turns"][0]["agent_text_heard"] == data["turns"][0]["agent_text"]
    s = data["summary"]
    assert s["turns"] == 2
    assert s["metrics"]["voice_to_voice"] == {"p50": pytest.approx(1.47), "p90": pytest.approx(1.47),
                                              "max": pytest.approx(1.47), "n": 2}
    assert s["metrics"]["ttft"]["n"] == 2
    assert s["llm"] == {"tokens": 40, "passes": 14, "tokens_per_pass": round(40 / 14, 4),
                        "acceptance_rate": round(26 / 52, 4), "tokens_per_s": round(40 / 3, 3)}
    assert summarize([])["metrics"]["ttft"] == {"p50": None, "p90": None, "max": None, "n": 0}
    assert summarize([])["llm"]["tokens_per_pass"] == 0.0


def test_error_is_recorded_as_text():
    report = make_report()
    report.finish("error", error=RuntimeError("boom"))
    assert report.to_dict()["error"] == "RuntimeError: boom"


def test_write_and_load_roundtrip(tmp_path):
    report = make_report()
    report.finish("completed")
    path = write_report(report, tmp_path / "reports")
    assert path.parent == (tmp_path / "reports").resolve()
    assert path.name == "CA123.json"
    data = load_report(path)
    assert data == json.loads(json.dumps(report.to_dict())) | {"ended_at": data["ended_at"]}
    assert [p.name for p in path.parent.iterdir()] == ["CA123.json"]  # no temp files left
    # Rewriting replaces atomically.
    report.turns.clear()
    write_report(report, tmp_path / "reports")
    assert load_report(path)["turns"] == []


@pytest.mark.parametrize("call_id", ["../../etc/passwd", "/abs/path", "a/../../b", "..", ".", "",
                                      "x\x00y", "line\nbreak", "C:\\win\\path", "...hidden", "ü🙂",
                                      "a" * 500])
def test_hostile_call_ids_stay_in_folder(tmp_path, call_id):
    folder = tmp_path / "r"
    report = make_report(call_id)
    report.finish("completed")
    path = write_report(report, folder)
    assert path.parent == folder.resolve()
    name = path.name
    assert "/" not in name and "\\" not in name and ".." not in name and not name.startswith(".")
    assert all(c.isascii() and c.isprintable() for c in name)
    assert len(name) < 120
    assert load_report(path)["call_id"] == call_id
    assert list(tmp_path.iterdir()) == [folder]


def test_distinct_ids_do_not_collide():
    assert report_filename("a/b") != report_filename("a_b")
    assert report_filename("CA0123-abc_X.1") == "CA0123-abc_X.1.json"


def test_failed_write_leaves_no_temp_file(tmp_path, monkeypatch):
    report = make_report()
    report.finish("completed")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        write_report(report, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_load_report_rejects_other_schemas(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"schema": "specvoice.call_report/99", "call_id": "x"}))
    with pytest.raises(ReportError, match="unsupported call report schema.*call_report/99"):
        load_report(p)
    p.write_text("[1, 2]")
    with pytest.raises(ReportError, match="not a call report"):
        load_report(p)
    p.write_text("{broken")
    with pytest.raises(ReportError, match="cannot read"):
        load_report(p)
    with pytest.raises(ReportError, match="cannot read"):
        load_report(tmp_path / "missing.json")


def test_report_from_config():
    from pipeline.config import Config

    cfg = Config()
    report = CallReport.from_config("c1", cfg)
    assert report.models["llm_target"] == cfg.llm.target
    assert report.models["drafter"] == cfg.llm.drafter
    assert report.config["llm"]["gamma"] == cfg.llm.gamma
    report.finish("completed")
    json.dumps(report.to_dict(), allow_nan=False)
