"""`specvoice bench voice --engines`: every STT engine and window side by side, one run.

WER and milliseconds per utterance for faster-whisper (tiny.en, base) with the 30 s
window and with the window cut to the audio, and for Moonshine base, on the same audio:
the LJ clips (a human voice), the Piper questions and dental sentences (the agent's
domain, with each business's vocabulary), and noise, direct and over the phone path.
Engines take turns utterance by utterance, so a busy machine slows them alike; the
cost per second of audio is a least-squares line through (audio s, ms) per engine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from bench import speech_dir, write_json
from bench.voice import (BUSINESS_VOCABULARY, DOMAIN_SENTENCES, _pad, dialogue_questions,
                         noise_clips, piper_audio, wer_words)

SETS = ("lj", "questions", "domain")


@dataclass
class Engine:
    name: str
    model: str
    kind: str  # "whisper" | "moonshine"
    window: str = "full"
    grown: bool = False  # Moonshine heard the utterance grow first (below)


ENGINES = (
    Engine("whisper-tiny.en / 30 s", "whisper-tiny.en", "whisper", "full"),
    Engine("whisper-tiny.en / audio+4 s", "whisper-tiny.en", "whisper", "audio"),
    Engine("whisper-base / 30 s", "whisper-base", "whisper", "full"),
    Engine("whisper-base / audio+4 s", "whisper-base", "whisper", "audio"),
    Engine("moonshine-base", "moonshine-base-en", "moonshine"),
    Engine("moonshine-base, drafted", "moonshine-base-en", "moonshine", grown=True),
)
# A grown utterance is transcribed as a call's turn is: its first 0.8, 1.6, ... s while the
# caller speaks (turn.speech_prefill_ms), untimed, then the whole of it, timed; the decoder
# drafts from the transcript of its longest beginning (voice/heard_before.py).
GROWN_EVERY_S = 0.8


def spoken_words(text: str) -> str:
    """WER normalisation with numbers as spoken: "48213" and "forty-eight thousand two
    hundred thirteen" are the same words, "Dr." and "doctor" too (Whisper writes digits,
    Moonshine words)."""
    from voice.normalize import normalize_for_speech

    return wer_words(normalize_for_speech(text))


def _wer(refs: list[str], hyps: list[str]) -> dict:
    import jiwer

    out = jiwer.process_words([spoken_words(r) or "<empty>" for r in refs], [spoken_words(h) for h in hyps])
    errors = out.substitutions + out.deletions + out.insertions
    return {"wer": out.wer, "errors": errors, "words": out.substitutions + out.deletions + out.hits}


def _fit(points: list[tuple[float, float]]) -> dict:
    """ms = a + b * audio_s by least squares."""
    if len(points) < 2:
        return {"ms_fixed": None, "ms_per_audio_s": None}
    xs, ys = zip(*points)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return {"ms_fixed": my - b * mx, "ms_per_audio_s": b}


def _items(line, tts) -> list[tuple[str, str, str | None, "object"]]:
    """(set, business, reference or None for noise, 16 kHz audio as the engine hears it)."""
    from voice.audio import resample
    from voice.wav import read_wav

    folder = speech_dir()
    items = [("lj", "dental", c["transcript"], line(read_wav(folder / c["file"])[0]))
             for c in json.loads((folder / "manifest.json").read_text())["clips"]]
    sentences = [("questions", b, t) for b, t in dialogue_questions()] + [("domain", "dental", t) for t in DOMAIN_SENTENCES]
    for set_name, business, text in sentences:
        pcm, rate = piper_audio(tts, text, flat=True)  # without Piper's noise: the same audio every run
        items.append((set_name, business, text, line(_pad(resample(pcm, rate, 16000)))))
    items += [("noise", "dental", None, line(pcm)) for _label, pcm in noise_clips()]
    return items


def run_engines(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from modelstore import ModelNotFoundError, resolve_model
    from voice.moonshine import MoonshineSTT
    from voice.mulaw import phone_roundtrip
    from voice.stt import WhisperPrompt, WhisperSTT
    from voice.tts import PiperTTS
    from voice.vocabulary import VocabularyMatcher

    if not (speech_dir() / "manifest.json").is_file():
        print(f"error: speech clips not found at {speech_dir()} (set SPECVOICE_SPEECH_DATA)", file=sys.stderr)
        return 1
    try:
        paths = {e.model: resolve_model(e.model, kind="stt") for e in ENGINES}
        tts = PiperTTS(resolve_model(args.tts, kind="tts"))
    except ModelNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    threads = args.stt_threads
    loaded = {}
    for e in ENGINES:
        if e.kind == "whisper":
            loaded[e.name] = WhisperSTT(paths[e.model], cpu_threads=threads, window=e.window, workers=1)
        else:
            loaded[e.name] = MoonshineSTT(paths[e.model], cpu_threads=threads, remember=32 if e.grown else 0)
    known = loaded["moonshine-base"].tokenizer.whole_words()
    matchers = {b: VocabularyMatcher(v, known_words=known) for b, v in BUSINESS_VOCABULARY.items()}

    paths_in = {"direct": lambda pcm: pcm, "phone": lambda pcm: phone_roundtrip(pcm, 16000)}
    items = {path: _items(line, tts) for path, line in paths_in.items()}
    for stt in loaded.values():  # warm-up: first calls allocate
        stt.transcribe(items["direct"][0][3])
    rows: dict[str, list[dict]] = {}
    for e in ENGINES:
        rows[e.name] = []
        if e.kind == "moonshine":
            rows[f"{e.name} + vocabulary"] = []
    total = sum(len(v) for v in items.values()) * len(ENGINES)
    bar = tqdm(total=total, desc="bench voice --engines", unit="utt", file=sys.stderr)
    for path, its in items.items():
        for set_name, business, ref, audio in its:
            prompt = WhisperPrompt.from_vocabulary(BUSINESS_VOCABULARY[business], "initial_prompt")
            for e in ENGINES:  # interleaved: each engine hears this utterance now
                stt = loaded[e.name]
                if e.grown:
                    step = int(GROWN_EVERY_S * 16000)
                    for n in range(step, len(audio), step):
                        stt.transcribe_full(audio[:n])
                r = stt.transcribe_full(audio, prompt=prompt) if e.kind == "whisper" else stt.transcribe_full(audio)
                row = {"path": path, "set": set_name, "business": business, "ref": ref, "hyp": r.text,
                       "audio_s": r.audio_s, "ms": 1000 * r.compute_s, "repetition_cut": r.repetition_cut,
                       "drafted_tokens": r.drafted_tokens}
                rows[e.name].append(row)
                if e.kind == "moonshine":
                    rows[f"{e.name} + vocabulary"].append(
                        {**row, "hyp": matchers[business].correct(r.text)})
                bar.update()
    bar.close()

    results: dict = {
        "command": "specvoice bench voice --engines" + (f" --stt-threads {threads}" if threads != 1 else ""),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "cpu": _cpu_name()},
        "stt_threads": threads,
        "sets": {"lj": "LJ Speech clips (human voice), dental vocabulary as Whisper's prompt",
                 "questions": "caller questions of bench/data/dialogues.json spoken by Piper, own business's vocabulary",
                 "domain": "dental sentences dense in vocabulary words, spoken by Piper",
                 "noise": "non-speech clips; any text is a hallucination"},
        "wer_normalisation": "lower case, punctuation dropped, numbers and abbreviations as spoken (voice.normalize)",
        "engines": {},
    }
    for name, engine_rows in rows.items():
        summary: dict = {}
        for path in paths_in:
            mine = [r for r in engine_rows if r["path"] == path]
            per = {s: _wer([r["ref"] for r in mine if r["set"] == s], [r["hyp"] for r in mine if r["set"] == s])
                   for s in SETS}
            noise = [r for r in mine if r["set"] == "noise"]
            per["noise_with_text"] = sum(bool(r["hyp"].strip()) for r in noise)
            per["noise_n"] = len(noise)
            speech = [r for r in mine if r["set"] != "noise"]
            per["ms_median"] = statistics.median(r["ms"] for r in speech)
            per["ms_p90"] = sorted(r["ms"] for r in speech)[int(0.9 * (len(speech) - 1))]
            per["repetition_cuts"] = sum(r["repetition_cut"] for r in mine)
            summary[path] = per
        summary["cost"] = _fit([(r["audio_s"], r["ms"]) for r in engine_rows if r["set"] != "noise"])
        speech_3s = [r["ms"] for r in engine_rows if r["set"] != "noise" and 2.5 <= r["audio_s"] <= 3.5]
        summary["ms_median_2.5_to_3.5_s"] = statistics.median(speech_3s) if speech_3s else None
        results["engines"][name] = {"summary": summary, "rows": engine_rows}

    print(engines_table(results))
    if args.out:
        write_json(args.out, results)
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def engines_table(r: dict) -> str:
    cpu = r["machine"]["cpu"]
    lines = [f"STT engines side by side ({r['machine']['cpus']} CPUs, {cpu}; {r['stt_threads']} thread(s) each)", "",
             "| engine | path | LJ WER | Piper questions WER | domain WER | noise with text | ms/utt p50 | p90 | "
             "ms fixed + per audio s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, res in r["engines"].items():
        s = res["summary"]
        cost = s["cost"]
        for path in ("direct", "phone"):
            p = s[path]
            cell = lambda k: f"{p[k]['wer']:.1%} ({p[k]['errors']}/{p[k]['words']})"  # noqa: E731
            fit = f"{cost['ms_fixed']:.0f} + {cost['ms_per_audio_s']:.0f}/s" if path == "direct" else ""
            lines.append(f"| {name} | {path} | {cell('lj')} | {cell('questions')} | {cell('domain')} | "
                         f"{p['noise_with_text']}/{p['noise_n']} | {p['ms_median']:.0f} | {p['ms_p90']:.0f} | {fit} |")
    return "\n".join(lines)
