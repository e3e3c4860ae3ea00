"""`specvoice bench pipeline`: one scripted call, speculation on vs off (a benchmark, not a test)."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

HELP = "a scripted multi-turn call, speculation on vs off: per-turn latency side by side"
DESCRIPTION = """\
Plays the same scripted call twice through the in-process pipeline (real-time audio
source and sink, real Whisper, LLM and Piper of --config): once with the config's
speculation, once with speculation off (gamma 0, the same loaded target). Prints the
per-turn metrics (p50/p90) side by side and the ratio (off / on) of
first_sentence_latency and voice_to_voice, and writes JSON (--out).

The caller's lines are WAV files (--wav), or by default receptionist questions spoken by
Piper into WAV files first. The two runs share the machine, so compare them together.

  specvoice bench pipeline --out pipeline.json
  specvoice bench pipeline --wav q1.wav q2.wav q3.wav --config gpu
"""

QUESTIONS = [
    "Hi, what are your opening hours on Saturday?",
    "How much does a cleaning cost?",
    "Which dentists work at the clinic?",
    "Can I book the Tuesday morning slot?",
    "What is your address?",
]
COLUMNS = ["endpoint_delay", "stt_latency", "ttft", "first_sentence_latency", "tts_first_audio", "voice_to_voice",
           "llm_total"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="config name or TOML file (default: configs/default.toml)")
    parser.add_argument("--wav", nargs="*", type=Path, help="the caller's lines as WAV files (default: Piper questions)")
    parser.add_argument("--turns", type=int, default=len(QUESTIONS), help="default script: how many questions")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")


def _pct(values: list[float], q: float) -> float | None:
    from pipeline.report import percentile

    return percentile(values, q)


def _fmt(x: float | None, scale: float = 1000.0, width: int = 7) -> str:
    return f"{'-':>{width}}" if x is None else f"{x * scale:{width}.0f}"


async def _play_call(config, models, backend, wavs, report_dir: Path, label: str) -> dict:
    from pipeline.call import Call
    from pipeline.io import PacedSink, PushSource
    from voice.wav import read_wav

    source, sink = PushSource(), PacedSink()
    call = Call.from_models(config, models, source, sink, backend=backend, mqtt=None, report_dir=report_dir,
                call_id=f"bench-{label}-{time.strftime('%Y%m%d-%H%M%S')}")
    import asyncio

    task = asyncio.create_task(call.run())
    for i, wav in enumerate(wavs):
        pcm, _ = read_wav(wav)
        source.push(pcm)
        if not await call.wait_turns(i + 1, 180):
            print(f"  {label}: turn {i} timed out", file=sys.stderr)
            break
        print(f"  {label} turn {i}: v2v {_fmt(call.turns[-1].timeline.metrics()['voice_to_voice']).strip()} ms, "
              f"{call.turns[-1].user_text!r}", file=sys.stderr, flush=True)
    source.close()
    await task
    data = call.report.to_dict()
    data["report_path"] = str(call.report_path)
    return data


def _summary(report: dict) -> dict:
    out = {}
    turns = report["turns"]
    for name in COLUMNS:
        values = [t["metrics"][name] for t in turns if t["metrics"].get(name) is not None]
        out[name] = {"p50": _pct(values, 0.5), "p90": _pct(values, 0.9), "n": len(values)}
    out["llm"] = report["summary"]["llm"]
    return out


def run(args: argparse.Namespace) -> int:
    import asyncio
    import dataclasses

    from demo.commands import load_config_or_exit, load_models_or_exit

    config = load_config_or_exit(args.config, "specvoice bench pipeline")
    if config.llm.backend != "speculative":
        print("specvoice bench pipeline: it compares in-process speculation on/off; llm.backend must be "
              "'speculative'", file=sys.stderr)
        return 2
    models = load_models_or_exit(config, "specvoice bench pipeline")

    work = Path(tempfile.mkdtemp(prefix="specvoice-bench-"))
    wavs = list(args.wav or [])
    if not wavs:
        from voice.wav import write_wav

        for i, text in enumerate(QUESTIONS[: args.turns]):
            chunks = list(models.tts.synthesize(text))
            import numpy as np

            wavs.append(write_wav(work / f"q{i}.wav", np.concatenate([c.pcm for c in chunks]), chunks[0].sample_rate))
    missing = [w for w in wavs if not Path(w).is_file()]
    if missing:
        print(f"error: WAV file(s) not found: {', '.join(map(str, missing))}", file=sys.stderr)
        return 1

    from llm.backend import SpeculativeBackend

    engine_on = models.engine
    engine_off = dataclasses.replace(engine_on, gamma=0)  # same weights, no drafts: one token a pass
    runs = {}

    async def main() -> None:
        for label, engine in (("spec", engine_on), ("nospec", engine_off)):
            print(f"call with {label} (gamma {engine.gamma}):", file=sys.stderr, flush=True)
            runs[label] = await _play_call(config, models, SpeculativeBackend(engine), wavs, work, label)

    asyncio.run(main())
    summaries = {label: _summary(rep) for label, rep in runs.items()}

    print(f"\n{'metric (ms)':<24} {'spec p50':>9} {'p90':>7} | {'off p50':>9} {'p90':>7} | off/spec p50")
    for name in COLUMNS:
        on, off = summaries["spec"][name], summaries["nospec"][name]
        ratio = off["p50"] / on["p50"] if on["p50"] and off["p50"] else None
        print(f"{name:<24} {_fmt(on['p50'], width=9)} {_fmt(on['p90'])} | {_fmt(off['p50'], width=9)} "
              f"{_fmt(off['p90'])} | {'-' if ratio is None else f'{ratio:.2f}x'}")
    for label in ("spec", "nospec"):
        s = summaries[label]["llm"]
        print(f"LLM {label:<7}: {s['tokens_per_pass']:.2f} tokens/pass, acceptance {s['acceptance_rate']:.2f}, "
              f"{s['tokens_per_s']:.2f} tokens/s, {s['tokens']} tokens")
    ratios = {}
    for name in ("first_sentence_latency", "voice_to_voice"):
        on, off = summaries["spec"][name]["p50"], summaries["nospec"][name]["p50"]
        ratios[name] = round(off / on, 3) if on and off else None
    print(f"speed-up from speculation (p50, off / on): first sentence {ratios['first_sentence_latency']}x, "
          f"voice-to-voice {ratios['voice_to_voice']}x")
    if args.out:
        result = {
            "bench": "pipeline", "machine": platform.platform(), "config": args.config or "default",
            "wavs": [str(w) for w in wavs], "summaries": summaries, "ratios_off_over_on": ratios,
            "per_turn": {label: [{"user_text": t["user_text"], "agent_text": t["agent_text"],
                                  "metrics": t["metrics"], "llm": t["llm"]} for t in rep["turns"]]
                         for label, rep in runs.items()},
            "reports": {label: rep["report_path"] for label, rep in runs.items()},
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return 0
