"""`specvoice bench endings`: does a pause end the caller's turn? The words' rules scored
on whole questions and on questions cut where a caller stops to think.

Silence mode with preemption (the default) ends a turn at vad.end_silence_ms of silence,
unless the pause's words leave the sentence open: they end on a word like "for" or "the",
or on a comma (voice.turn_detector.open_ending), or the LLM scores them as unlikely to end
the caller's message (engine.end_probability below turn.words_end_threshold). Then it
waits up to turn.max_silence_ms. A wait on a whole question costs the caller that much
silence; no wait on a cut one answers half a sentence (the line is cut in two). With
turn.words_done_silence_ms set (off by default), words that close the sentence and score
at least turn.words_done_threshold end the turn sooner, at that silence: right on a whole
line, and on a cut one a cut in two whenever the caller's pause is longer than that.

Each line is spoken (Piper, espeak-ng, and the LJ Speech readings), kept as the endpointer
keeps a pause's audio (turn.pause_ms), transcribed by the config's STT, and scored by the
config's LLM as the first turn of a call (system prompt and greeting before it):

- whole: the dental questions of bench/data/dialogues.json, bench voice's dental
  sentences, bench pipeline's questions and its paused lines said in one go; the LJ clips;
- cut: bench pipeline's paused lines' first parts ("Do you accept"), and each whole line
  cut after its first word that cannot end a sentence, spoken alone; bench pipeline's LJ
  readings cut where it inserts its pause.

Printed per voice: how many lines of each kind wait, by the word rules alone and with
the LLM at each threshold; then how many would end early at each --done-thresholds
value. The JSON has every line: its transcript, the word rule's verdict, the LLM's
probability and the ms it took.

  specvoice bench endings --out endings.json
  specvoice bench endings --voices piper --thresholds 0.002 0.005 0.01 --done-thresholds 0.5 0.9
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from bench import report_header, speech_dir, write_json

HELP = "turn ends: word rules and the LLM's end-of-words score on whole vs cut questions"
DESCRIPTION = __doc__
VOICES = ("piper", "espeak-ng", "human")
THRESHOLDS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05)
DONE_THRESHOLDS = (0.3, 0.5, 0.7, 0.9)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="config name or TOML file: STT, LLM, [vad]/[turn], business (default: default)")
    p.add_argument("--voices", nargs="*", choices=VOICES, default=list(VOICES), help="voices (default: all)")
    p.add_argument("--thresholds", nargs="*", type=float, default=list(THRESHOLDS),
                   help="turn.words_end_threshold values to compare (default: %(default)s)")
    p.add_argument("--done-thresholds", nargs="*", type=float, default=list(DONE_THRESHOLDS),
                   help="turn.words_done_threshold values to compare (default: %(default)s)")
    p.add_argument("--limit", type=int, default=None, help="only the first N lines of each kind per voice")
    p.add_argument("--out", type=Path, help="write the JSON results here")


def cut_after_open_word(text: str) -> str | None:
    """`text` up to its first word (third or later, not its last) that cannot end a
    sentence ("Is Dr. Moreno available on | Wednesday afternoon?"), else None."""
    from voice.turn_detector import DANGLING_WORDS, OPEN_WORDS

    words = text.split()
    for i, word in enumerate(words[:-1]):
        if i >= 2 and re.sub(r"[^a-z']", "", word.lower()) in OPEN_WORDS | DANGLING_WORDS:
            return " ".join(words[:i + 1])
    return None


def synthetic_lines() -> list[tuple[str, str]]:
    """(kind, text): the whole lines, then the cut ones, each once."""
    from bench.pipeline import PAUSED, QUESTIONS
    from bench.voice import DOMAIN_SENTENCES, dialogue_questions

    whole = [q for business, q in dialogue_questions() if business == "dental"]
    whole += [*DOMAIN_SENTENCES, *QUESTIONS, *(f"{a} {b}" for a, b in PAUSED)]
    whole = list(dict.fromkeys(whole))
    cut = [a for a, _ in PAUSED] + [c for c in map(cut_after_open_word, whole) if c]
    return [("whole", t) for t in whole] + [("cut", t) for t in dict.fromkeys(cut)]


def human_lines() -> list[tuple[str, str, object, int, int]]:
    """(kind, text, audio, its rate, pieces to keep): the LJ clips whole, and bench pipeline's
    LJ readings cut where it inserts its pause (the first piece)."""
    import json

    from bench.pipeline import HUMAN, _insert_pause
    from voice.wav import read_wav

    folder = speech_dir()
    manifest = json.loads((folder / "manifest.json").read_text())["clips"]
    out = [("whole", c["transcript"], *read_wav(folder / c["file"]), 0) for c in manifest]
    for clip, first, second in HUMAN:
        if second:
            pcm, rate = read_wav(folder / clip)
            text = f"{first} {second}"
            out.append(("cut", first, _insert_pause(pcm, rate, len(first) / len(text), 1.0), rate, 1))
    return out


def pause_audio(pcm, rate: int, vad, endpoint, keep: int = 0):
    """The audio the endpointer keeps for the turn at its pause: its pieces (all, or the
    first `keep`) joined, trimmed as a pause's (post-roll) audio is."""
    import numpy as np

    from voice.audio import frames, resample
    from voice.endpointer import Endpointer, SpeechEnded

    x = resample(np.asarray(pcm, np.float32), rate, 16000)
    x = np.concatenate([x, np.zeros(32000, np.float32)])  # 2 s of silence: the last pause ends
    ep = Endpointer(vad.stream(), endpoint)
    pieces = [e.audio for i, f in enumerate(frames(x, 16000, 20)) for e in ep.feed(f, i * 0.02)
              if isinstance(e, SpeechEnded)]
    pieces = pieces[:keep] if keep else pieces
    return np.concatenate(pieces) if pieces else None


def waits(row: dict, threshold: float | None) -> bool:
    """Whether the turn waits on this line's pause: its words leave the sentence open, or
    (with a threshold) the LLM scored them below it. Nothing heard: no words to wait on."""
    if not row["heard"]:
        return False
    unfinished = threshold is not None and row["words_end"] is not None and row["words_end"] < threshold
    return bool(row["open_words"]) or unfinished


def ends_early(row: dict, threshold: float) -> bool:
    """Whether the turn ends at turn.words_done_silence_ms on this line's pause: words that
    close the sentence, scored at least `threshold`."""
    return bool(row["heard"]) and not row["open_words"] and (row["words_end"] or 0.0) >= threshold


def summarize(rows: list[dict], thresholds: list[float], done_thresholds: list[float] = ()) -> dict:
    """{voice: {kind: lines, wait_by_words, wait_with_llm {threshold: n}, end_early
    {threshold: n}}}, in the rows' order."""
    summary: dict = {}
    for row in rows:
        s = summary.setdefault(row["voice"], {}).setdefault(
            row["kind"], {"lines": 0, "wait_by_words": 0, "wait_with_llm": {str(th): 0 for th in thresholds},
                          "end_early": {str(th): 0 for th in done_thresholds}})
        s["lines"] += 1
        s["wait_by_words"] += waits(row, None)
        for th in thresholds:
            s["wait_with_llm"][str(th)] += waits(row, th)
        for th in done_thresholds:
            s["end_early"][str(th)] += ends_early(row, th)
    return summary


def run(args: argparse.Namespace) -> int:
    import numpy as np
    from tqdm import tqdm

    from bench.pipeline import espeak_available, espeak_speak
    from modelstore import resolve_model
    from pipeline.agent import endpoint_config, load_engine, load_stt
    from pipeline.config import load_config
    from pipeline.receptionist.prompt import system_prompt, tool_schemas
    from pipeline.turn import History
    from voice.tts import load_tts
    from voice.turn_detector import open_ending, without_end_mark
    from voice.vad import SileroModel

    config = load_config(args.config or "default")
    voices = list(args.voices)
    if "espeak-ng" in voices and not espeak_available():
        print("warning: espeak-ng not found (apt-get install espeak-ng): no espeak-ng lines", file=sys.stderr)
        voices.remove("espeak-ng")
    if "human" in voices and not (speech_dir() / "manifest.json").is_file():
        print(f"warning: the LJ Speech clips are not in {speech_dir()} (set SPECVOICE_SPEECH_DATA): no human lines",
              file=sys.stderr)
        voices.remove("human")
    print("loading the STT, Piper, the VAD and the LLM ...", file=sys.stderr)
    stt = load_stt(config, 2)
    tts = load_tts("piper", resolve_model(config.tts.voice), length_scale=config.tts.length_scale, threads=2)
    vad, endpoint = SileroModel(), endpoint_config(config, False)
    engine = load_engine(config.llm, answer_memory=0)  # modes repeat the lines
    tools = tool_schemas(config)
    history = History(system_prompt(config), config.agent.history_tokens, engine.count_tokens)
    history.add_agent(config.agent.greeting)  # the caller's first turn, after the greeting
    conversation = engine.new_conversation()
    engine.end_probability(engine.open_prompt(history.messages("Hello there"), tools), conversation)  # the prefix

    items = []  # (voice, kind, text, pcm, rate, keep)
    work = Path(args.out).parent if args.out else Path(".")
    for voice in voices:
        if voice == "human":
            lines = human_lines()
        else:
            lines = [(k, t, None, 0, 0) for k, t in synthetic_lines()]
        for kind in ("whole", "cut"):
            chosen = [line for line in lines if line[0] == kind][:args.limit]
            items += [(voice, *line) for line in chosen]
    rows = []
    for voice, kind, text, pcm, rate, keep in tqdm(items, desc="bench endings", unit="line", file=sys.stderr):
        if pcm is None and voice == "espeak-ng":
            pcm, rate = espeak_speak(text, work)
        elif pcm is None:
            chunks = list(tts.synthesize(text))
            pcm, rate = np.concatenate([c.pcm for c in chunks]), chunks[0].sample_rate
        audio = pause_audio(pcm, rate, vad, endpoint, keep)
        heard = (stt.transcribe(audio) or "").strip() if audio is not None else ""
        words = without_end_mark(heard)
        probability, ms = None, None
        if words:
            t = time.perf_counter()
            probability = engine.end_probability(engine.open_prompt(history.messages(words), tools), conversation)
            ms = (time.perf_counter() - t) * 1000
        rows.append({"voice": voice, "kind": kind, "text": text, "heard": heard,
                     "open_words": open_ending(heard) if heard else None,
                     "words_end": probability, "score_ms": ms})

    summary = summarize(rows, args.thresholds, args.done_thresholds)
    scored = sorted(r["score_ms"] for r in rows if r["score_ms"] is not None)
    head = " ".join(f"{'<' + str(th):>7}" for th in args.thresholds)
    wait_s = (config.turn.max_silence_ms - config.vad.end_silence_ms) / 1000
    print(f"\nlines that wait (whole: a wrong {wait_s:.1f} s wait; cut: right), by the word rules, then with the "
          f"LLM's score below each threshold\n{'voice':10} {'kind':6} {'lines':>5} {'words':>6} {head}")
    for voice, kinds in summary.items():
        for kind, s in kinds.items():
            cells = " ".join(f"{s['wait_with_llm'][str(th)]:>7}" for th in args.thresholds)
            print(f"{voice:10} {kind:6} {s['lines']:>5} {s['wait_by_words']:>6} {cells}")
    head = " ".join(f"{'>=' + str(th):>7}" for th in args.done_thresholds)
    done_ms = config.turn.words_done_silence_ms
    at = f"{done_ms} ms of silence" if done_ms else "turn.words_done_silence_ms (off in this config)"
    print(f"\nlines that would end early, at {at} (whole: right; cut: cut in two if the caller pauses "
          f"longer), by the LLM's score at or above each threshold\n"
          f"{'voice':10} {'kind':6} {'lines':>5} {head}")
    for voice, kinds in summary.items():
        for kind, s in kinds.items():
            cells = " ".join(f"{s['end_early'][str(th)]:>7}" for th in args.done_thresholds)
            print(f"{voice:10} {kind:6} {s['lines']:>5} {cells}")
    if scored:
        print(f"LLM score: p50 {scored[len(scored) // 2]:.0f} ms, max {scored[-1]:.0f} ms a line "
              f"(one prefill of the words; the start reuses it)")
    results = {**report_header("endings", config.llm), "stt": config.stt.engine, "thresholds": args.thresholds,
               "configured_threshold": config.turn.words_end_threshold,
               "done_thresholds": args.done_thresholds, "configured_done_threshold": config.turn.words_done_threshold,
               "words_done_silence_ms": config.turn.words_done_silence_ms, "summary": summary, "lines": rows}
    if args.out:
        write_json(args.out, results)
    return 0
