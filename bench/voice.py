"""`specvoice bench voice`: STT / TTS / VAD speed on this machine (a benchmark, not a test)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench import DIALOGUES, speech_dir, write_json

if TYPE_CHECKING:
    import numpy as np

HELP = "STT real-time factor and latency, TTS time to first audio, VAD cost"
DESCRIPTION = """\
Measures the voice stages on this machine, on the LJ Speech clips (../shared/data/speech
or $SPECVOICE_SPEECH_DATA) and a few agent-style sentences:

  STT   per model: latency per utterance (end of speech -> transcript) and real-time factor
  TTS   per mode: time to first audio chunk and real-time factor (whole sentence vs clause split)
  VAD   Silero cost per second of audio, and the endpointer around it

Each model is loaded once and warmed up with one untimed call first. RTF = compute / audio
(below 1 is faster than real time).

  specvoice bench voice                                   # all pulled voice models
  specvoice bench voice --stt whisper-tiny.en --repeat 3 --out voice.json
  specvoice bench voice --phone                           # STT on audio that went through 8 kHz mu-law

--vocabulary measures word error rate instead of speed: Whisper with the business's
vocabulary (names, services, days) given as nothing / initial_prompt / hotwords / both,
side by side on the same audio, in one run. Sets: the LJ Speech clips (a human voice,
general text, with the default agent's vocabulary: does the prompt hurt ordinary
speech?), the caller questions of bench/data/dialogues.json spoken by Piper (each with
its own business's vocabulary), dental sentences dense in domain words (the issue's
"Tuesday morning slot"), and noise clips, where any text at all is a hallucination.

  specvoice bench voice --vocabulary --phone --out bench/results/stt_vocabulary.json
  specvoice bench voice --vocabulary --phone --repeat 3 --modes none initial_prompt

--engines compares every STT engine and window side by side, in one run, on the same
audio: WER and ms per utterance for faster-whisper tiny.en and base with the 30 s window
and with the window cut to the audio (+ 4 s, guarded), and Moonshine base (as it writes,
and with the business vocabulary matched on). Whisper gets the business vocabulary as
its prompt, as in a call. Sets: the LJ clips, the Piper questions, the dental sentences
and noise, each direct and through the 8 kHz mu-law phone path. Engines take turns on
each utterance (interleaved), so a busy machine slows them alike. WER here counts
numbers as spoken ("48213" = "forty-eight thousand two hundred thirteen").

  specvoice bench voice --engines --out bench/results/stt-engines.json

With --vocabulary, --repeat N speaks every sentence N times: once without Piper's random
noise (the same audio in every run), then N-1 times with it (a different take each time).
"""

# What a business would list as its vocabulary: the names, services and days of its
# facts (the system prompts of bench/data/dialogues.json), not words picked from the
# caller's questions. Keys: the dialogue id prefix.
BUSINESS_VOCABULARY: dict[str, list[str]] = {
    "dental": ["Riverside Dental", "Dr. Patel", "Dr. Moreno", "cleaning", "check-up", "whitening", "filling",
               "Delta Dental", "Aetna", "Harbor Street", "Springfield", "Monday", "Tuesday", "Wednesday",
               "Friday", "Saturday", "slot", "appointment"],
    "bistro": ["Luigi's Bistro", "Olive Avenue", "reservation", "table", "back room", "deposit",
               "mushroom risotto", "grilled sea bass", "tiramisu", "gluten-free pasta", "corkage",
               "Monday", "Tuesday", "Sunday", "tonight", "tomorrow"],
    "isp": ["FastLink Internet", "Basic", "Plus", "Gigabit", "Mbps", "router", "outage", "Maple Heights",
            "technician", "support"],
    "shop": ["Northwind Outdoor", "order", "UPS", "tracking number", "hiking boots", "rain jacket",
             "returns", "refund", "standard shipping", "express"],
}

# Dental sentences dense in the vocabulary's words: the default call script (where the
# issue's "Tuesday morning slot" was heard as "Flot") and a few more of the same kind.
DOMAIN_SENTENCES = [
    "Hi, what are your opening hours on Saturday?",
    "How much does a cleaning cost?",
    "Can I book the Tuesday morning slot?",
    "Is Dr. Moreno available on Wednesday afternoon?",
    "Do you take Delta Dental or only Aetna?",
    "I need a filling, can I see Dr. Patel on Friday?",
    "How much is whitening after a check-up?",
    "Is the Riverside Dental office on Harbor Street?",
]

SENTENCES = [
    "Thank you for calling, how can I help you today?",
    "Your appointment is on Tuesday at 10:30 a.m. with Dr. Lee.",
    "A cleaning costs $89.50, and we are open from nine until five, Monday to Friday.",
    "Sure.",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stt", nargs="*", default=None, metavar="MODEL",
                        help="STT models (catalog names or folders; default: whisper-tiny.en whisper-base, "
                             "with --vocabulary whisper-base, the agent's default)")
    parser.add_argument("--tts", default="piper-joe-medium", metavar="VOICE", help="Piper voice (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=1, help="timed passes over the inputs (default: %(default)s)")
    parser.add_argument("--phone", action="store_true", help="STT on audio passed through 8 kHz mu-law")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--vocabulary", action="store_true",
                        help="WER with the business vocabulary as none / initial_prompt / hotwords / both, "
                             "instead of the speed benchmark")
    parser.add_argument("--modes", nargs="*", default=None, metavar="MODE",
                        help="with --vocabulary: the modes to compare (default: all four)")
    parser.add_argument("--engines", action="store_true",
                        help="WER and ms per utterance of every STT engine and window, side by side "
                             "(direct and phone path), instead of the speed benchmark")
    parser.add_argument("--stt-threads", type=int, default=1,
                        help="with --engines: CPU threads per STT engine (default: %(default)s)")


def _summary(values: list[float]) -> dict:
    values = sorted(values)
    return {"mean": statistics.fmean(values), "median": statistics.median(values),
            "p90": values[min(len(values) - 1, int(0.9 * len(values)))], "max": values[-1], "n": len(values)}


def run(args: argparse.Namespace) -> int:
    if getattr(args, "engines", False):
        from bench.stt_engines import run_engines

        return run_engines(args)
    if args.vocabulary:
        return run_vocabulary(args)
    args.stt = ["whisper-tiny.en", "whisper-base"] if args.stt is None else args.stt
    import numpy as np
    from tqdm import tqdm

    from modelstore import ModelNotFoundError, resolve_model
    from voice.audio import frames
    from voice.endpointer import Endpointer
    from voice.mulaw import phone_roundtrip
    from voice.stt import WhisperSTT
    from voice.tts import PiperTTS
    from voice.vad import CHUNK, SileroModel, SileroVAD
    from voice.wav import read_wav

    folder = speech_dir()
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        print(f"error: speech clips not found at {folder} (set SPECVOICE_SPEECH_DATA)", file=sys.stderr)
        return 1
    clips = [read_wav(folder / c["file"])[0] for c in json.loads(manifest.read_text())["clips"]]
    if args.phone:
        clips = [phone_roundtrip(c, 16000) for c in clips]

    stt_paths, tts_path, skipped = {}, None, []
    for name in args.stt:
        try:
            stt_paths[name] = resolve_model(name, kind="stt")
        except ModelNotFoundError as exc:
            skipped.append(str(exc))
    try:
        tts_path = resolve_model(args.tts, kind="tts")
    except ModelNotFoundError as exc:
        skipped.append(str(exc))

    total = len(stt_paths) * len(clips) * args.repeat + (2 * len(SENTENCES) * args.repeat if tts_path else 0) + 1
    results: dict = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
                     "phone": args.phone, "repeat": args.repeat, "stt": {}, "tts": {}, "vad": {}, "skipped": skipped}
    bar = tqdm(total=total, desc="bench voice", unit="step", file=sys.stderr)

    for name, path in stt_paths.items():
        bar.set_postfix_str(f"STT {name}")
        t = time.perf_counter()
        stt = WhisperSTT(path)
        load_s = time.perf_counter() - t
        stt.transcribe(clips[0])  # warm-up: first call allocates and caches
        lat, rtf, audio_s = [], [], 0.0
        for _ in range(args.repeat):
            for clip in clips:
                r = stt.transcribe_full(clip)
                lat.append(r.compute_s)
                rtf.append(r.rtf)
                audio_s += r.audio_s
                bar.update()
        results["stt"][name] = {"load_s": load_s, "latency_s": _summary(lat), "rtf": _summary(rtf),
                                "audio_s": audio_s, "compute_s": sum(lat)}

    if tts_path:
        for mode, split in (("sentence", False), ("clauses", True)):
            bar.set_postfix_str(f"TTS {mode}")
            tts = PiperTTS(tts_path, split_clauses=split)
            list(tts.synthesize("Warming up."))
            first, rtf = [], []
            for _ in range(args.repeat):
                for sentence in SENTENCES:
                    t = time.perf_counter()
                    t_first, audio_s = None, 0.0
                    for chunk in tts.synthesize(sentence):
                        if t_first is None:
                            t_first = time.perf_counter() - t
                        audio_s += chunk.duration
                    elapsed = time.perf_counter() - t
                    first.append(t_first)
                    rtf.append(elapsed / audio_s)
                    bar.update()
            results["tts"][mode] = {"first_chunk_s": _summary(first), "rtf": _summary(rtf)}

    bar.set_postfix_str("VAD")
    signal = np.concatenate(clips + [np.zeros(16000, np.float32)])
    seconds = len(signal) / 16000
    model = SileroModel()
    vad = SileroVAD(model)
    n = len(signal) // CHUNK
    t = time.perf_counter()
    for i in range(n):
        vad(signal[i * CHUNK:(i + 1) * CHUNK])
    silero_s = time.perf_counter() - t
    ep = Endpointer(SileroVAD(model))
    t = time.perf_counter()
    for i, f in enumerate(frames(signal, 16000, 20)):
        ep.feed(f, i * 0.02)
    ep_s = time.perf_counter() - t
    results["vad"] = {"audio_s": seconds, "silero_ms_per_audio_s": 1000 * silero_s / seconds,
                      "endpointer_ms_per_audio_s": 1000 * ep_s / seconds, "silero_us_per_chunk": 1e6 * silero_s / n}
    bar.update()
    bar.close()

    print(_table(results))
    for line in skipped:
        print(f"skipped: {line}")
    if args.out:
        write_json(args.out, results)
    return 0


def _table(r: dict) -> str:
    lines = ["| stage | what | median | p90 | mean | RTF (median) |", "| --- | --- | --- | --- | --- | --- |"]
    for name, s in r["stt"].items():
        lines.append(f"| STT {name}{' (phone)' if r['phone'] else ''} | latency / utterance (s) | "
                     f"{s['latency_s']['median']:.3f} | {s['latency_s']['p90']:.3f} | {s['latency_s']['mean']:.3f} | "
                     f"{s['rtf']['median']:.3f} |")
    for mode, s in r["tts"].items():
        lines.append(f"| TTS piper ({mode}) | time to first chunk (s) | {s['first_chunk_s']['median']:.3f} | "
                     f"{s['first_chunk_s']['p90']:.3f} | {s['first_chunk_s']['mean']:.3f} | {s['rtf']['median']:.3f} |")
    v = r["vad"]
    lines.append(f"| VAD silero | ms per s of audio | {v['silero_ms_per_audio_s']:.2f} | | | "
                 f"{v['silero_ms_per_audio_s'] / 1000:.4f} |")
    lines.append(f"| VAD endpointer (incl. silero) | ms per s of audio | {v['endpointer_ms_per_audio_s']:.2f} | | | "
                 f"{v['endpointer_ms_per_audio_s'] / 1000:.4f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- --vocabulary: WER per mode


def wer_words(text: str) -> str:
    """WER normalisation: lower case; hyphens joined ("check-up" = "checkup"), other
    punctuation dropped (apostrophes kept), so spelling style is not counted as an error."""
    import re

    text = text.lower().replace("-", "")
    return " ".join(re.sub(r"[^a-z0-9' ]+", " ", text).split())


def _wer(refs: list[str], hyps: list[str]) -> dict:
    import jiwer

    out = jiwer.process_words([wer_words(r) or "<empty>" for r in refs], [wer_words(h) for h in hyps])
    words = out.substitutions + out.deletions + out.hits
    return {"wer": out.wer, "words": words, "substitutions": out.substitutions, "deletions": out.deletions,
            "insertions": out.insertions}


def dialogue_questions(path: Path | None = None) -> list[tuple[str, str]]:
    """(business, question) for every distinct caller message of bench/data/dialogues.json;
    the business is the dialogue id's prefix (dental, bistro, isp, shop)."""
    path = path or DIALOGUES
    seen: set[str] = set()
    out = []
    for turn in json.loads(path.read_text())["turns"]:
        business = turn["id"].split("-", 1)[0]
        for message in turn["messages"]:
            if message["role"] == "user" and message["content"] not in seen:
                seen.add(message["content"])
                out.append((business, message["content"]))
    return out


def noise_clips(seconds: float = 3.0, seed: int = 11) -> list[tuple[str, "np.ndarray"]]:
    """Non-speech a phone line carries, loud enough to pass the STT's level check: any
    transcript of these is a hallucination."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n = int(seconds * 16000)
    t = np.arange(n) / 16000
    white = rng.normal(0, 1, n)
    brown = np.cumsum(rng.normal(0, 1, n))
    brown = (brown - np.convolve(brown, np.ones(400) / 400, mode="same")) / 20  # drift removed
    clips = {
        "white -45 dBFS": 10 ** (-45 / 20) * white,
        "white -30 dBFS": 10 ** (-30 / 20) * white,
        "rumble -35 dBFS": 10 ** (-35 / 20) * brown / (np.std(brown) + 1e-9),
        "hum 60 Hz + hiss": 0.02 * np.sin(2 * np.pi * 60 * t) + 0.003 * white,
    }
    return [(name, pcm.astype(np.float32)) for name, pcm in clips.items()]


def _pad(pcm: "np.ndarray", before_s: float = 0.3, after_s: float = 0.5) -> "np.ndarray":
    """Silence around a synthesized sentence, as the endpointer hands an utterance over
    (pre-roll before, the end-of-speech silence after)."""
    import numpy as np

    return np.concatenate([np.zeros(int(before_s * 16000), np.float32), pcm,
                           np.zeros(int(after_s * 16000), np.float32)])


def piper_audio(tts, text: str, flat: bool) -> tuple["np.ndarray", int]:
    """One sentence from a PiperTTS voice: (float32 PCM, rate). `flat`: without the
    voice's random noise (noise_scale = noise_w = 0), the same audio on every call."""
    import numpy as np

    if not flat:
        chunks = list(tts.synthesize(text))
        return np.concatenate([c.pcm for c in chunks]), chunks[0].sample_rate
    from piper import SynthesisConfig

    from voice.normalize import normalize_for_speech

    chunks = list(tts.voice.synthesize(normalize_for_speech(text),
                                       syn_config=SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0)))
    return np.concatenate([c.audio_float_array for c in chunks]).astype(np.float32), int(chunks[0].sample_rate)


def run_vocabulary(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from modelstore import ModelNotFoundError, resolve_model
    from voice.audio import resample
    from voice.mulaw import phone_roundtrip
    from voice.stt import VOCABULARY_MODES, WhisperPrompt, WhisperSTT
    from voice.tts import PiperTTS
    from voice.wav import read_wav

    modes = args.modes or list(VOCABULARY_MODES)
    bad = [m for m in modes if m not in VOCABULARY_MODES]
    if bad:
        print(f"error: unknown mode {', '.join(bad)}; known: {', '.join(VOCABULARY_MODES)}", file=sys.stderr)
        return 2
    names = args.stt or ["whisper-base"]
    try:
        stt_paths = {name: resolve_model(name, kind="stt") for name in names}
        tts_path = resolve_model(args.tts, kind="tts")
    except ModelNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    folder = speech_dir()
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        print(f"error: speech clips not found at {folder} (set SPECVOICE_SPEECH_DATA)", file=sys.stderr)
        return 1

    line = (lambda pcm: phone_roundtrip(pcm, 16000)) if args.phone else (lambda pcm: pcm)
    dental = BUSINESS_VOCABULARY["dental"]
    # (set, label, business vocabulary, reference text or None for noise, 16 kHz audio as Whisper hears it)
    items: list[tuple[str, str, list[str], str | None, np.ndarray]] = []
    for clip in json.loads(manifest.read_text())["clips"]:
        items.append(("lj", clip["file"], dental, clip["transcript"], line(read_wav(folder / clip["file"])[0])))
    tts = PiperTTS(tts_path)
    renderings = max(1, args.repeat)

    def spoken(text: str, rendering: int) -> np.ndarray:
        # Piper's VITS draws random noise per call, so each sentence is synthesized once
        # per rendering and every mode hears the same audio. Rendering 0 is without that
        # noise (reproducible from run to run); further ones (--repeat) are Piper's usual voice.
        pcm, rate = piper_audio(tts, text, flat=rendering == 0)
        return line(_pad(resample(pcm, rate, 16000)))

    sentences = [("questions", business, text) for business, text in dialogue_questions()]
    sentences += [("domain", "dental", text) for text in DOMAIN_SENTENCES]
    for rendering in range(renderings):
        tag = f" [{rendering}]" if renderings > 1 else ""
        for set_name, business, text in tqdm(sentences, desc=f"Piper rendering {rendering}", file=sys.stderr,
                                             leave=False):
            items.append((set_name, f"{business}: {text}{tag}", BUSINESS_VOCABULARY[business], text,
                          spoken(text, rendering)))
    for label, pcm in noise_clips():
        items.append(("noise", label, dental, None, line(pcm)))

    results: dict = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "phone": args.phone, "modes": modes, "vocabulary": BUSINESS_VOCABULARY, "piper_renderings": renderings,
        "sets": {"lj": "LJ Speech clips (human voice, general text), dental vocabulary",
                 "questions": "caller questions of bench/data/dialogues.json spoken by Piper, own business's vocabulary",
                 "domain": "dental sentences dense in vocabulary words, spoken by Piper",
                 "noise": "non-speech clips; any text is a hallucination"},
        "stt": {},
    }
    bar = tqdm(total=len(names) * len(modes) * len(items), desc="bench voice --vocabulary", unit="utt", file=sys.stderr)
    for name, path in stt_paths.items():
        stt = WhisperSTT(path)
        stt.transcribe(items[0][4])  # warm-up
        per_mode = {}
        for mode in modes:
            bar.set_postfix_str(f"{name} {mode}")
            rows = []
            for set_name, label, vocabulary, ref, audio in items:
                r = stt.transcribe_full(audio, prompt=WhisperPrompt.from_vocabulary(vocabulary, mode))
                rows.append({"set": set_name, "label": label, "ref": ref, "hyp": r.text, "compute_s": r.compute_s,
                             "no_speech_prob": r.no_speech_prob, "prompt_dropped": r.prompt_dropped})
                bar.update()
            summary = {}
            for set_name in ("lj", "questions", "domain"):
                chosen = [row for row in rows if row["set"] == set_name]
                summary[set_name] = _wer([row["ref"] for row in chosen], [row["hyp"] for row in chosen])
                summary[set_name]["n"] = len(chosen)
                summary[set_name]["prompt_dropped"] = sum(row["prompt_dropped"] for row in chosen)
            summary["questions_by_business"] = {
                b: _wer(*zip(*[(row["ref"], row["hyp"]) for row in rows
                               if row["set"] == "questions" and row["label"].startswith(b + ":")]))
                for b in BUSINESS_VOCABULARY}
            noise = [row for row in rows if row["set"] == "noise"]
            summary["noise"] = {"n": len(noise), "non_empty": sum(bool(row["hyp"].strip()) for row in noise),
                                "prompt_dropped": sum(row["prompt_dropped"] for row in noise)}
            speech = [row["compute_s"] for row in rows if row["set"] != "noise"]
            summary["compute_s"] = _summary(speech)
            per_mode[mode] = {"summary": summary, "rows": rows}
        results["stt"][name] = per_mode
    bar.close()

    print(_vocabulary_table(results))
    print(_differences(results))
    if args.out:
        write_json(args.out, results)
    return 0


def _vocabulary_table(r: dict) -> str:
    path = "8 kHz mu-law" if r["phone"] else "direct 16 kHz"
    lines = [f"STT word error rate with the business vocabulary ({path})", "",
             "| model | mode | LJ clips WER | Piper questions WER | domain sentences WER | "
             "noise: clips with text | prompt dropped (speech / noise) | compute / utt (median s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, per_mode in r["stt"].items():
        for mode, res in per_mode.items():
            s = res["summary"]

            def cell(k: str) -> str:
                return f"{s[k]['wer']:.1%} ({s[k]['substitutions'] + s[k]['deletions'] + s[k]['insertions']}/{s[k]['words']})"

            lines.append(f"| {name} | {mode} | {cell('lj')} | {cell('questions')} | {cell('domain')} | "
                         f"{s['noise']['non_empty']}/{s['noise']['n']} | "
                         f"{sum(s[k]['prompt_dropped'] for k in ('lj', 'questions', 'domain'))} / "
                         f"{s['noise']['prompt_dropped']} | {s['compute_s']['median']:.3f} |")
    return "\n".join(lines)


def _differences(r: dict) -> str:
    """The utterances whose transcript differs between modes, to see what changed."""
    lines = ["", "transcripts that differ between modes:"]
    for name, per_mode in r["stt"].items():
        modes = list(per_mode)
        for i, row in enumerate(per_mode[modes[0]]["rows"]):
            hyps = {m: per_mode[m]["rows"][i]["hyp"] for m in modes}
            if len(set(wer_words(h) for h in hyps.values())) > 1:
                lines.append(f"  [{name}] {row['label']}")
                lines.extend(f"      {m:>14}: {h!r}" for m, h in hyps.items())
    return "\n".join(lines)
