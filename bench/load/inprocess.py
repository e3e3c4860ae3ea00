"""Levels of N callers at once against one bridge in this process, and the soak (calls placed
back to back for a while on one bridge, resources sampled throughout)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.load.callers import NAMES, spoken_scripts, wait_or_cancel
from bench.load.config import agent_threads, load_bench_config, threads_used
from bench.load.resources import Sampler, heap_stats, soak_resources
from bench.load.summary import judge, level_summary
from bench.load.tables import print_soak_round


async def start_server(cfg, models, max_calls: int) -> dict[str, Any]:
    """The bridge (bearer token, max_calls) with the agent behind it, as `specvoice serve` runs it."""
    from pipeline.transports.telephony.auth import BridgeTokens
    from pipeline.transports.web.server import Bridge
    from pipeline.transports.telephony.adapter import make_call_handler

    token = secrets.token_urlsafe(24)
    handler = make_call_handler(cfg, models, report_dir=cfg.report.dir, greeting=False)
    wire_calls: list = []

    async def on_call(call) -> None:
        wire_calls.append(call)
        await handler(call)

    bridge = Bridge(cfg.bridge.model_copy(update={"host": "127.0.0.1", "port": 0, "max_calls": max_calls}), on_call,
                    BridgeTokens.of(bearer_token=token))
    port = await bridge.start()
    return {"bridge": bridge, "handler": handler, "token": token, "url": f"ws://127.0.0.1:{port}/media-stream",
            "wire": wire_calls}


async def dial_extra(url: str, token: str, count: int) -> list[int | str]:
    """`count` callers over the limit: the HTTP status each got at the handshake (503 expected)."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    refused: list[int | str] = []
    for _ in range(count):
        try:
            async with connect(url, additional_headers={"Authorization": f"Bearer {token}"}, open_timeout=10):
                refused.append("accepted")
        except InvalidStatus as exc:
            refused.append(exc.response.status_code)
        except Exception as exc:  # noqa: BLE001 - recorded, not fatal to the benchmark
            refused.append(type(exc).__name__)
    return refused


async def dial_after(delay_s: float, dial):
    """`dial()` once `delay_s` has passed (--stagger: caller i dials i * S seconds after the first)."""
    if delay_s > 0:
        await asyncio.sleep(delay_s)
    return await dial()


async def run_level(cfg, models, lines_by_caller: list, n: int, args: argparse.Namespace, sampler: Sampler,
                    first_index: int = 0, server: dict | None = None) -> dict[str, Any]:
    """N callers at once; on a bridge of its own (max_calls = N), or on `server` (kept running)."""
    from demo.caller import SimulatedCaller
    from pipeline.report import load_report

    own = server is None
    if own:
        server = await start_server(cfg, models, n)
    bridge, handler, token, url, wire_calls = (server[k] for k in ("bridge", "handler", "token", "url", "wire"))
    wire_calls.clear()
    callers = [SimulatedCaller(url, lines_by_caller[(first_index + i) % len(lines_by_caller)], token=token,
                               expect_greeting=False, silence_s=1.0, reply_timeout_s=min(90.0, args.level_timeout))
               for i in range(n)]
    sids = {c.result.call_sid for c in callers}
    round_calls = lambda: [c for c in handler.calls if c.call_id in sids]  # noqa: E731
    peak0 = sampler.peak_mb
    sampler.peak_mb = 0.0
    engine0 = engine_counters(models)
    t0 = time.monotonic()
    tasks = [asyncio.create_task(dial_after(i * args.stagger, c.run)) for i, c in enumerate(callers)]
    try:
        # Once all N are in, the extra callers must be turned away at the handshake.
        deadline = time.monotonic() + 30 + args.stagger * (n - 1)
        while bridge.active_calls < n and time.monotonic() < deadline and not all(t.done() for t in tasks):
            await asyncio.sleep(0.05)
        refused = await dial_extra(url, token, args.extra)
        await wait_or_cancel(tasks, args.level_timeout)
        # Reports are written when the bridge's call ends (end_grace_s after the hang-up).
        deadline = time.monotonic() + cfg.bridge.end_grace_s + 10
        while time.monotonic() < deadline and (len(round_calls()) < n or
                                               not all(c.report_path for c in round_calls())):
            await asyncio.sleep(0.05)
    finally:
        if own:
            await bridge.stop()
    wall = time.monotonic() - t0
    sampler.sample()

    reports = {}
    for call in round_calls():
        if call.report_path:
            data = load_report(call.report_path)
            reports[data["call_id"]] = data
    peak = sampler.peak_mb  # this level's peak
    sampler.peak_mb = max(peak0, peak)
    names = [NAMES[(first_index + i) % len(NAMES)] for i in range(n)]
    level = level_summary(callers, tasks, reports, wire_calls, names=names, turns=args.turns, peak_mb=peak,
                          refused=refused, wall_s=wall)
    if engine0 is not None:
        level["engine"] = {k: round(v - engine0[k], 3) for k, v in engine_counters(models).items()}
    return level


def engine_counters(models) -> dict[str, float] | None:
    """The in-process engine's scheduler counters (llm/scheduler.py), for a level's difference."""
    if models.engine is None:
        return None
    s = models.engine.scheduler
    return {"passes": s.passes, "deferred": s.deferred, "behind_background": s.behind_background,
            "behind_background_s": s.behind_background_s}


async def soak(cfg, models, lines_by_caller, args, sampler: Sampler) -> dict[str, Any]:
    concurrency = args.calls[0]
    # One bridge and one call handler for the whole run, as `specvoice serve` would be.
    server = await start_server(cfg, models, concurrency)
    end = time.monotonic() + args.soak
    rounds: list[dict] = []
    heap: list[tuple[float, dict[str, float]]] = []  # (t, heap_stats()) after each round, when quiet
    warm_t = None
    index = 0
    while time.monotonic() < end:
        lv = await run_level(cfg, models, lines_by_caller, concurrency, args, sampler,
                             first_index=index % len(lines_by_caller), server=server)
        index += concurrency
        gc.collect()
        sampler.sample()
        heap.append((sampler.samples[-1][0], heap_stats()))
        if warm_t is None:
            warm_t = time.monotonic()  # after one round: caches, pools and allocator arenas are warm
        rounds.append({k: lv[k] for k in ("completed", "calls", "turns_answered", "turns", "mixed", "late_frames",
                                          "v2v_p50_s", "v2v_p95_s", "v2v_parts_p50_s", "reports_missing",
                                          "extra_refused", "failures")})
        print_soak_round(len(rounds), lv, sampler.samples[-1], heap[-1][1])
    await server["bridge"].stop()
    total = {k: sum(r[k] for r in rounds) for k in ("calls", "completed", "turns_answered", "turns", "mixed",
                                                    "reports_missing", "late_frames")}
    return {
        "seconds": args.soak, "concurrency": concurrency, "rounds": len(rounds),
        **{k: total[k] for k in ("calls", "completed", "turns_answered", "turns", "mixed")},
        "reports_lost": total["reports_missing"], "late_frames": total["late_frames"],
        **soak_resources(sampler.samples, heap, warm_t),
        "rounds_detail": rounds,
    }


def load_models(args: argparse.Namespace):
    """(config, models, seconds to load) for the in-process bridge; None (said on stderr) if they cannot load."""
    from modelstore import ModelNotFoundError

    report_dir = args.reports or Path(tempfile.mkdtemp(prefix="specvoice-load-"))
    cfg = load_bench_config(args, report_dir)
    t = time.perf_counter()
    try:
        from pipeline.agent import AgentModels

        models = AgentModels.load(cfg, threads=agent_threads(args))
    except (ModelNotFoundError, OSError, RuntimeError, ValueError) as exc:
        print(f"specvoice bench load: cannot load the models: {exc}", file=sys.stderr)
        return None
    load_s = time.perf_counter() - t
    print(f"models loaded in {load_s:.1f} s: LLM {cfg.llm.target} ({cfg.llm.dtype}, drafter {cfg.llm.drafter}), "
          f"STT {cfg.stt.model}, TTS {cfg.tts.voice}; threads {threads_used(args, cfg)}; reports in {report_dir}",
          flush=True)
    return cfg, models, load_s


def run_in_process(args: argparse.Namespace, cfg, models) -> dict[str, Any]:
    """The levels of --calls (each on a bridge of its own), or the soak; {"levels", "largest_n_held"} or {"soak"}."""
    levels_n = sorted(set(args.calls))
    most = max(levels_n) if not args.soak else max(levels_n[0] * 2, len(NAMES))
    lines_by_caller = spoken_scripts(models.tts, most, args.turns)
    lines_by_caller = [lines_by_caller[i % len(lines_by_caller)] for i in range(max(most, len(lines_by_caller)))]

    async def main() -> dict[str, Any]:
        sampler = Sampler(args.sample_s if args.soak else 0.5)
        sampler.start()
        try:
            if args.soak:
                return {"soak": await soak(cfg, models, lines_by_caller, args, sampler)}
            levels = []
            for n in levels_n:
                apart = f", dialled {args.stagger:g} s apart" if args.stagger and n > 1 else ""
                print(f"level N={n}: {n} callers x {args.turns} turns{apart} ...", flush=True)
                lv = await run_level(cfg, models, lines_by_caller, n, args, sampler)
                levels.append(lv)
                for f in lv["failures"][:5]:
                    print(f"  {f}", flush=True)
            return {"levels": levels, "largest_n_held": judge(levels)}
        finally:
            await sampler.stop()

    return asyncio.run(main())
