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
"""

SENTENCES = [
    "Thank you for calling, how can I help you today?",
    "Your appointment is on Tuesday at 10:30 a.m. with Dr. Lee.",
    "A cleaning costs $89.50, and we are open from nine until five, Monday to Friday.",
    "Sure.",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stt", nargs="*", default=["whisper-tiny.en", "whisper-base"], metavar="MODEL",
                        help="STT models (catalog names or folders; default: %(default)s)")
    parser.add_argument("--tts", default="piper-joe-medium", metavar="VOICE", help="Piper voice (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=1, help="timed passes over the inputs (default: %(default)s)")
    parser.add_argument("--phone", action="store_true", help="STT on audio passed through 8 kHz mu-law")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")


def _speech_dir() -> Path:
    env = os.environ.get("SPECVOICE_SPEECH_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "speech"


def _summary(values: list[float]) -> dict:
    values = sorted(values)
    return {"mean": statistics.fmean(values), "median": statistics.median(values),
            "p90": values[min(len(values) - 1, int(0.9 * len(values)))], "max": values[-1], "n": len(values)}


def run(args: argparse.Namespace) -> int:
    import numpy as np
    from tqdm import tqdm

    from pipeline.models import ModelNotFoundError, resolve_model
    from voice.audio import frames
    from voice.endpointer import Endpointer
    from voice.mulaw import phone_roundtrip
    from voice.stt import WhisperSTT
    from voice.tts import PiperTTS
    from voice.vad import CHUNK, SileroModel, SileroVAD
    from voice.wav import read_wav

    folder = _speech_dir()
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
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.out}")
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
