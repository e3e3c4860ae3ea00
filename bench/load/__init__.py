"""`specvoice bench load`: N simulated phone callers at once against one bridge (a benchmark, not a test).

Also `--soak SECONDS`: calls placed back to back for that long, with memory, open file
descriptors and threads sampled throughout (steady memory = an RSS slope near zero).

The benchmark in parts, each with one job:

  config.py     the configs it runs (in process; each spawned serve process's)
  callers.py    who calls and what they say; the caller that notices a bridge closing under it
  inprocess.py  levels of N callers on a bridge in this process, and the soak
  serve.py      `specvoice serve` processes and the llama.cpp server behind them (--spawn)
  bridges.py    levels over running serve processes (--bridge, --spawn), one stopped mid-run
  resources.py  memory, file descriptors and threads sampled; the soak's slopes
  summary.py    per level: calls complete, mixed, reports, voice-to-voice; which levels held
  tables.py     what is printed
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
from pathlib import Path

from bench import write_json
from bench.load.config import SMALL, threads_used

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calls", type=int, nargs="+", default=[1, 2, 4], help="concurrent calls per level (default: 1 2 4)")
    parser.add_argument("--turns", type=int, default=2, help="caller lines per call (default 2)")
    parser.add_argument("--config", help="config name or TOML file, used as is (default: SmolLM2 + whisper-tiny.en)")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for torch, Whisper and Piper each (default: with --config, the config's own, "
                             "as `specvoice serve` runs it; else 1)")
    parser.add_argument("--stt-workers", type=int, default=None,
                        help="Whisper transcriptions at once (stt.workers; default: the config's)")
    parser.add_argument("--max-new-tokens", type=int, default=40, help="LLM answer length cap (default 40)")
    parser.add_argument("--extra", type=int, default=1, help="callers over the limit that must get 503 (default 1)")
    parser.add_argument("--stagger", type=float, default=0.0, metavar="S",
                        help="seconds between one caller's dial and the next's (default 0: all at once, so their "
                             "first lines end together, the burst the held verdict is judged on; in process only)")
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
    if args.stagger < 0 or (args.stagger and (args.bridge or args.spawn or args.soak)):
        print("specvoice bench load: --stagger takes seconds >= 0, for levels in this process (not with "
              "--bridge, --spawn or --soak)", file=sys.stderr)
        return 2
    if args.bridge or args.spawn:
        from bench.load.bridges import run_bridges

        return run_bridges(args)
    from bench.load.inprocess import load_models, run_in_process
    from bench.load.tables import print_levels, print_soak

    if min(args.calls) < 1 or args.turns < 1:
        print("specvoice bench load: --calls and --turns must be >= 1", file=sys.stderr)
        return 2
    loaded = load_models(args)
    if loaded is None:
        return 2
    cfg, models, load_s = loaded
    result = run_in_process(args, cfg, models)
    meta = {
        "bench": "load",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "llm": {"target": cfg.llm.target, "draft": cfg.llm.draft, "drafter": cfg.llm.drafter, "dtype": cfg.llm.dtype,
                "max_new_tokens": cfg.llm.max_new_tokens, "answer_memory": cfg.llm.answer_memory},
        "stt": cfg.stt.model, "stt_workers": cfg.stt.workers, "tts": cfg.tts.voice, "threads": threads_used(args, cfg), "turns_per_call": args.turns,
        "stagger_s": args.stagger,
        "config": args.config or "built-in small (SmolLM2-135M int8 + whisper-tiny.en + Piper)",
        "models_load_s": round(load_s, 1),
    }
    out = {**meta, **result}
    if "levels" in result:
        print_levels(result)
    else:
        print_soak(result["soak"])
    if args.out:
        write_json(args.out, out)
    return 0
