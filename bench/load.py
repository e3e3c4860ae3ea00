"""`specvoice bench load`: N simulated phone callers at once against one bridge (a benchmark, not a test).

Also `--soak SECONDS`: calls placed back to back for that long, with memory, open file
descriptors and threads sampled throughout (steady memory = an RSS slope near zero).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import platform
import re
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import ROOT

HELP = "N simulated callers at once against one bridge; --soak for a long run of repeated calls"
DESCRIPTION = """\
Starts the telephony bridge on 127.0.0.1 (bearer token, bridge.max_calls = N) with the
agent behind it, and dials N simulated callers at once (the same wire protocol, pacing
and codec as Twilio: demo.caller.SimulatedCaller), each a multi-turn scripted call
spoken by Piper. One more caller than the limit dials while they talk: it must be
refused at the handshake (HTTP 503), never half-served. Every level is bounded in time
(--level-timeout) and ends by itself.

Per N: calls completed (every turn answered and the report written), turns answered,
audio frames sent (caller -> agent) and received (agent -> caller), late frames
(outbound gaps over 40 ms, counted by the bridge), p50/p95 voice_to_voice (server
report and caller side), peak RSS, and whether any call's answers mixed with another's:
each caller gives a distinct name and the report of its call must hold that name and
no other caller's. "Held" means every call complete, nothing mixed, the extra caller
refused, and p95 voice_to_voice at most 2x the single-call figure.

The default LLM is SmolLM2-135M (int8, n-gram drafter) with Whisper tiny.en and Piper,
one thread each: the embedded default 1.5B/0.5B pair answers one call at a time on 2
cores. Pass --config to load another setup as is (e.g. --config default).

  specvoice bench load --calls 1 2 4 6 --out load.json
  specvoice bench load --soak 900 --out soak.json       # 15 minutes of repeated calls

Past one process (--bridge, --spawn): the callers dial running `specvoice serve` processes
instead of a bridge in this process, round-robin over their URLs. A caller refused (HTTP 503)
or whose connection fails tries the next URL, as a load balancer that retries would; a
caller that tried every URL is "refused". Nothing else of a load balancer is imitated.
Levels run in the order given (--calls 2 2 is two rounds of 2). Per bridge: calls placed,
completed, cut by the bridge (it closed the call), refused. Per call the server's report is
looked up by call id in the report folders: every call that connected must have exactly
one report ("lost" counts those without), with an end_reason.

  --bridge URL [URL ...]   running bridges (ws://HOST:PORT/media-stream); the bearer token
                           from --token or $SPECVOICE_BRIDGE_TOKEN; --reports DIR is where
                           they write their reports (searched recursively; without it the
                           reports are not checked)
  --spawn N                this benchmark starts N `specvoice serve` processes on free ports,
                           each its own report folder (DIR/bridge-<i>), all with backend =
                           "openai" against ONE LLM server: --llm-url, or else a llama.cpp
                           server it starts (xllamacpp, via tests/realengine.py; --llm-model
                           names the catalog GGUF, default SmolLM2-135M)
  --stop-one-after S       (with --spawn) S seconds after the first call is dialled, stop the
                           process with the most calls in flight (SIGINT: it closes its calls
                           with WebSocket code 1001 and writes their reports before it exits)
  --stop-one-at-answer     (with --spawn) stop the process of the first call to hear its
                           first answer, at once (mid-call for sure, whatever the machine's speed)

  specvoice bench load --spawn 2 --calls 2 4 --stop-one-after 20 --out two-bridges.json
  specvoice bench load --spawn 2 --calls 2 2 --stop-one-at-answer --stop-signal TERM
  specvoice bench load --calls 4 --reports /srv/reports --bridge ws://10.0.0.5:8765/media-stream ws://10.0.0.6:8765/media-stream
                                                # token from $SPECVOICE_BRIDGE_TOKEN
"""

NAMES = ["Alice", "Robert", "Maria", "David", "Sarah", "James", "Emma", "Thomas", "Laura", "Peter", "Anna",
         "Daniel", "Julia", "Henry", "Olivia", "George"]
SECOND = ["How much does a cleaning cost?", "What are your opening hours on Saturday?",
          "Where are you located?", "Which dentists work there?"]
SMALL = "smollm2-135m-instruct"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calls", type=int, nargs="+", default=[1, 2, 4], help="concurrent calls per level (default: 1 2 4)")
    parser.add_argument("--turns", type=int, default=2, help="caller lines per call (default 2)")
    parser.add_argument("--config", help="config name or TOML file, used as is (default: SmolLM2 + whisper-tiny.en)")
    parser.add_argument("--threads", type=int, default=1, help="threads for torch, Whisper and Piper each (default 1)")
    parser.add_argument("--stt-workers", type=int, default=None,
                        help="Whisper transcriptions at once (stt.workers; default: the config's)")
    parser.add_argument("--max-new-tokens", type=int, default=40, help="LLM answer length cap (default 40)")
    parser.add_argument("--extra", type=int, default=1, help="callers over the limit that must get 503 (default 1)")
    parser.add_argument("--level-timeout", type=float, default=300.0, help="seconds per level before giving up")
    parser.add_argument("--soak", type=float, metavar="SECONDS", help="repeat calls for this long instead of levels")
    parser.add_argument("--sample-s", type=float, default=5.0, help="soak: seconds between resource samples")
    parser.add_argument("--reports", type=Path, help="keep the call reports here (default: a temporary folder)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    past = parser.add_argument_group("past one process (see the description above)")
    past.add_argument("--bridge", nargs="+", metavar="URL", help="running bridges: ws://HOST:PORT/media-stream ...")
    past.add_argument("--token", help="bearer token of the --bridge URLs (default: $SPECVOICE_BRIDGE_TOKEN)")
    past.add_argument("--spawn", type=int, metavar="N", help="start N `specvoice serve` processes and dial them")
    past.add_argument("--llm-url", help="--spawn: the OpenAI-compatible server's base URL (ends in /v1); "
                                        "default: start a llama.cpp server")
    past.add_argument("--llm-name", default="model", help="--spawn with --llm-url: the server's model name")
    past.add_argument("--llm-model", default=SMALL, help=f"--spawn: catalog model whose GGUF the llama.cpp "
                                                         f"server serves (default {SMALL})")
    past.add_argument("--llm-threads", type=int, default=1, help="--spawn: llama.cpp server threads (default 1)")
    past.add_argument("--max-calls", type=int, help="--spawn: bridge.max_calls of each process "
                                                    "(default: the largest --calls, so one can take a whole level)")
    past.add_argument("--stop-one-after", type=float, metavar="S", help="--spawn: stop one process S s into the run")
    past.add_argument("--stop-one-at-answer", action="store_true",
                      help="--spawn: stop one process once one of its calls heard its first answer")
    past.add_argument("--stop-signal", choices=["INT", "TERM"], default="INT",
                      help="signal for the stop (default INT: calls in flight closed at once, reports written; "
                           "TERM: serve drains, taking no new calls and ending once its calls in flight have)")


# ---------------------------------------------------------------- set-up


def load_bench_config(args: argparse.Namespace, report_dir: Path):
    from pipeline.config import load_config

    if args.config:
        cfg = load_config(args.config)
    else:
        cfg = load_config("test")
        cfg = cfg.model_copy(update={
            "llm": cfg.llm.model_copy(update={"target": SMALL, "draft": None, "drafter": "ngram", "dtype": "int8",
                                              "gamma": 4, "temperature": 0.0, "threads": args.threads}),
            "stt": cfg.stt.model_copy(update={"model": "whisper-tiny.en"}),
        })
    if args.stt_workers:
        cfg = cfg.model_copy(update={"stt": cfg.stt.model_copy(update={"workers": args.stt_workers})})
    return cfg.model_copy(update={
        "llm": cfg.llm.model_copy(update={"max_new_tokens": args.max_new_tokens}),
        "report": cfg.report.model_copy(update={"dir": str(report_dir)}),
        "mqtt": cfg.mqtt.model_copy(update={"enabled": False}),
    })


def script_for(index: int, turns: int) -> list[str]:
    name = NAMES[index % len(NAMES)]
    lines = [f"Hi, my name is {name}. Are you open on Saturday?"]
    for t in range(1, turns):
        lines.append(SECOND[(index + t) % len(SECOND)] if t % 2 else "Can you tell me my name, please?")
    return lines


class Sampler:
    """RSS (MB), open file descriptors and threads of this process, every `period` s."""

    def __init__(self, period: float):
        import psutil

        self.proc = psutil.Process()
        self.period = period
        self.samples: list[tuple[float, float, int, int]] = []  # (t, rss MB, fds, threads)
        self.peak_mb = 0.0
        self._task: asyncio.Task | None = None

    def sample(self) -> tuple[float, float, int, int]:
        rss = self.proc.memory_info().rss / 2 ** 20
        self.peak_mb = max(self.peak_mb, rss)
        s = (time.monotonic(), rss, self.proc.num_fds(), self.proc.num_threads())
        self.samples.append(s)
        return s

    async def _loop(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.period)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.sample()


def heap_stats() -> dict[str, float]:
    """Where this process's memory is, to tell a leak from allocator behaviour when RSS
    grows: live Python objects and blocks, and what glibc malloc holds in use (torch's
    CPU tensors included) against what it has taken from the system. Live figures flat
    while RSS climbs means fragmentation or arenas kept, not lost objects."""
    import ctypes
    import ctypes.util
    import sys

    out: dict[str, float] = {"python_blocks": sys.getallocatedblocks(), "gc_objects": len(gc.get_objects())}

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        m = libc.mallinfo2()
        out["malloc_in_use_mb"] = (m.uordblks + m.hblkhd) / 2 ** 20
        out["malloc_held_mb"] = (m.arena + m.hblkhd) / 2 ** 20
    except (OSError, AttributeError):  # not glibc (or older than 2.33): Python figures only
        pass
    return out


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (t seconds, y) in y per minute."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return None
    return 60.0 * sum((t - mt) * (y - my) for t, y in points) / var


def _pct(values: list[float], q: float) -> float | None:
    from pipeline.report import percentile

    return percentile(values, q) if values else None


def _words(text: str) -> set[str]:
    return {w.lower() for w in re.findall(r"[A-Za-z]+", text or "")}


# ---------------------------------------------------------------- one level


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


async def run_level(cfg, models, lines_by_caller: list, n: int, args: argparse.Namespace, sampler: Sampler,
                    first_index: int = 0, server: dict | None = None) -> dict[str, Any]:
    """N callers at once; on a bridge of its own (max_calls = N), or on `server` (kept running)."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    from demo.caller import SimulatedCaller
    from pipeline.report import load_report
    from pipeline.timeline import V2V_PARTS

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
    t0 = time.monotonic()
    tasks = [asyncio.create_task(c.run()) for c in callers]
    refused: list[int | str] = []
    try:
        # Once all N are in, the extra callers must be turned away at the handshake.
        deadline = time.monotonic() + 30
        while bridge.active_calls < n and time.monotonic() < deadline and not all(t.done() for t in tasks):
            await asyncio.sleep(0.05)
        for _ in range(args.extra):
            try:
                async with connect(url, additional_headers={"Authorization": f"Bearer {token}"}, open_timeout=10):
                    refused.append("accepted")
            except InvalidStatus as exc:
                refused.append(exc.response.status_code)
            except Exception as exc:  # noqa: BLE001 - recorded, not fatal to the benchmark
                refused.append(type(exc).__name__)
        done, pending = await asyncio.wait(tasks, timeout=args.level_timeout)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
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
    names = [NAMES[(first_index + i) % len(NAMES)] for i in range(n)]
    completed = turns_answered = frames_out = frames_in = mixed = reports_missing = 0
    v2v_server: list[float] = []
    v2v_caller: list[float] = []
    # The spans voice_to_voice is the sum of, to see which stage grows with N.
    parts: dict[str, list[float]] = {part: [] for part in V2V_PARTS}
    name_heard = 0
    failures: list[str] = []
    for i, (caller, task) in enumerate(zip(callers, tasks)):
        result = caller.result
        frames_out += len(result.caller_track) // 160  # one media message per 20 ms
        frames_in += result.media_in
        answered = [t for t in result.turns if t.first_agent_audio_t is not None]
        turns_answered += len(answered)
        v2v_caller += [t.voice_to_voice for t in answered]
        data = reports.get(result.call_sid)
        if data is None:
            reports_missing += 1
            failures.append(f"caller {i}: no report")
            continue
        text_of = lambda key: " ".join(t.get(key) or "" for t in data["turns"])  # noqa: E731
        own = names[i].lower()
        words = _words(text_of("user_text")) | _words(text_of("agent_text"))
        others = {m.lower() for m in names if m.lower() != own}
        if words & others or result.bad_messages:
            mixed += 1
            failures.append(f"caller {i} ({names[i]}): foreign names {sorted(words & others)} "
                            f"or bad messages {result.bad_messages[:2]}")
        if own in _words(text_of("user_text")):
            name_heard += 1
        v2v_server += [t["metrics"]["voice_to_voice"] for t in data["turns"]
                       if t["metrics"].get("voice_to_voice") is not None]
        for t in data["turns"]:
            for part in V2V_PARTS:
                if t["metrics"].get(part) is not None:
                    parts[part].append(t["metrics"][part])
        ok = (task.done() and not task.cancelled() and task.exception() is None
              and len(answered) == len(caller.lines) and len(data["turns"]) == len(caller.lines)
              and data["end_reason"] == "caller_hangup" and not data.get("error"))
        if ok:
            completed += 1
        else:
            exc = task.exception() if task.done() and not task.cancelled() else None
            failures.append(f"caller {i}: {len(answered)}/{len(caller.lines)} answered, report "
                            f"{len(data['turns'])} turns, end {data['end_reason']}, error {data.get('error')}, "
                            f"task {'timeout' if not task.done() or task.cancelled() else exc!r}")
    late = sum(c.output.stats.late_frames for c in wire_calls)
    sent_by_bridge = sum(c.stats.frames_sent for c in wire_calls)
    peak = sampler.peak_mb  # this level's peak
    sampler.peak_mb = max(peak0, peak)
    return {
        "calls": n,
        "completed": completed,
        "turns": n * args.turns,
        "turns_answered": turns_answered,
        "frames_sent_by_callers": frames_out,
        "frames_received_by_callers": frames_in,
        "frames_sent_by_bridge": sent_by_bridge,
        "late_frames": late,
        "max_gap_ms": round(max([c.output.stats.max_gap_s for c in wire_calls] or [0.0]) * 1000, 1),
        "inbound_dropped": sum(c.stats.inbound_dropped for c in wire_calls),
        "v2v_p50_s": _pct(v2v_server, 0.5),
        "v2v_p95_s": _pct(v2v_server, 0.95),
        "v2v_caller_p50_s": _pct(v2v_caller, 0.5),
        "v2v_caller_p95_s": _pct(v2v_caller, 0.95),
        "v2v_parts_p50_s": {part: _pct(values, 0.5) for part, values in parts.items()},
        "v2v_parts_p95_s": {part: _pct(values, 0.95) for part, values in parts.items()},
        "peak_rss_mb": round(peak, 1),
        "mixed": mixed,
        "own_name_in_transcript": name_heard,
        "reports_missing": reports_missing,
        "extra_refused": refused,
        "wall_s": round(wall, 1),
        "failures": failures,
    }


# ---------------------------------------------------------------- output


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def print_table(levels: list[dict]) -> None:
    head = (f"{'N':>3} {'done':>5} {'turns':>7} {'frames out':>10} {'frames in':>9} {'late':>5} "
            f"{'v2v p50':>8} {'v2v p95':>8} {'caller p95':>10} {'peak RSS':>9} {'mixed':>5} {'extra':>8} held")
    print(head)
    print("-" * len(head))
    for lv in levels:
        extra = ",".join(str(x) for x in lv["extra_refused"]) or "-"
        print(f"{lv['calls']:>3} {lv['completed']:>2}/{lv['calls']:<2} {lv['turns_answered']:>3}/{lv['turns']:<3} "
              f"{lv['frames_sent_by_callers']:>10} {lv['frames_received_by_callers']:>9} {lv['late_frames']:>5} "
              f"{_ms(lv['v2v_p50_s']):>8} {_ms(lv['v2v_p95_s']):>8} {_ms(lv['v2v_caller_p95_s']):>10} "
              f"{lv['peak_rss_mb']:>7.0f}MB {lv['mixed']:>5} {extra:>8} {'yes' if lv.get('held') else 'no'}")
    print("(v2v in ms: server report p50/p95, caller side p95; late = outbound gaps > 40 ms; "
          "extra = HTTP status of the callers over the limit)")
    print("\nwhere voice-to-voice went, p50 ms of each span (per turn the spans add up to voice-to-voice):")
    for lv in levels:
        parts = lv.get("v2v_parts_p50_s") or {}
        print(f"{lv['calls']:>3}  " + "  ".join(f"{name} {_ms(value)}" for name, value in parts.items()))


def judge(levels: list[dict]) -> int | None:
    base = next((lv for lv in levels if lv["calls"] == 1), None)
    limit = 2 * base["v2v_p95_s"] if base and base["v2v_p95_s"] else None
    best = None
    for lv in levels:
        lv["held"] = bool(lv["completed"] == lv["calls"] and lv["mixed"] == 0 and not lv["reports_missing"]
                          and all(x == 503 for x in lv["extra_refused"])
                          and limit is not None and lv["v2v_p95_s"] is not None and lv["v2v_p95_s"] <= limit)
        if lv["held"]:
            best = max(best or 0, lv["calls"])
    return best


# ---------------------------------------------------------------- soak


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
        h = heap[-1][1]
        malloc = f", malloc in use {h['malloc_in_use_mb']:.0f} of {h['malloc_held_mb']:.0f} MB" if "malloc_held_mb" in h else ""
        print(f"  soak round {len(rounds)}: {lv['completed']}/{lv['calls']} complete, "
              f"v2v p95 {_ms(lv['v2v_p95_s'])} ms, RSS {sampler.samples[-1][1]:.0f} MB{malloc}, "
              f"objects {h['gc_objects']}, fds {sampler.samples[-1][2]}, threads {sampler.samples[-1][3]}", flush=True)
    await server["bridge"].stop()
    after = [s for s in sampler.samples if warm_t is not None and s[0] >= warm_t]
    t_base = after[0][0] if after else 0.0
    first, last = (after[0], after[-1]) if after else (None, None)
    calls = sum(r["calls"] for r in rounds)
    heap_after = [(t - t_base, h) for t, h in heap if warm_t is not None and t >= warm_t]
    return {
        "seconds": args.soak,
        "concurrency": concurrency,
        "rounds": len(rounds),
        "calls": calls,
        "completed": sum(r["completed"] for r in rounds),
        "turns_answered": sum(r["turns_answered"] for r in rounds),
        "turns": sum(r["turns"] for r in rounds),
        "mixed": sum(r["mixed"] for r in rounds),
        "reports_lost": sum(r["reports_missing"] for r in rounds),
        "late_frames": sum(r["late_frames"] for r in rounds),
        "rss_slope_mb_per_min": slope_per_min([(t - t_base, rss) for t, rss, _, _ in after]),
        # Allocator warm-up shows as early steps; a leak keeps climbing in the second half too.
        "rss_slope_second_half_mb_per_min": slope_per_min(
            [(t - t_base, rss) for t, rss, _, _ in after if t - t_base >= (after[-1][0] - t_base) / 2] if after else []),
        "fds_slope_per_min": slope_per_min([(t - t_base, fds) for t, _, fds, _ in after]),
        "threads_slope_per_min": slope_per_min([(t - t_base, th) for t, _, _, th in after]),
        "rss_mb_first_last": [round(first[1], 1), round(last[1], 1)] if first else None,
        "fds_first_last_max": [first[2], last[2], max(s[2] for s in after)] if first else None,
        "threads_first_last_max": [first[3], last[3], max(s[3] for s in after)] if first else None,
        # Per round, after gc: slopes of live Python objects and of malloc's in-use and held bytes.
        "heap_slopes_per_min": {key: slope_per_min([(t, h[key]) for t, h in heap_after if key in h])
                                for key in (heap_after[0][1] if heap_after else {})},
        "heap_first_last": {key: [heap_after[0][1][key], heap_after[-1][1][key]] for key in heap_after[0][1]}
                           if heap_after else None,
        "samples": [[round(t - t_base, 1), round(rss, 1), fds, th] for t, rss, fds, th in after],
        "rounds_detail": rounds,
    }


# ---------------------------------------------------------------- entry point


def run(args: argparse.Namespace) -> int:
    # Quieter bridge logs for the benchmark's duration only: in-process callers (the
    # tests) keep the levels they had.
    loggers = [logging.getLogger(name) for name in ("pipeline.transports.telephony.server", "pipeline.transports.telephony.server.websockets")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        return _run(args)
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _run(args: argparse.Namespace) -> int:
    if args.bridge or args.spawn:
        return run_bridges(args)
    from modelstore import ModelNotFoundError

    report_dir = args.reports or Path(tempfile.mkdtemp(prefix="specvoice-load-"))
    cfg = load_bench_config(args, report_dir)
    levels_n = sorted(set(args.calls))
    if min(levels_n) < 1 or args.turns < 1:
        print("specvoice bench load: --calls and --turns must be >= 1", file=sys.stderr)
        return 2
    t = time.perf_counter()
    try:
        from demo.caller import prepare_lines
        from pipeline.agent import AgentModels

        models = AgentModels.load(cfg, threads=args.threads)
    except (ModelNotFoundError, OSError, RuntimeError, ValueError) as exc:
        print(f"specvoice bench load: cannot load the models: {exc}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - t
    most = max(levels_n) if not args.soak else max(levels_n[0] * 2, len(NAMES))
    lines_by_caller = [prepare_lines([{"text": x} for x in script_for(i, args.turns)], models.tts)
                       for i in range(min(most, len(NAMES)))]
    lines_by_caller = [lines_by_caller[i % len(lines_by_caller)] for i in range(max(most, len(lines_by_caller)))]
    print(f"models loaded in {load_s:.1f} s: LLM {cfg.llm.target} ({cfg.llm.dtype}, drafter {cfg.llm.drafter}), "
          f"STT {cfg.stt.model}, TTS {cfg.tts.voice}; {args.threads} thread(s) each; reports in {report_dir}",
          flush=True)

    async def main() -> dict[str, Any]:
        sampler = Sampler(args.sample_s if args.soak else 0.5)
        sampler.start()
        try:
            if args.soak:
                return {"soak": await soak(cfg, models, lines_by_caller, args, sampler)}
            levels = []
            for n in levels_n:
                print(f"level N={n}: {n} callers x {args.turns} turns ...", flush=True)
                lv = await run_level(cfg, models, lines_by_caller, n, args, sampler)
                levels.append(lv)
                for f in lv["failures"][:5]:
                    print(f"  {f}", flush=True)
            return {"levels": levels, "largest_n_held": judge(levels)}
        finally:
            await sampler.stop()

    result = asyncio.run(main())
    meta = {
        "bench": "load",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "llm": {"target": cfg.llm.target, "draft": cfg.llm.draft, "drafter": cfg.llm.drafter, "dtype": cfg.llm.dtype,
                "max_new_tokens": cfg.llm.max_new_tokens},
        "stt": cfg.stt.model, "stt_workers": cfg.stt.workers, "tts": cfg.tts.voice, "threads": args.threads, "turns_per_call": args.turns,
        "config": args.config or "built-in small (SmolLM2-135M int8 + whisper-tiny.en + Piper)",
        "models_load_s": round(load_s, 1),
    }
    out = {**meta, **result}
    if "levels" in result:
        print()
        print_table(result["levels"])
        held = result["largest_n_held"]
        print(f"\nlargest N held (all complete, none mixed, extra refused 503, p95 v2v <= 2x single call): {held}")
    else:
        s = result["soak"]
        print(f"\nsoak {s['seconds']:.0f} s: {s['completed']}/{s['calls']} calls complete, "
              f"{s['turns_answered']}/{s['turns']} turns, mixed {s['mixed']}, reports lost {s['reports_lost']}")
        slope = s["rss_slope_mb_per_min"]
        half = s["rss_slope_second_half_mb_per_min"]
        print(f"RSS slope {slope if slope is None else round(slope, 3)} MB/min, second half "
              f"{half if half is None else round(half, 3)} MB/min (first/last {s['rss_mb_first_last']} MB); "
              f"fds first/last/max {s['fds_first_last_max']}; threads first/last/max {s['threads_first_last_max']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


# ---------------------------------------------------------------- past one process: --bridge, --spawn


def _simulated_caller_class():
    from demo.caller import SimulatedCaller

    class BridgeCaller(SimulatedCaller):
        """A SimulatedCaller that notices when the bridge closes the call under it (a stopped
        process): the base caller's sender dies with the connection and its script would then
        wait for a line that is never sent. Here the script ends and `run()` raises
        BridgeClosed, with the close code and reason."""

        connected = False
        closed_by_bridge: tuple[int | None, str | None] | None = None

        async def _script(self) -> None:
            self.connected = True
            script = asyncio.ensure_future(super()._script())
            closed = asyncio.ensure_future(self._ws.wait_closed())
            try:
                await asyncio.wait({script, closed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                closed.cancel()
                if not script.done():
                    script.cancel()
                await asyncio.gather(closed, return_exceptions=True)
            if script.cancelled():
                self.closed_by_bridge = (self._ws.close_code, self._ws.close_reason)
                raise BridgeClosed(self.closed_by_bridge)
            script.result()

    return BridgeCaller


class BridgeClosed(Exception):
    pass


def spawn_config(args: argparse.Namespace, path: Path, llm_url: str, llm_name: str, report_dir: Path,
                 max_calls: int) -> Path:
    """A serve config on top of --config (or the small `test` setup with whisper-tiny.en, as
    the in-process benchmark uses): backend openai against the one LLM server, this process's
    report folder, max_calls, no MQTT."""
    base = args.config or "test"
    if Path(base).suffix:
        base = str(Path(base).resolve())
    stt = "" if args.config else '[stt]\nmodel = "whisper-tiny.en"\n\n'
    path.write_text(f"""base = {json.dumps(base)}

[llm]
backend = "openai"
max_new_tokens = {args.max_new_tokens}
temperature = 0.0
seed = 0

[llm.openai]
base_url = {json.dumps(llm_url)}
model = {json.dumps(llm_name)}
timeout_s = 120

{stt}[report]
dir = {json.dumps(str(report_dir))}

[bridge]
max_calls = {max_calls}

[mqtt]
enabled = false
""")
    return path


def _default_sigint() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


class ServeProcess:
    """`specvoice serve --port 0` as a subprocess (its own session), output to a log file;
    `wait_port()` polls the log for the listening line, printed once the models are loaded."""

    LISTENING = re.compile(r"specvoice bridge listening on [^:]+:(\d+)")

    def __init__(self, config: Path, token: str, log: Path) -> None:
        import subprocess

        env = {**os.environ, "SPECVOICE_BRIDGE_TOKEN": token, "PYTHONUNBUFFERED": "1"}
        env.pop("TWILIO_AUTH_TOKEN", None)
        self.log = log
        self._out = open(log, "wb")
        command = [sys.executable, "-m", "demo.cli", "serve", "--port", "0", "--config", str(config)]
        # SIGINT back to its default in the child: a benchmark started in the background by a
        # non-interactive shell has SIGINT ignored, a child would inherit that, and then the
        # SIGINT stop (and the clean-up below) would not reach serve at all.
        self.proc = subprocess.Popen(command,
                                     cwd=ROOT, env=env, stdout=self._out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=_default_sigint)
        self.port: int | None = None

    def wait_port(self, timeout_s: float = 600.0) -> int:
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.LISTENING.search(self.tail(100_000))
            if m:
                self.port = int(m.group(1))
                return self.port
            if self.proc.poll() is not None:
                raise RuntimeError(f"specvoice serve exited with {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"specvoice serve was not listening within {timeout_s:g} s:\n{self.tail()}")
            time.sleep(0.2)  # polling the log for the listening line (models loading)

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGINT (the clean stop), SIGKILL if it does not end."""
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._out.close()
        return self.proc.returncode


def start_llm_server(args: argparse.Namespace, log: Path, parallel: int):
    """llama.cpp's server (xllamacpp) for the catalog model's GGUF, through tests/realengine.py
    (run from the source tree): one server, `parallel` slots, behind every spawned process."""
    tests = ROOT / "tests"
    if str(tests) not in sys.path:
        sys.path.insert(0, str(tests))
    import realengine

    reason = realengine.engine_missing_reason()
    if reason:
        raise RuntimeError(reason)

    class Server(realengine.LlamaServer):
        def command(self) -> list[str]:  # LlamaServer starts one slot; the calls share this server
            return [*super().command(), "--parallel", str(parallel)]

    server = Server(realengine.gguf_file(args.llm_model), threads=args.llm_threads, ctx=2048 * parallel,
                    alias="model", log_path=log)
    return server.start()


def report_index(dirs: list[Path]) -> dict[str, list[tuple[int, dict]]]:
    """call id -> [(folder index, report)] over every report in the folders (recursively)."""
    from pipeline.report import load_report

    found: dict[str, list[tuple[int, dict]]] = {}
    for i, folder in enumerate(dirs):
        for path in sorted(folder.rglob("*.json")) if folder.is_dir() else []:
            try:
                data = load_report(path)
            except Exception:  # noqa: BLE001 - not a call report (or being written): skipped
                continue
            found.setdefault(str(data["call_id"]), []).append((i, data))
    return found


async def bridge_level(urls: list[str], token: str | None, lines_by_caller: list, n: int, first_index: int,
                       args: argparse.Namespace, run: dict) -> list[dict]:
    """N callers at once over the bridges; returns one record per caller."""
    from websockets.exceptions import InvalidStatus

    BridgeCaller = _simulated_caller_class()

    async def dial(i: int) -> dict:
        index = first_index + i
        start = run["next"]
        run["next"] += 1
        rec: dict[str, Any] = {"caller": index, "name": NAMES[index % len(NAMES)], "attempts": [], "bridge": None,
                               "outcome": "refused", "call_sid": None}
        for k in range(len(urls)):
            b = (start + k) % len(urls)
            caller = BridgeCaller(urls[b], lines_by_caller[index % len(lines_by_caller)], token=token,
                                  expect_greeting=True, silence_s=1.0, reply_timeout_s=min(90.0, args.level_timeout))
            rec["call_sid"] = caller.result.call_sid
            live = {"bridge": b, "caller": caller}
            run["live"].append(live)
            t = time.monotonic() - run["t0"]
            try:
                await caller.run()
                rec["outcome"] = "done"
            except InvalidStatus as exc:  # refused at the handshake (503 when full)
                rec["attempts"].append({"bridge": b, "t": round(t, 2), "result": exc.response.status_code})
                continue
            except BridgeClosed as exc:
                rec["outcome"] = "cut"
                rec["close"] = list(exc.args[0])
            except Exception as exc:  # noqa: BLE001 - a failed connection goes to the next URL
                if not caller.connected:
                    rec["attempts"].append({"bridge": b, "t": round(t, 2), "result": type(exc).__name__})
                    continue
                rec["outcome"] = "failed"
                rec["error"] = repr(exc)
            finally:
                run["live"].remove(live)
            rec["attempts"].append({"bridge": b, "t": round(t, 2), "result": "connected"})
            rec["bridge"] = b
            turns = caller.result.turns
            answered = [x for x in turns if x.first_agent_audio_t is not None]
            rec["lines"] = len(caller.lines)
            rec["answered"] = len(answered)
            rec["v2v_caller"] = [x.voice_to_voice for x in answered]
            rec["bad_messages"] = caller.result.bad_messages[:3]
            return rec
        return rec

    tasks = [asyncio.create_task(dial(i)) for i in range(n)]
    done, pending = await asyncio.wait(tasks, timeout=args.level_timeout)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return [t.result() if t in done and not t.cancelled() else {"caller": first_index + i, "outcome": "timeout",
                                                                "bridge": None, "attempts": []}
            for i, t in enumerate(tasks)]


async def stop_one(procs: list[ServeProcess], args: argparse.Namespace, run: dict) -> None:
    """Stop one serve process mid-run: after --stop-one-after seconds the one with the most
    calls in flight (the lowest index on a tie); with --stop-one-at-answer the one whose call
    heard its first answer first (so that call is cut between its turns or in one)."""
    import signal

    victim = None
    while victim is None:
        if args.stop_one_after is not None and time.monotonic() - run["t0"] >= args.stop_one_after:
            in_flight = [sum(1 for x in run["live"] if x["bridge"] == b and x["caller"].connected)
                         for b in range(len(procs))]
            victim = max(range(len(procs)), key=lambda b: (in_flight[b], -b))
        elif args.stop_one_at_answer:
            # The bridge of a call that heard its first answer and is still on the line.
            heard = [x["bridge"] for x in run["live"]
                     if x["caller"].result.turns and x["caller"].result.turns[0].first_agent_audio_t]
            victim = min(heard) if heard else None
        if victim is None:
            await asyncio.sleep(0.05)  # polling the callers' state: the trigger is theirs, not a timer
    sig = signal.SIGINT if args.stop_signal == "INT" else signal.SIGTERM
    run["stop"] = {"bridge": victim, "signal": f"SIG{args.stop_signal}", "t": round(time.monotonic() - run["t0"], 2),
                   "in_flight": [x["caller"].result.call_sid for x in run["live"]
                                 if x["bridge"] == victim and x["caller"].connected]}
    procs[victim].proc.send_signal(sig)
    print(f"  stopped bridge {victim} with SIG{args.stop_signal} at {run['stop']['t']:.1f} s "
          f"({len(run['stop']['in_flight'])} call(s) in flight on it)", flush=True)
    code = await asyncio.to_thread(procs[victim].proc.wait)
    run["stop"]["exit_code"] = code
    run["stop"]["exit_t"] = round(time.monotonic() - run["t0"], 2)


def summarize_level(records: list[dict], reports: dict[str, list[tuple[int, dict]]], n_bridges: int,
                    by_bridge: bool, stop: dict | None) -> dict[str, Any]:
    """Per level: outcomes, reports per call id (exactly one each, in the folder of the bridge
    it connected to when folders are per bridge), mixing, voice-to-voice; per bridge counts."""
    names = [r["name"] for r in records if "name" in r]
    bridges = [{"placed": 0, "completed": 0, "cut": 0, "refused": 0, "connect_failed": 0} for _ in range(n_bridges)]
    lv: dict[str, Any] = {"calls": len(records), "completed": 0, "cut": 0, "refused": 0, "failed": 0,
                          "reports_checked": reports is not None, "reports_missing": 0, "reports_duplicated": 0,
                          "reports_wrong_bridge": 0, "reports_without_end": 0, "mixed": 0,
                          "cut_end_reasons": [], "failures": []}
    v2v_caller: list[float] = []
    v2v_server: list[float] = []
    for r in records:
        for a in r["attempts"]:
            if a["result"] == "connected":
                bridges[a["bridge"]]["placed"] += 1
            elif isinstance(a["result"], int):
                bridges[a["bridge"]]["refused"] += 1
            else:
                bridges[a["bridge"]]["connect_failed"] += 1
        if r["bridge"] is None:
            lv["refused" if r["outcome"] == "refused" else "failed"] += 1
            if r["outcome"] != "refused":
                lv["failures"].append(f"caller {r['caller']}: {r['outcome']}")
            continue
        b = r["bridge"]
        v2v_caller += r["v2v_caller"]
        data = None
        if reports is not None:
            got = reports.get(r["call_sid"], [])
            r["reports"] = len(got)
            if not got:
                lv["reports_missing"] += 1
                lv["failures"].append(f"caller {r['caller']} on bridge {b}: no report ({r['outcome']})")
            elif len(got) > 1:
                lv["reports_duplicated"] += 1
            if by_bridge and any(folder != b for folder, _ in got):
                lv["reports_wrong_bridge"] += 1
            if got:
                data = got[0][1]
                r["end_reason"] = data["end_reason"]
                if data["end_reason"] in (None, "", "unfinished"):
                    lv["reports_without_end"] += 1
                r["report_turns"] = len(data["turns"])
                v2v_server += [t["metrics"]["voice_to_voice"] for t in data["turns"]
                               if t["metrics"].get("voice_to_voice") is not None]
                text = " ".join((t.get("user_text") or "") + " " + (t.get("agent_text") or "") for t in data["turns"])
                others = {m.lower() for m in names if m != r["name"]}
                if _words(text) & others or r["bad_messages"]:
                    lv["mixed"] += 1
                    lv["failures"].append(f"caller {r['caller']}: foreign names {sorted(_words(text) & others)}")
        if r["outcome"] == "cut":
            lv["cut"] += 1
            bridges[b]["cut"] += 1
            lv["cut_end_reasons"].append(r.get("end_reason"))
        elif (r["outcome"] == "done" and r["answered"] == r["lines"]
              and (data is None or (data["end_reason"] == "caller_hangup" and len(data["turns"]) == r["lines"]))):
            lv["completed"] += 1
            bridges[b]["completed"] += 1
        else:
            lv["failed"] += 1
            lv["failures"].append(f"caller {r['caller']} on bridge {b}: {r['outcome']}, {r.get('answered')}/"
                                  f"{r.get('lines')} answered, end {r.get('end_reason')}, {r.get('error', '')}")
    lv["connected"] = sum(1 for r in records if r["bridge"] is not None)
    # Lost: connected, and no report with an end_reason to show for it.
    lv["lost"] = lv["reports_missing"] + lv["reports_without_end"] if reports is not None else None
    lv["v2v_p50_s"] = _pct(v2v_server, 0.5)
    lv["v2v_p95_s"] = _pct(v2v_server, 0.95)
    lv["v2v_caller_p50_s"] = _pct(v2v_caller, 0.5)
    lv["v2v_caller_p95_s"] = _pct(v2v_caller, 0.95)
    lv["bridges"] = bridges
    if stop is not None:
        # Calls dialled after the stop: where they went, and the stopped bridge's failed connects.
        after = [a for r in records for a in r["attempts"] if a["t"] >= stop["t"]]
        lv["after_stop"] = {"placed_on": sorted({a["bridge"] for a in after if a["result"] == "connected"}),
                            "attempts_on_stopped": sum(1 for a in after if a["bridge"] == stop["bridge"]),
                            "placed_on_stopped": sum(1 for a in after if a["bridge"] == stop["bridge"]
                                                     and a["result"] == "connected")}
    lv["callers"] = records
    return lv


def print_bridge_table(levels: list[dict], stop: dict | None) -> None:
    for i, lv in enumerate(levels):
        lost = "-" if lv["lost"] is None else lv["lost"]
        print(f"round {i + 1}: {lv['calls']} calls: {lv['completed']} completed, {lv['cut']} cut by a stopped bridge "
              f"(report end_reason {lv['cut_end_reasons'] or '-'}), {lv['refused']} refused everywhere, "
              f"{lv['failed']} failed; reports lost {lost}, duplicated {lv['reports_duplicated']}, "
              f"in another bridge's folder {lv['reports_wrong_bridge']}; mixed {lv['mixed']}; "
              f"caller v2v p50/p95 {_ms(lv['v2v_caller_p50_s'])}/{_ms(lv['v2v_caller_p95_s'])} ms, "
              f"server {_ms(lv['v2v_p50_s'])}/{_ms(lv['v2v_p95_s'])} ms")
        for b, s in enumerate(lv["bridges"]):
            print(f"    bridge {b}: placed {s['placed']}, completed {s['completed']}, cut {s['cut']}, "
                  f"refused {s['refused']}, connect failed {s['connect_failed']}")
        if "after_stop" in lv and lv["after_stop"]["attempts_on_stopped"] + len(lv["after_stop"]["placed_on"]):
            a = lv["after_stop"]
            print(f"    after the stop: placed on bridges {a['placed_on']}; {a['attempts_on_stopped']} attempt(s) "
                  f"on the stopped bridge, {a['placed_on_stopped']} connected")
    if stop is not None:
        print(f"stop: bridge {stop['bridge']} got {stop['signal']} at {stop['t']:.1f} s with "
              f"{len(stop['in_flight'])} call(s) in flight; exit code {stop.get('exit_code')}")


def run_bridges(args: argparse.Namespace) -> int:
    """--bridge / --spawn: callers over running `specvoice serve` processes."""
    import contextlib

    def fail(msg: str) -> int:
        print(f"specvoice bench load: {msg}", file=sys.stderr)
        return 2

    if args.bridge and args.spawn:
        return fail("--bridge and --spawn exclude each other")
    if (args.stop_one_after is not None or args.stop_one_at_answer) and not args.spawn:
        return fail("--stop-one-after / --stop-one-at-answer need --spawn (this benchmark must own the process)")
    if args.soak:
        return fail("--soak runs in process only")
    if min(args.calls) < 1 or args.turns < 1 or (args.spawn is not None and args.spawn < 1):
        return fail("--calls, --turns and --spawn must be >= 1")
    levels_n = list(args.calls)  # in the order given: --calls 2 2 is two rounds of 2
    # --bridge: the running bridges' token; --spawn: a fresh one, given to the processes it starts.
    token = (args.token or os.environ.get("SPECVOICE_BRIDGE_TOKEN")) if args.bridge else secrets.token_urlsafe(24)
    try:
        from demo.caller import prepare_lines
        from pipeline.config import load_config
        from modelstore import resolve_model
        from voice.tts import load_tts

        voice = load_config(args.config).tts.voice if args.config else "piper-joe-medium"
        tts = load_tts("piper", resolve_model(voice), threads=args.threads)
    except Exception as exc:  # noqa: BLE001 - a one-line error, not a traceback
        return fail(f"cannot load the callers' voice: {exc}")
    most = max(levels_n)
    lines_by_caller = [prepare_lines([{"text": x} for x in script_for(i, args.turns)], tts)
                       for i in range(min(sum(levels_n), len(NAMES)))]

    with contextlib.ExitStack() as stack:
        procs: list[ServeProcess] = []
        meta: dict[str, Any] = {}
        if args.spawn:
            work = args.reports or Path(tempfile.mkdtemp(prefix="specvoice-load-bridges-"))
            work.mkdir(parents=True, exist_ok=True)
            t = time.monotonic()
            llm_url, llm_name = args.llm_url, args.llm_name
            if not llm_url:
                try:
                    server = start_llm_server(args, work / "llm-server.log", parallel=most)
                except Exception as exc:  # noqa: BLE001
                    return fail(f"cannot start the llama.cpp server: {exc}")
                stack.callback(server.stop)
                llm_url, llm_name = server.base_url, "model"
                meta["llm_server"] = {"engine": "llama.cpp (xllamacpp)", "model": args.llm_model,
                                      "threads": args.llm_threads, "slots": most,
                                      "startup_s": round(server.startup_s or 0.0, 1)}
            max_calls = args.max_calls or most
            dirs = [work / f"bridge-{i}" for i in range(args.spawn)]
            for i, d in enumerate(dirs):
                cfg = spawn_config(args, work / f"bridge-{i}.toml", llm_url, llm_name, d, max_calls)
                p = ServeProcess(cfg, token, work / f"bridge-{i}.log")
                stack.callback(p.stop)
                procs.append(p)
            try:
                urls = [f"ws://127.0.0.1:{p.wait_port()}/media-stream" for p in procs]
            except RuntimeError as exc:
                return fail(str(exc))
            meta.update({"spawned": args.spawn, "max_calls_each": max_calls, "llm_url": llm_url,
                         "bridges_ready_s": round(time.monotonic() - t, 1)})
            print(f"{args.spawn} bridges listening ({urls}), one LLM server {llm_url}; "
                  f"ready in {meta['bridges_ready_s']:.1f} s; reports and logs in {work}", flush=True)
        else:
            urls = list(args.bridge)
            dirs = [args.reports] if args.reports else []

        async def main() -> dict[str, Any]:
            run: dict[str, Any] = {"next": 0, "live": [], "t0": time.monotonic(), "stop": None}
            stopper = (asyncio.create_task(stop_one(procs, args, run))
                       if args.stop_one_after is not None or args.stop_one_at_answer else None)
            rounds = []
            first = 0
            try:
                for n in levels_n:
                    print(f"round of {n} callers x {args.turns} turns over {len(urls)} bridges ...", flush=True)
                    records = await bridge_level(urls, token, lines_by_caller, n, first, args, run)
                    first += n
                    rounds.append(records)
            finally:
                if stopper is not None and run["stop"] is not None:
                    # Signalled: wait for the process to exit, for its exit code.
                    await asyncio.wait({stopper}, timeout=60)
                if stopper is not None and not stopper.done():
                    stopper.cancel()
                    await asyncio.gather(stopper, return_exceptions=True)
            return {"rounds": rounds, "stop": run["stop"]}

        result = asyncio.run(main())
        stop = result["stop"]
        levels = []
        # Reports are written when a call ends (end_grace_s after the hang-up): wait for every
        # connected call's report, up to a minute (the deadline only matters when one is lost).
        wanted = {r["call_sid"] for records in result["rounds"] for r in records if r["bridge"] is not None}
        reports = None
        if dirs:
            deadline = time.monotonic() + 60
            while True:
                reports = report_index(dirs)
                if wanted <= set(reports) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        for records in result["rounds"]:
            lv = summarize_level(records, reports, len(urls), bool(args.spawn), stop)
            levels.append(lv)
            for f in lv["failures"][:5]:
                print(f"  {f}", flush=True)
        exit_codes = [p.stop() for p in procs]
    out = {
        "bench": "load, past one process",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "bridges": urls, "turns_per_call": args.turns, "max_new_tokens": args.max_new_tokens,
        "config": args.config or ("built-in small (test config + whisper-tiny.en), backend openai" if args.spawn
                                  else "the bridges' own"),
        **meta, "stop": stop, "exit_codes": exit_codes or None, "rounds": levels,
        "totals": {k: sum(lv[k] or 0 for lv in levels)
                   for k in ("calls", "connected", "completed", "cut", "refused", "failed", "reports_missing",
                             "reports_duplicated", "reports_wrong_bridge", "reports_without_end", "mixed")},
    }
    print()
    print_bridge_table(levels, stop)
    t = out["totals"]
    lost = t["reports_missing"] + t["reports_without_end"] if dirs else "not checked"
    print(f"\ntotal: {t['calls']} calls, {t['connected']} connected, {t['completed']} completed, {t['cut']} cut, "
          f"{t['refused']} refused everywhere; reports lost {lost}, "
          f"mixed {t['mixed']}; serve exit codes {exit_codes or '-'}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2, default=str) + "\n")
        print(f"wrote {args.out}")
    return 0
