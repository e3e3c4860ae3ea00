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

With --turn-modes it compares how the caller's turn ends instead (the config's
speculation in every run), one call per mode, side by side:
  silence     the endpointer's silence (vad.end_silence_ms) ends every turn
  smart_turn  Smart Turn v3.2 on a short pause, "incomplete" waits (turn.preemptive off)
  preemptive  smart_turn, and the LLM starts while an "incomplete" pause waits (kept only
              when the turn ends on that same audio: token-identical)
The default lines are then the questions, lines spoken in two parts with a pause
(--pause-ms) after words that cannot end a turn, and lines the caller trails off at. Per mode: voice-to-voice and first
sentence p50/p90, lines cut in two (answered more than once), preemptive hit rate.

  specvoice bench pipeline --turn-modes silence,smart_turn,preemptive --out turns.json
"""

QUESTIONS = [
    "Hi, what are your opening hours on Saturday?",
    "How much does a cleaning cost?",
    "Which dentists work at the clinic?",
    "Can I book the Tuesday morning slot?",
    "What is your address?",
]
# Lines with a pause after words that cannot end a turn (spoken in two parts, --pause-ms apart).
PAUSED = [
    ("I would like to book a cleaning for", "next Tuesday morning."),
    ("Do you accept", "Delta Dental insurance?"),
    ("My name is Ann Lee and I need to cancel my appointment on", "Friday."),
]
# Lines a caller trails off at (Smart Turn tends to hear them as incomplete: the turn ends
# at turn.max_silence_ms, the case preemptive generation is for).
TRAILING = [
    "Yes, I would like the Tuesday slot, I think, so",
    "I wanted to ask about the whitening, and",
    "My insurance is with Aetna, but",
    "So the cleaning would be on Friday then, and",
]
TURN_MODES = ("silence", "smart_turn", "preemptive")
COLUMNS = ["endpoint_delay", "stt_latency", "ttft", "first_sentence_latency", "tts_first_audio", "voice_to_voice",
           "llm_total"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="config name or TOML file (default: configs/default.toml)")
    parser.add_argument("--wav", nargs="*", type=Path, help="the caller's lines as WAV files (default: Piper questions)")
    parser.add_argument("--turns", type=int, default=len(QUESTIONS), help="default script: how many questions")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--turn-modes", help=f"compare turn endings instead, one call each: a comma list of "
                                             f"{', '.join(TURN_MODES)}")
    parser.add_argument("--pause-ms", type=int, default=700,
                        help="--turn-modes default lines: the pause inside a two-part line (default: %(default)s)")
    parser.add_argument("--paused-lines", type=int, default=len(PAUSED),
                        help="--turn-modes default lines: how many two-part lines (default: %(default)s)")
    parser.add_argument("--trailing-lines", type=int, default=len(TRAILING),
                        help="--turn-modes default lines: how many lines that trail off (default: %(default)s)")


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


def _mode_config(config, mode: str):
    turn = {"silence": {"mode": "silence", "preemptive": False}, "smart_turn": {"mode": "smart_turn", "preemptive": False},
            "preemptive": {"mode": "smart_turn", "preemptive": True}}[mode]
    return config.model_copy(update={"turn": config.turn.model_copy(update=turn)})


async def _play_lines(config, models, end_of_turn, wavs, report_dir: Path, label: str) -> dict:
    """One call, each line spoken after the agent has answered the previous one; a line
    answered in more than one turn was cut in two."""
    import asyncio

    from pipeline.agent import endpoint_config, turn_taker
    from pipeline.call import Call
    from pipeline.io import PacedSink, PushSource
    from voice.endpointer import Endpointer
    from voice.wav import read_wav

    source, sink = PushSource(), PacedSink()
    model = end_of_turn if config.turn.mode == "smart_turn" else None
    call = Call.from_models(config, models, source, sink, mqtt=None, report_dir=report_dir,
                            endpointer=Endpointer(models.vad_model.stream(), endpoint_config(config, model is not None)),
                            turns=turn_taker(config, model), call_id=f"bench-{label}-{time.strftime('%Y%m%d-%H%M%S')}")
    task = asyncio.create_task(call.run())
    per_line = []
    for i, wav in enumerate(wavs):
        pcm, _ = read_wav(wav)
        before = len(call.turns)
        source.push(pcm)
        ok = await call.wait_turns(before + 1, 180)
        deadline = time.monotonic() + 60
        while ok and not (call.idle and not source.speaking) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # a benchmark polling for quiet, not a test's synchronisation
        await asyncio.sleep(0.3)  # the caller's beat before the next line
        per_line.append(len(call.turns) - before)
        last = call.turns[-1] if call.turns else None
        print(f"  {label} line {i}: {per_line[-1]} turn(s), v2v "
              f"{_fmt(last.timeline.metrics()['voice_to_voice'] if last else None).strip()} ms, "
              f"{(last.user_text if last else '')!r}", file=sys.stderr, flush=True)
        if not ok:
            print(f"  {label}: line {i} timed out", file=sys.stderr)
            break
    source.close()
    await task
    data = call.report.to_dict()
    data["report_path"] = str(call.report_path)
    data["turns_per_line"] = per_line
    return data


def _mode_summary(report: dict, lines: int) -> dict:
    turns = report["turns"]

    def spread(name: str) -> dict:
        values = [t["metrics"][name] * 1000 for t in turns if t["metrics"].get(name) is not None]
        return {"p50": _pct(values, 0.5), "p90": _pct(values, 0.9), "n": len(values)}

    per_line = report["turns_per_line"]
    pre = report["summary"].get("preemptive") or {}
    return {"voice_to_voice_ms": spread("voice_to_voice"), "first_sentence_ms": spread("first_sentence_latency"),
            "eot_delay_ms": spread("endpoint_delay"), "stt_latency_ms": spread("stt_latency"),
            "cutoff_rate": round(sum(1 for n in per_line if n > 1) / lines, 4) if lines else None,
            "turns": len(turns), "lines": lines, "preemptive_hit_rate": pre.get("hit_rate"),
            "preemptive": pre, "report": report["report_path"]}


def _insert_pause(pcm, rate: int, at: float, pause_s: float):
    """`pcm` with `pause_s` of silence inserted at its quietest 20 ms within 12% of the
    fraction `at` of its length (between two words, where the text splits)."""
    import numpy as np

    frame = rate // 50
    n = len(pcm) // frame
    lo, hi = max(1, int((at - 0.12) * n)), min(n - 1, int((at + 0.12) * n))
    energy = [float(np.sqrt(np.mean(np.square(pcm[k * frame:(k + 1) * frame])))) for k in range(lo, hi)]
    cut = (lo + int(np.argmin(energy))) * frame + frame // 2
    return np.concatenate([pcm[:cut], np.zeros(int(rate * pause_s), np.float32), pcm[cut:]]).astype(np.float32)


def _run_turn_modes(args, config, models, work: Path, modes: list[str]) -> int:
    import asyncio

    import numpy as np

    from pipeline.agent import load_end_of_turn
    from voice.wav import write_wav

    wavs = list(args.wav or [])
    if not wavs:
        def speak(text: str) -> tuple[np.ndarray, int]:
            chunks = list(models.tts.synthesize(text))
            return np.concatenate([c.pcm for c in chunks]), chunks[0].sample_rate

        for i, text in enumerate(QUESTIONS[: args.turns]):
            pcm, rate = speak(text)
            wavs.append(write_wav(work / f"q{i}.wav", pcm, rate))
        for i, (first, second) in enumerate(PAUSED[: args.paused_lines]):
            # The whole sentence spoken at once, split at the quietest point near the word
            # boundary: said apart, Piper ends the fragment as a sentence (falling pitch),
            # and Smart Turn rightly hears it as complete.
            pcm, rate = speak(f"{first} {second}")
            wavs.append(write_wav(work / f"p{i}.wav", _insert_pause(pcm, rate, len(first) / len(f"{first} {second}"),
                                                                    args.pause_ms / 1000), rate))
        for i, text in enumerate(TRAILING[: args.trailing_lines]):
            pcm, rate = speak(text)
            wavs.append(write_wav(work / f"t{i}.wav", pcm, rate))
    end_of_turn = models.end_of_turn
    if end_of_turn is None and any(m != "silence" for m in modes):
        end_of_turn = load_end_of_turn(_mode_config(config, "smart_turn"))
    runs = {}

    async def main() -> None:
        for mode in modes:
            print(f"call with turn mode {mode}:", file=sys.stderr, flush=True)
            runs[mode] = await _play_lines(_mode_config(config, mode), models, end_of_turn, wavs, work, mode)

    asyncio.run(main())
    summaries = {mode: _mode_summary(rep, len(wavs)) for mode, rep in runs.items()}
    print(f"\n{'mode':<11} {'v2v p50':>8} {'p90':>6} | {'1st sent p50':>12} {'p90':>6} | {'eot p50':>7} | "
          f"{'stt p50':>7} | cut | turns/lines | preemptive kept")
    for mode, s in summaries.items():
        v, f = s["voice_to_voice_ms"], s["first_sentence_ms"]
        hit = "-" if s["preemptive_hit_rate"] is None else f"{s['preemptive']['hits']}/{s['preemptive']['turns']}"
        print(f"{mode:<11} {_fmt(v['p50'], 1, 8)} {_fmt(v['p90'], 1, 6)} | {_fmt(f['p50'], 1, 12)} "
              f"{_fmt(f['p90'], 1, 6)} | {_fmt(s['eot_delay_ms']['p50'], 1, 7)} | {_fmt(s['stt_latency_ms']['p50'], 1, 7)} | "
              f"{s['cutoff_rate']:.2f} | {s['turns']:>5}/{s['lines']:<5} | {hit}")
    if args.out:
        result = {"bench": "pipeline-turn-modes", "machine": platform.platform(), "config": args.config or "default",
                  "wavs": [str(w) for w in wavs], "pause_ms": args.pause_ms, "modes": summaries,
                  "per_turn": {mode: [{"user_text": t["user_text"], "agent_text": t["agent_text"],
                                       "metrics": t["metrics"], "end_of_turn": t.get("end_of_turn"),
                                       "preemptive_hit": t.get("preemptive_hit"),
                                       "preemptive": t.get("preemptive")} for t in rep["turns"]]
                               for mode, rep in runs.items()}}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return 0


def run(args: argparse.Namespace) -> int:
    import asyncio
    import dataclasses

    from demo.commands import load_config_or_exit, load_models_or_exit

    config = load_config_or_exit(args.config, "specvoice bench pipeline")
    modes = [m.strip() for m in (args.turn_modes or "").split(",") if m.strip()]
    unknown = [m for m in modes if m not in TURN_MODES]
    if unknown:
        print(f"specvoice bench pipeline: unknown turn mode(s) {', '.join(unknown)}; choose from "
              f"{', '.join(TURN_MODES)}", file=sys.stderr)
        return 2
    if config.llm.backend != "speculative":
        print("specvoice bench pipeline: it compares in-process speculation on/off; llm.backend must be "
              "'speculative'", file=sys.stderr)
        return 2
    models = load_models_or_exit(config, "specvoice bench pipeline")

    work = Path(tempfile.mkdtemp(prefix="specvoice-bench-"))
    if modes:
        return _run_turn_modes(args, config, models, work, modes)
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
