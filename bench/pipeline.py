"""`specvoice bench pipeline`: one scripted call, speculation on vs off (a benchmark, not a test)."""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

from bench import speech_dir, write_json

HELP = ("a scripted multi-turn call, speculation on vs off: per-turn latency side by side "
        "(--turn-modes: baseline, streaming_stt, smart_turn, preemptive turn endings)")
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
speculation in every run), one call per mode over the same lines, side by side
(a comma list, or "all" for every one):
  baseline       today's default: the endpointer's silence (vad.end_silence_ms) ends
                 every turn, Whisper runs after it (stt.streaming off); "silence" is an
                 alias
  streaming_stt  baseline's silence endpointing, Whisper transcribing while the caller
                 speaks (stt.streaming on): only the unconfirmed words are left after it
  smart_turn     Smart Turn v3.2 on a short pause, "incomplete" waits (turn.preemptive
                 off, stt.streaming off)
  preemptive     all three: smart_turn, the LLM starts while an "incomplete" pause waits
                 (kept only when the turn ends on that same audio: token-identical), and
                 streaming STT (Whisper)
  silence_preemptive
                 the default config's: silence endpointing (vad.end_silence_ms), the
                 config's STT at every 200 ms pause and the LLM started there (kept when
                 the turn ends on that same audio)
  smart_preemptive
                 Smart Turn, the config's STT and the LLM started at every pause beside
                 the model's decision (a "complete" keeps it at once), no streaming STT
  silence_preemptive_no_ahead
                 silence_preemptive without speaking ahead ([turn] speak_ahead = false):
                 the answer's first sentence is synthesised after the turn ends, not
                 while its silence runs out
  silence_preemptive_words_only
                 silence_preemptive without the LLM's end-of-words score
                 ([turn] words_end_threshold = 0, words_done_silence_ms = 0): only the
                 pause's words ("... for", a final comma) make the turn wait (bench
                 endings measures both)
  silence_preemptive_early
                 silence_preemptive with the early end ([turn] words_done_silence_ms =
                 600, off by default): words that close the sentence and that the LLM
                 scores at least turn.words_done_threshold end the turn at 600 ms of
                 silence, not vad.end_silence_ms
The default lines (15; or --wav files): 5 receptionist questions, 6 lines spoken with a
--pause-ms pause (default 700 ms) after words that cannot end a turn ("Do you accept |
Delta Dental insurance?"), and 4 lines the caller trails off at. Every third line
(--other-voice-every) is spoken by espeak-ng, a voice other than the agent's Piper voice
(apt-get install espeak-ng; without it those lines fall back to Piper with a warning).
Then --human-lines (default 5) human readings, LJ Speech clips ($SPECVOICE_SPEECH_DATA,
else ../shared/data/speech), three of them with the --pause-ms pause after a word that
leaves the sentence open ("... the immediate predecessors of | the true printed book,").
Each voice (piper, espeak-ng, human) is also summarised apart.
Per mode: voice-to-voice and first sentence p50/p90, end-of-turn delay, STT time after
the end of the turn (stt_after_endpoint, else stt_latency), lines cut in two (answered
in more than one turn), preemptive hit rate; the JSON also lists each line's voice and
pause.

  specvoice bench pipeline --turn-modes all --out turns.json
  specvoice bench pipeline --turn-modes baseline,preemptive --pause-ms 800
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
    ("Could you tell me if Dr. Patel is free on", "Wednesday afternoon?"),
    ("I need to move my cleaning to", "Friday morning."),
    ("Can I get the appointment with Dr. Moreno on", "Wednesday at two fifteen?"),
]
# Lines a caller trails off at (Smart Turn tends to hear them as incomplete: the turn ends
# at turn.max_silence_ms, the case preemptive generation is for).
TRAILING = [
    "Yes, I would like the Tuesday slot, I think, so",
    "I wanted to ask about the whitening, and",
    "My insurance is with Aetna, but",
    "So the cleaning would be on Friday then, and",
]
# Human readings (LJ Speech, public domain): (clip, first part, second part or None). The
# paused ones are cut after a word that leaves the sentence open, as the Piper lines are.
HUMAN = [
    ("LJ001-0004.wav", "produced the block books, which were the immediate predecessors of", "the true printed book,"),
    ("LJ001-0006.wav", "And it is worth mention in passing that,", "as an example of fine typography,"),
    ("LJ001-0013.wav", "than in the same operations with", "ugly ones."),
    ("LJ001-0002.wav", "in being comparatively modern.", None),
    ("LJ001-0008.wav", "has never been surpassed.", None),
]
HUMAN_VOICE = "human"
NO_TOOLS = "-no_tools"  # --without-tools: the label of a mode's run with [tools] enabled = false
TURN_MODES = ("baseline", "streaming_stt", "smart_turn", "preemptive", "silence_preemptive", "smart_preemptive",
              "silence_preemptive_no_ahead", "silence_preemptive_words_only", "silence_preemptive_early")
MODE_ALIASES = {"silence": "baseline"}  # the old name (README commands)
# Each mode's turn ending and STT: config.turn fields, and stt.streaming.
MODE_SETTINGS = {
    "baseline": ({"mode": "silence", "preemptive": False}, False),
    "streaming_stt": ({"mode": "silence", "preemptive": False}, True),
    "smart_turn": ({"mode": "smart_turn", "preemptive": False}, False),
    "preemptive": ({"mode": "smart_turn", "preemptive": True}, True),
    "silence_preemptive": ({"mode": "silence", "preemptive": True}, False),
    "smart_preemptive": ({"mode": "smart_turn", "preemptive": True}, False),
    "silence_preemptive_no_ahead": ({"mode": "silence", "preemptive": True, "speak_ahead": False}, False),
    # The pause's words decide alone, without the LLM's end-of-words score (bench endings).
    "silence_preemptive_words_only": ({"mode": "silence", "preemptive": True, "words_end_threshold": 0.0,
                                       "words_done_silence_ms": 0}, False),
    # ... and also ends finished words sooner (an option: it cut a line in two, README).
    "silence_preemptive_early": ({"mode": "silence", "preemptive": True, "words_done_silence_ms": 600}, False),
}
OTHER_VOICE_EVERY = 3  # default lines: every third one spoken by espeak-ng, not Piper
ESPEAK = "espeak-ng"
ESPEAK_VOICE = ("en-us", 160)  # espeak-ng -v, -s (words per minute)
COLUMNS = ["endpoint_delay", "stt_latency", "ttft", "first_sentence_latency", "tts_first_audio", "voice_to_voice",
           "llm_total"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="config name or TOML file (default: configs/default.toml)")
    parser.add_argument("--wav", nargs="*", type=Path, help="the caller's lines as WAV files (default: Piper questions)")
    parser.add_argument("--turns", type=int, default=len(QUESTIONS), help="default script: how many questions")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--turn-modes", metavar="MODES",
                        help="compare turn endings instead, one call each over the same lines: a comma list of "
                             f"{', '.join(TURN_MODES)} (silence = baseline), or 'all'. baseline: silence "
                             "endpointing; streaming_stt: + stt.streaming; smart_turn: Smart Turn, no preemption; "
                             "preemptive: Smart Turn + preemptive LLM + streaming STT")
    parser.add_argument("--pause-ms", type=int, default=700,
                        help="--turn-modes default lines: the pause after words that cannot end a turn, inside a "
                             "two-part line (default: %(default)s)")
    parser.add_argument("--paused-lines", type=int, default=len(PAUSED),
                        help="--turn-modes default lines: how many two-part lines (default: %(default)s)")
    parser.add_argument("--trailing-lines", type=int, default=len(TRAILING),
                        help="--turn-modes default lines: how many lines that trail off (default: %(default)s)")
    parser.add_argument("--without-tools", action="store_true",
                        help="--turn-modes: run each mode a second time with [tools] enabled = false (no turn plan, "
                             "no tool calls), labelled MODE-no_tools, beside it in the same run: what the plan costs "
                             "a plain question")
    parser.add_argument("--human-lines", type=int, default=len(HUMAN), metavar="N",
                        help="--turn-modes default lines: how many human readings (LJ Speech clips, the first "
                             "three with a pause inserted) after the synthetic lines; 0: none (default: %(default)s)")
    parser.add_argument("--other-voice-every", type=int, default=OTHER_VOICE_EVERY, metavar="N",
                        help="--turn-modes default lines: every Nth line is spoken by espeak-ng instead of the "
                             "agent's Piper voice; 0: Piper only (default: %(default)s)")

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


def parse_turn_modes(text: str | None) -> tuple[list[str], list[str]]:
    """--turn-modes -> (modes in order, without repeats, aliases resolved; unknown names).
    "all" stands for every mode."""
    modes, unknown = [], []
    for name in (m.strip() for m in (text or "").split(",")):
        if not name:
            continue
        names = list(TURN_MODES) if name == "all" else [MODE_ALIASES.get(name, name)]
        for mode in names:
            if mode not in TURN_MODES:
                unknown.append(name)
            elif mode not in modes:
                modes.append(mode)
    return modes, unknown


def _mode_config(config, mode: str):
    """`config` with the turn ending (turn.mode, turn.preemptive) and stt.streaming of `mode`.

    Streaming STT needs word timestamps, which only Whisper gives: a streaming mode on a
    config whose engine is Moonshine (the default) runs with whisper-base instead, and
    says so (`stt_engine` in the JSON's mode settings)."""
    turn, streaming = MODE_SETTINGS[MODE_ALIASES.get(mode, mode)]
    stt = {"streaming": streaming}
    if streaming and config.stt.engine != "whisper":
        stt.update(engine="whisper", model="whisper-base")
    return config.model_copy(update={"turn": config.turn.model_copy(update=turn),
                                     "stt": config.stt.model_copy(update=stt)})


def default_lines(turns: int = len(QUESTIONS), paused: int = len(PAUSED), trailing: int = len(TRAILING),
                  other_voice_every: int = OTHER_VOICE_EVERY, human: int = 0) -> list[dict]:
    """--turn-modes' default lines, in the order spoken: name (the WAV's stem), kind
    (question, paused, trailing, human), text, split (the paused line's two parts, else
    None) and voice ("espeak-ng" for every `other_voice_every`th synthetic line, else
    "piper"; "human" for the last `human` lines, LJ Speech clips named by `clip`)."""
    lines = [{"name": f"q{i}", "kind": "question", "text": t, "split": None} for i, t in enumerate(QUESTIONS[:turns])]
    lines += [{"name": f"p{i}", "kind": "paused", "text": f"{a} {b}", "split": (a, b)}
              for i, (a, b) in enumerate(PAUSED[:paused])]
    lines += [{"name": f"t{i}", "kind": "trailing", "text": t, "split": None} for i, t in enumerate(TRAILING[:trailing])]
    for i, line in enumerate(lines):
        other = other_voice_every > 0 and (i + 1) % other_voice_every == 0
        line["voice"] = ESPEAK if other else "piper"
    for i, (clip, first, second) in enumerate(HUMAN[:human]):
        lines.append({"name": f"h{i}", "kind": "paused" if second else "human", "clip": clip, "voice": HUMAN_VOICE,
                      "text": f"{first} {second}" if second else first, "split": (first, second) if second else None})
    return lines


def per_voice(lines: list[dict], report: dict, key: str = "voice") -> dict:
    """The lines grouped by `key` (voice, or kind), each group apart: how many lines, how
    many cut in two, voice-to-voice and first sentence p50/p90 of their turns (a line's
    turns are the next `turns_per_line` turns of the call)."""
    out: dict[str, dict] = {}
    at, turns = 0, report["turns"]
    for line, n in zip(lines, report["turns_per_line"]):
        v = out.setdefault(line.get(key, "file"), {"lines": 0, "cut": 0, "v2v": [], "first": []})
        v["lines"] += 1
        v["cut"] += n > 1
        for t in turns[at:at + n]:
            for name, metric in (("v2v", "voice_to_voice"), ("first", "first_sentence_latency")):
                if t["metrics"].get(metric) is not None:
                    v[name].append(t["metrics"][metric] * 1000)
        at += n

    def spread(values: list[float]) -> dict:
        return {"p50": _pct(values, 0.5), "p90": _pct(values, 0.9), "n": len(values)}

    return {group: {"lines": v["lines"], "cut": v["cut"], "cutoff_rate": round(v["cut"] / v["lines"], 4),
                    "voice_to_voice_ms": spread(v["v2v"]), "first_sentence_ms": spread(v["first"])}
            for group, v in out.items()}


def espeak_available() -> bool:
    import shutil

    return shutil.which(ESPEAK) is not None


def espeak_speak(text: str, work: Path, voice: str = ESPEAK_VOICE[0], wpm: int = ESPEAK_VOICE[1]):
    """`text` spoken by espeak-ng -> (mono float32 at the STT rate, 16 kHz, rate). espeak-ng
    writes a 22.05 kHz WAV; read_wav resamples it (soxr, voice.audio.resample)."""
    import subprocess

    from voice.wav import read_wav

    if not espeak_available():
        raise FileNotFoundError(f"{ESPEAK} not found: install it with `apt-get install espeak-ng`")
    with tempfile.NamedTemporaryFile(suffix=".wav", dir=work, delete=False) as f:
        path = Path(f.name)
    try:
        subprocess.run([ESPEAK, "-v", voice, "-s", str(wpm), "-w", str(path), text], check=True,
                       capture_output=True, timeout=60)
        return read_wav(path)
    finally:
        path.unlink(missing_ok=True)


def _stt_after_endpoint(metrics: dict):
    """The STT time after the end of the turn: stt_after_endpoint where the turn's report
    has it (streaming STT era), else stt_latency (all of Whisper runs after the end)."""
    return metrics.get("stt_after_endpoint", metrics.get("stt_latency"))

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
    per_line, taken_back = [], []
    for i, wav in enumerate(wavs):
        pcm, _ = read_wav(wav)
        before, taken_before = len(call.turns), len(call.report.taken_back) if call.report else 0
        source.push(pcm)
        ok = await call.wait_turns(before + 1, 180)
        deadline = time.monotonic() + 60
        while ok and not (call.idle and not source.speaking) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # a benchmark polling for quiet, not a test's synchronisation
        await asyncio.sleep(0.3)  # the caller's beat before the next line
        per_line.append(len(call.turns) - before)
        taken_back.append(len(call.report.taken_back) - taken_before if call.report else 0)
        last = call.turns[-1] if call.turns else None
        print(f"  {label} line {i}: {per_line[-1]} turn(s){f' ({taken_back[-1]} taken back)' if taken_back[-1] else ''}, v2v "
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
    data["taken_back_per_line"] = taken_back  # turns the caller went on in (pipeline/stages/take_back.py)
    return data


def _mode_summary(report: dict, lines: int) -> dict:
    turns = report["turns"]

    def spread_of(values: list[float]) -> dict:
        values = [v * 1000 for v in values if v is not None]
        return {"p50": _pct(values, 0.5), "p90": _pct(values, 0.9), "n": len(values)}

    def spread(name: str) -> dict:
        return spread_of([t["metrics"].get(name) for t in turns])

    per_line = report["turns_per_line"]
    pre = report["summary"].get("preemptive") or {}
    return {"voice_to_voice_ms": spread("voice_to_voice"), "first_sentence_ms": spread("first_sentence_latency"),
            "eot_delay_ms": spread("endpoint_delay"), "stt_latency_ms": spread("stt_latency"),
            "stt_after_endpoint_ms": spread_of([_stt_after_endpoint(t["metrics"]) for t in turns]),
            "stt_after_endpoint_source": "stt_after_endpoint" if any("stt_after_endpoint" in t["metrics"]
                                                                     for t in turns) else "stt_latency",
            "cutoff_rate": round(sum(1 for n in per_line if n > 1) / lines, 4) if lines else None,
            "turns": len(turns), "lines": lines, "turns_per_line": per_line,
            "taken_back": len(report.get("taken_back", [])), "taken_back_per_line": report.get("taken_back_per_line"),
            "preemptive_hit_rate": pre.get("hit_rate"), "preemptive": pre, "report": report["report_path"]}

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


def _forget_answers(models) -> None:
    """An empty answer memory ([llm] answer_memory) for the next call: calls compared side by
    side must not draft from each other's answers to the same lines."""
    if getattr(models, "engine", None) is not None:
        models.engine.answers.clear()


def _run_turn_modes(args, config, models, work: Path, modes: list[str]) -> int:
    import asyncio
    import dataclasses

    import numpy as np

    from pipeline.agent import load_end_of_turn
    from voice.wav import read_wav, write_wav

    wavs = list(args.wav or [])
    lines = [{"name": Path(w).stem, "kind": "file", "text": None, "voice": "file", "paused": False} for w in wavs]
    if not wavs:
        def piper(text: str) -> tuple[np.ndarray, int]:
            chunks = list(models.tts.synthesize(text))
            return np.concatenate([c.pcm for c in chunks]), chunks[0].sample_rate

        lines = default_lines(args.turns, args.paused_lines, args.trailing_lines, args.other_voice_every,
                              args.human_lines)
        if any(line["voice"] == HUMAN_VOICE for line in lines) and not (speech_dir() / HUMAN[0][0]).is_file():
            print(f"warning: the LJ Speech clips are not in {speech_dir()} (set SPECVOICE_SPEECH_DATA): "
                  "no human lines", file=sys.stderr)
            lines = [line for line in lines if line["voice"] != HUMAN_VOICE]
        if any(line["voice"] == ESPEAK for line in lines) and not espeak_available():
            print(f"warning: {ESPEAK} not found (apt-get install espeak-ng): the lines meant for a second voice "
                  "are spoken by Piper too", file=sys.stderr)
            for line in lines:
                line["voice"] = "piper"
        for line in lines:
            if line["voice"] == ESPEAK:
                pcm, rate = espeak_speak(line["text"], work)
            elif line["voice"] == HUMAN_VOICE:
                pcm, rate = read_wav(speech_dir() / line["clip"])
            else:
                # A paused line is the whole sentence spoken at once, split at the quietest
                # point near the word boundary: said apart, Piper ends the fragment as a
                # sentence (falling pitch), and Smart Turn rightly hears it as complete.
                pcm, rate = piper(line["text"])
            if line["split"]:
                first, _ = line["split"]
                pcm = _insert_pause(pcm, rate, len(first) / len(line["text"]), args.pause_ms / 1000)
            line["paused"] = bool(line["split"])
            line["pause_ms"] = args.pause_ms if line["split"] else None
            wavs.append(write_wav(work / f"{line['name']}.wav", pcm, rate))
        print(f"{len(lines)} lines, {sum(line['paused'] for line in lines)} with a {args.pause_ms} ms pause, "
              f"{sum(line['voice'] == ESPEAK for line in lines)} spoken by {ESPEAK}, "
              f"{sum(line['voice'] == HUMAN_VOICE for line in lines)} human readings", file=sys.stderr)
    for line, wav in zip(lines, wavs):
        line.pop("split", None)
        line["wav"] = str(wav)
    end_of_turn = models.end_of_turn
    if end_of_turn is None and any(_mode_config(config, m).turn.mode == "smart_turn" for m in modes):
        end_of_turn = load_end_of_turn(_mode_config(config, "smart_turn"))
    runs = {}

    other_stt: dict[str, object] = {}  # a streaming mode's Whisper, when the config's engine is Moonshine

    async def main() -> None:
        for mode in modes:
            cfg = _mode_config(config, mode)
            mode_models = models
            if cfg.stt.engine != config.stt.engine and getattr(models, "stt", None) is not None:
                if cfg.stt.engine not in other_stt:
                    from pipeline.agent import thread_counts, load_stt

                    other_stt[cfg.stt.engine] = load_stt(cfg, thread_counts(cfg, None)[1])  # as AgentModels.load
                mode_models = dataclasses.replace(models, stt=other_stt[cfg.stt.engine])
            variants = [(mode, cfg)]
            if args.without_tools:
                variants.append((f"{mode}{NO_TOOLS}", cfg.model_copy(update={
                    "tools": cfg.tools.model_copy(update={"enabled": False})})))
            for label, c in variants:
                print(f"call with turn mode {label} (STT: {c.stt.engine} {c.stt.model_for_engine}, tools "
                      f"{'on' if c.tools.enabled else 'off'}):", file=sys.stderr, flush=True)
                _forget_answers(mode_models)  # each mode answers the same lines: none drafts from another's
                runs[label] = await _play_lines(c, mode_models, end_of_turn, wavs, work, label)

    asyncio.run(main())
    summaries = {mode: {**_mode_summary(rep, len(wavs)), "voices": per_voice(lines, rep),
                        "kinds": per_voice(lines, rep, "kind")} for mode, rep in runs.items()}
    print(f"\n{'mode':<13} {'v2v p50':>8} {'p90':>6} | {'1st sent p50':>12} {'p90':>6} | {'eot p50':>7} | "
          f"{'stt p50':>7} | {'stt after end':>13} {'p90':>6} | cut  | turns/lines | taken back | preemptive kept")
    for mode, s in summaries.items():
        v, f, a = s["voice_to_voice_ms"], s["first_sentence_ms"], s["stt_after_endpoint_ms"]
        hit = "-" if s["preemptive_hit_rate"] is None else f"{s['preemptive']['hits']}/{s['preemptive']['turns']}"
        cut = "-" if s["cutoff_rate"] is None else f"{s['cutoff_rate']:.2f}"
        print(f"{mode:<13} {_fmt(v['p50'], 1, 8)} {_fmt(v['p90'], 1, 6)} | {_fmt(f['p50'], 1, 12)} "
              f"{_fmt(f['p90'], 1, 6)} | {_fmt(s['eot_delay_ms']['p50'], 1, 7)} | {_fmt(s['stt_latency_ms']['p50'], 1, 7)} | "
              f"{_fmt(a['p50'], 1, 13)} {_fmt(a['p90'], 1, 6)} | {cut:<4} | {s['turns']:>5}/{s['lines']:<5} | "
              f"{s['taken_back']:>10} | {hit}")
    print(f"\n{'mode':<27} {'lines':<10} {'n':>3} {'cut':>4} | {'v2v p50':>8} {'p90':>6} | {'1st sent p50':>12}")
    for mode, s in summaries.items():
        for group, v in [*s["voices"].items(), *s["kinds"].items()]:
            print(f"{mode:<27} {group:<10} {v['lines']:>3} {v['cut']:>4} | {_fmt(v['voice_to_voice_ms']['p50'], 1, 8)} "
                  f"{_fmt(v['voice_to_voice_ms']['p90'], 1, 6)} | {_fmt(v['first_sentence_ms']['p50'], 1, 12)}")
    if args.out:
        result = {"bench": "pipeline-turn-modes", "machine": platform.platform(), "config": args.config or "default",
                  "wavs": [str(w) for w in wavs], "pause_ms": args.pause_ms, "lines": lines,
                  "mode_settings": {label: {"turn": MODE_SETTINGS[mode][0], "stt_streaming": MODE_SETTINGS[mode][1],
                                            "stt_engine": _mode_config(config, mode).stt.engine,
                                            "stt_model": _mode_config(config, mode).stt.model_for_engine,
                                            "tools": config.tools.enabled and not label.endswith(NO_TOOLS)}
                                    for label in summaries for mode in [label.removesuffix(NO_TOOLS)]},
                  "modes": summaries,
                  "per_turn": {mode: [{"user_text": t["user_text"], "agent_text": t["agent_text"],
                                       "metrics": t["metrics"], "end_of_turn": t.get("end_of_turn"),
                                       "preemptive_hit": t.get("preemptive_hit"),
                                       "preemptive": t.get("preemptive")} for t in rep["turns"]]
                               for mode, rep in runs.items()}}
        write_json(args.out, result)
    return 0


def run(args: argparse.Namespace) -> int:
    import asyncio
    import dataclasses

    from demo.commands import load_config_or_exit, load_models_or_exit

    config = load_config_or_exit(args.config, "specvoice bench pipeline")
    modes, unknown = parse_turn_modes(args.turn_modes)
    if unknown:
        print(f"specvoice bench pipeline: unknown turn mode(s) {', '.join(unknown)}; choose from "
              f"{', '.join(TURN_MODES)} (or silence = baseline, or all)", file=sys.stderr)
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
            _forget_answers(models)  # both calls answer the same questions
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
        write_json(args.out, result)
    return 0
