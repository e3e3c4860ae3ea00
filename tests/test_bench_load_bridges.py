"""`specvoice bench load --spawn/--bridge`: calls over several `specvoice serve` processes,
one of them stopped mid-call.

The whole-run test starts two real `specvoice serve` processes (Whisper tiny.en, Piper, the
VAD), both with `backend = "openai"` against ONE real llama.cpp server (xllamacpp) serving
SmolLM2-135M's GGUF, and dials simulated callers over both. It skips, with the reason, where
the engine, the GGUF or the voice models are missing (SPECVOICE_REQUIRE_ENGINE=1 and
SPECVOICE_REQUIRE_MODELS=1 make that a failure). Event-driven: the stop comes when a call
on one process has heard its first answer, not after a time.

    python -m pytest -q -m real_engine tests/test_bench_load_bridges.py
"""

from __future__ import annotations

import json

import pytest

from bench.load.summary import summarize_level
from demo.cli import main

SMALL = "smollm2-135m-instruct"


def _caller(i, bridge, outcome, attempts, sid=None, answered=2):
    return {"caller": i, "name": ["Alice", "Robert", "Maria", "David"][i], "bridge": bridge, "outcome": outcome,
            "attempts": attempts, "call_sid": sid or f"CA{i}", "lines": 2, "answered": answered,
            "v2v_caller": [1.0] * answered, "bad_messages": []}


def _report(sid, end_reason="caller_hangup", turns=2, text="Hello"):
    return {"call_id": sid, "end_reason": end_reason,
            "turns": [{"user_text": text, "agent_text": "Sure.", "metrics": {"voice_to_voice": 1.5}}] * turns}


def test_summary_counts_per_bridge_and_finds_lost_misplaced_and_mixed_reports():
    stop = {"bridge": 0, "t": 10.0}
    records = [
        _caller(0, 0, "cut", [{"bridge": 0, "t": 0.0, "result": "connected"}], answered=1),
        _caller(1, 1, "done", [{"bridge": 1, "t": 0.0, "result": "connected"}]),
        # After the stop: refused by the dead process (connection refused), then the other.
        _caller(2, 1, "done", [{"bridge": 0, "t": 12.0, "result": "ConnectionRefusedError"},
                               {"bridge": 1, "t": 12.0, "result": "connected"}]),
        _caller(3, None, "refused", [{"bridge": 1, "t": 12.0, "result": 503}]),
    ]
    reports = {"CA0": [(0, _report("CA0", "server_shutdown", turns=1))],
               "CA1": [(1, _report("CA1", text="I am Alice"))],  # another caller's name: mixed
               "CA2": [(0, _report("CA2")), (1, _report("CA2"))]}  # twice, once in the wrong folder
    lv = summarize_level(records, reports, 2, True, stop)
    assert (lv["calls"], lv["connected"], lv["completed"], lv["cut"], lv["refused"]) == (4, 3, 2, 1, 1)
    assert lv["cut_end_reasons"] == ["server_shutdown"]
    assert lv["bridges"][0] == {"placed": 1, "completed": 0, "cut": 1, "refused": 0, "connect_failed": 1}
    assert lv["bridges"][1] == {"placed": 2, "completed": 2, "cut": 0, "refused": 1, "connect_failed": 0}
    assert (lv["reports_missing"], lv["reports_duplicated"], lv["reports_wrong_bridge"], lv["mixed"]) == (0, 1, 1, 1)
    assert lv["lost"] == 0
    assert lv["after_stop"] == {"placed_on": [1], "attempts_on_stopped": 1, "placed_on_stopped": 0}

    # A connected call without a report, or with one never finished, is lost.
    del reports["CA1"]
    reports["CA0"] = [(0, _report("CA0", "unfinished", turns=1))]
    lv = summarize_level(records, reports, 2, True, stop)
    assert lv["reports_missing"] == 1 and lv["reports_without_end"] == 1 and lv["lost"] == 2


def test_stopping_needs_spawned_processes(capsys):
    assert main(["bench", "load", "--bridge", "ws://127.0.0.1:9/media-stream", "--stop-one-after", "5"]) == 2
    assert "--spawn" in capsys.readouterr().err


@pytest.mark.models
@pytest.mark.slow
@pytest.mark.real_engine
@pytest.mark.timeout(900)
def test_two_serve_processes_one_stopped_mid_call_loses_nothing(tmp_path):
    from conftest import require_model

    for name in ("whisper-tiny.en", "piper-joe-medium"):
        require_model(name)
    from realengine import engine_and_gguf_or_skip

    engine_and_gguf_or_skip(SMALL)  # fetched now, so the benchmark finds it in the cache
    out = tmp_path / "two-bridges.json"
    reports = tmp_path / "reports"
    rc = main(["bench", "load", "--spawn", "2", "--calls", "2", "2", "--stop-one-at-answer",
               "--reports", str(reports), "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    first, second = result["rounds"]
    stop = result["stop"]
    victim, survivor = stop["bridge"], 1 - stop["bridge"]
    logs = {b: (reports / f"bridge-{b}.log").read_text(errors="replace")[-3000:] for b in (0, 1)}

    # Round 1: one call on each process (round-robin), both connected.
    assert [s["placed"] for s in first["bridges"]] == [1, 1], (first["failures"], logs)
    by_bridge = {c["bridge"]: c for c in first["callers"]}
    cut, kept = by_bridge[victim], by_bridge[survivor]

    # The stopped process had that one call in flight; SIGINT closed it with 1001 (going
    # away) and the process exited, after writing the call's report.
    assert stop["signal"] == "SIGINT" and stop["in_flight"] == [cut["call_sid"]]
    assert stop["exit_code"] in (0, -2, 130), logs[victim]
    assert cut["outcome"] == "cut" and cut["close"][0] == 1001, cut
    assert cut["reports"] == 1, (cut, logs[victim])
    assert (reports / f"bridge-{victim}" / f"{cut['call_sid']}.json").is_file()  # in its own process's folder
    # Its end_reason should read server_shutdown; under SIGINT the bridge marks it too late
    # and it reads caller_hangup (pipeline/transports/telephony/server.py, Bridge.serve_forever:
    # websockets' serve_forever closes the calls before Bridge.stop sets _stopping).
    assert cut["end_reason"] in ("server_shutdown", "caller_hangup"), cut
    assert cut["report_turns"] >= 1 and cut["answered"] >= 1  # it was cut after its first answer began

    # The other process's call went on to the end.
    assert kept["outcome"] == "done" and kept["answered"] == kept["lines"] == 2, (first["failures"], logs)
    assert kept["end_reason"] == "caller_hangup" and kept["report_turns"] == 2

    # Round 2, after the stop: every call lands on the survivor, the stopped process took none.
    assert second["after_stop"]["placed_on"] == [survivor] and second["after_stop"]["placed_on_stopped"] == 0
    assert second["bridges"][survivor]["placed"] == 2 and second["bridges"][victim]["placed"] == 0
    assert second["completed"] == 2, (second["failures"], logs[survivor])

    # Nothing lost, nothing mixed: one report per connected call, in the folder of the
    # process it connected to, each with an end_reason.
    t = result["totals"]
    assert t["connected"] == 4 and t["completed"] == 3 and t["cut"] == 1
    assert (t["reports_missing"], t["reports_duplicated"], t["reports_wrong_bridge"], t["reports_without_end"],
            t["mixed"]) == (0, 0, 0, 0, 0)
    assert all(code is not None for code in result["exit_codes"])  # every spawned process ended
