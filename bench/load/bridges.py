"""Past one process (--bridge, --spawn): callers dial running `specvoice serve` processes
round-robin, retrying the next URL when refused, as a load balancer that retries would; with
--spawn one process may be stopped mid-run (--stop-one-after, --stop-one-at-answer)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import secrets
import sys
import time
from typing import Any

from bench import write_json
from bench.load.callers import NAMES, BridgeClosed, bridge_caller_class, spoken_scripts, wait_or_cancel
from bench.load.serve import ServeProcess, spawn_bridges
from bench.load.summary import report_index, summarize_level
from bench.load.tables import print_bridge_totals


async def bridge_level(urls: list[str], token: str | None, lines_by_caller: list, n: int, first_index: int,
                       args: argparse.Namespace, run: dict) -> list[dict]:
    """N callers at once over the bridges; returns one record per caller."""
    from websockets.exceptions import InvalidStatus

    BridgeCaller = bridge_caller_class()

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
    done = await wait_or_cancel(tasks, args.level_timeout)
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


def run_bridges(args: argparse.Namespace) -> int:
    """--bridge / --spawn: callers over running `specvoice serve` processes."""

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
        from pipeline.config import load_config
        from modelstore import resolve_model
        from voice.tts import load_tts

        voice = load_config(args.config).tts.voice if args.config else "piper-joe-medium"
        tts = load_tts("piper", resolve_model(voice), threads=args.threads or 1)
    except Exception as exc:  # noqa: BLE001 - a one-line error, not a traceback
        return fail(f"cannot load the callers' voice: {exc}")
    lines_by_caller = spoken_scripts(tts, sum(levels_n), args.turns)

    with contextlib.ExitStack() as stack:
        procs: list[ServeProcess] = []
        meta: dict[str, Any] = {}
        if args.spawn:
            try:
                procs, urls, dirs, meta = spawn_bridges(args, stack, token, max(levels_n))
            except RuntimeError as exc:
                return fail(str(exc))
        else:
            urls = list(args.bridge)
            dirs = [args.reports] if args.reports else []
        result = asyncio.run(_rounds(procs, urls, token, lines_by_caller, levels_n, args))
        stop = result["stop"]
        reports = _wait_for_reports(dirs, result["rounds"])
        levels = []
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
    print_bridge_totals(out, reports_checked=bool(dirs))
    if args.out:
        write_json(args.out, out, default=str)
    return 0


async def _rounds(procs: list[ServeProcess], urls: list[str], token: str | None, lines_by_caller: list,
                  levels_n: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Every round of callers, with the stopper (if asked) running alongside; {"rounds", "stop"}."""
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


def _wait_for_reports(dirs: list, rounds: list[list[dict]]) -> dict | None:
    """The reports in `dirs` by call id (None without folders). Reports are written when a call
    ends (end_grace_s after the hang-up): wait for every connected call's report, up to a minute
    (the deadline only matters when one is lost)."""
    if not dirs:
        return None
    wanted = {r["call_sid"] for records in rounds for r in records if r["bridge"] is not None}
    deadline = time.monotonic() + 60
    while True:
        reports = report_index(dirs)
        if wanted <= set(reports) or time.monotonic() > deadline:
            return reports
        time.sleep(0.5)
