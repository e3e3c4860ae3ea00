"""`specvoice bench load`: the soak's resource accounting, and a short real soak."""

import json
import logging

import pytest
import torch
from conftest import require_model

from bench.load.resources import heap_stats, slope_per_min
from demo.cli import main
from pipeline.timeline import V2V_PARTS


def test_a_config_is_loaded_with_its_own_threads_as_serve_runs_it_unless_told():
    """`bench load --config default` measures the default as `specvoice serve` runs it: torch
    on every core, as the config says (it ran everything on one thread before, a setup no
    user runs); --threads still sets all three; the small built-in setup keeps one."""
    import argparse
    import os

    from bench.load.config import agent_threads, threads_used
    from pipeline.config import load_config

    cfg = load_config("default")
    cores = os.cpu_count() or 1
    as_serve = argparse.Namespace(threads=None, config="default")
    assert agent_threads(as_serve) is None
    assert threads_used(as_serve, cfg) == {"torch": cores, "stt": min(4, cores), "piper": min(2, cores)}
    told = argparse.Namespace(threads=1, config="default")
    assert threads_used(told, cfg) == {"torch": 1, "stt": 1, "piper": 1}
    assert agent_threads(argparse.Namespace(threads=None, config=None)) == 1



def test_staggered_callers_dial_in_order_each_after_its_delay():
    """--stagger S: caller i dials i * S seconds after the first (the loop's timers order
    them; nothing here depends on the machine's speed). Without it all dial at once."""
    import asyncio

    from bench.load.inprocess import dial_after

    async def scenario(stagger: float) -> list[int]:
        order: list[int] = []

        def caller(i: int):
            async def run() -> int:
                order.append(i)
                return i
            return run

        t0 = asyncio.get_running_loop().time()
        results = await asyncio.gather(*(dial_after(i * stagger, caller(i)) for i in (3, 0, 2, 1)))
        assert results == [3, 0, 2, 1]  # each caller's own result, in the caller's place
        assert asyncio.get_running_loop().time() - t0 >= 3 * stagger  # the last waited its turn
        return order

    assert asyncio.run(scenario(0.01)) == [0, 1, 2, 3]
    assert asyncio.run(scenario(0.0)) == [3, 0, 2, 1]  # no delay: dialled as started, at once


@pytest.mark.parametrize("extra", [["--stagger", "-1"], ["--stagger", "1", "--soak", "5"],
                                   ["--stagger", "1", "--spawn", "2"]])
def test_stagger_takes_seconds_for_levels_in_process_only(extra, capsys):
    assert main(["bench", "load", "--calls", "2", *extra]) == 2
    assert "--stagger takes seconds >= 0" in capsys.readouterr().err

def test_slope_per_min_is_least_squares_per_minute():
    assert slope_per_min([(0, 10.0), (60, 12.0), (120, 14.0)]) == pytest.approx(2.0)
    assert slope_per_min([(0, 5.0), (30, 5.0), (90, 5.0)]) == pytest.approx(0.0)
    assert slope_per_min([(0, 1.0), (60, 2.0)]) is None  # too few points to call it a trend


def test_heap_stats_sees_live_python_objects_and_malloc_memory():
    before = heap_stats()
    held = [object() for _ in range(50_000)]
    block = torch.ones(64 * 2 ** 20 // 4)  # 64 MB from the CPU allocator (glibc malloc)
    during = heap_stats()
    assert during["python_blocks"] > before["python_blocks"] + 40_000
    if "malloc_in_use_mb" in before:  # glibc >= 2.33
        assert during["malloc_in_use_mb"] - before["malloc_in_use_mb"] > 60
        assert during["malloc_held_mb"] >= during["malloc_in_use_mb"]
    del held, block
    after = heap_stats()
    if "malloc_in_use_mb" in before:
        assert after["malloc_in_use_mb"] < during["malloc_in_use_mb"] - 60


@pytest.mark.models
def test_short_soak_completes_every_call_and_loses_no_report(tmp_path):
    require_model("smollm2-135m-instruct")
    require_model("whisper-tiny.en")
    require_model("piper-joe-medium")
    out = tmp_path / "soak.json"
    bridge_log = logging.getLogger("pipeline.transports.telephony.server")
    level = bridge_log.level
    threads = torch.get_num_threads()
    try:
        rc = main(["bench", "load", "--soak", "20", "--calls", "1", "--sample-s", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    assert bridge_log.level == level  # the benchmark quiets the bridge only while it runs
    s = json.loads(out.read_text())["soak"]
    assert s["rounds"] >= 1 and s["calls"] >= 1
    assert s["completed"] == s["calls"] and s["reports_lost"] == 0 and s["mixed"] == 0
    assert s["turns_answered"] == s["turns"]
    assert all(r["extra_refused"] == [503] for r in s["rounds_detail"])
    # Where voice-to-voice went: every span of it measured on the answered turns.
    for r in s["rounds_detail"]:
        parts = r["v2v_parts_p50_s"]
        assert set(parts) == set(V2V_PARTS)
        assert parts["stt_latency"] > 0 and parts["first_sentence_latency"] > 0 and parts["tts_first_audio"] > 0
    if s["rounds"] >= 2:
        assert {"python_blocks", "gc_objects"} <= set(s["heap_first_last"])
