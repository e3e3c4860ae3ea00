"""`specvoice say "TEXT" --out FILE.wav`: text to speech with the agent's own voice."""

from __future__ import annotations

import argparse
import sys

HELP = "speak a text into a WAV file with the agent's TTS voice"
DESCRIPTION = """\
Synthesise TEXT with the agent's TTS engine and write it to a WAV file (16-bit PCM).
The text goes through the same normalisation as the agent's answers, so numbers,
times, prices and abbreviations are spoken as words ("$29.99" -> "twenty-nine dollars
and ninety-nine cents", "10:30 a.m." -> "ten thirty A M", "Dr. Lee" -> "Doctor Lee").

  specvoice say "Hello, how can I help you?" --out hello.wav
  specvoice say "We open at 9 a.m." --out open.wav --rate 16000      # resampled for STT
  specvoice say "Your total is $29.99." --out phone.wav --phone      # as heard over a call (8 kHz mu-law)
  specvoice say "Hi" --out hi.wav --voice ~/voices/en_GB-alan.onnx  # any Piper voice (.onnx + .onnx.json)
  specvoice say "Hi" --out hi.wav --engine coqui --voice ~/coqui/vits-ljspeech   # needs specvoice[coqui]

--normalized-text prints the text as the voice will read it.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text", metavar="TEXT", help="what to say (one or more sentences)")
    parser.add_argument("--out", required=True, metavar="FILE.wav", help="where to write the audio")
    parser.add_argument("--engine", choices=("piper", "coqui"), default="piper", help="TTS engine (default: %(default)s)")
    parser.add_argument("--voice", default=None,
                        help="catalog name or path: a Piper .onnx voice, or a Coqui model folder "
                             "(default: piper-joe-medium for piper)")
    parser.add_argument("--rate", type=int, default=None, help="resample the output to this rate in Hz (default: the voice's own)")
    parser.add_argument("--phone", action="store_true", help="pass the audio through 8 kHz mu-law, as a caller would hear it")
    parser.add_argument("--length-scale", type=float, default=None, help="Piper speaking pace: >1 slower, <1 faster")
    parser.add_argument("--normalized-text", action="store_true", help="print the normalised text to stdout")


def run(args: argparse.Namespace) -> int:
    import time

    import numpy as np

    from modelstore import ModelNotFoundError, resolve_model
    from voice.audio import resample
    from voice.errors import AudioFormatError, EngineNotInstalledError, ModelLoadError
    from voice.mulaw import phone_roundtrip
    from voice.normalize import normalize_for_speech
    from voice.tts import load_tts
    from voice.wav import write_wav

    if not args.text.strip():
        print("error: TEXT is empty: nothing to say", file=sys.stderr)
        return 2
    if args.normalized_text:
        print(normalize_for_speech(args.text))
    voice = args.voice or ("piper-joe-medium" if args.engine == "piper" else None)
    if voice is None:
        print("error: --engine coqui needs --voice MODEL_DIR (a local Coqui model folder with config.json)", file=sys.stderr)
        return 2
    try:
        kwargs = {"length_scale": args.length_scale} if args.engine == "piper" else {}
        engine = load_tts(args.engine, resolve_model(voice, kind="tts"), **kwargs)
        t0 = time.perf_counter()
        first = None
        chunks = []
        for chunk in engine.synthesize(args.text):
            first = first if first is not None else time.perf_counter() - t0
            chunks.append(chunk)
        elapsed = time.perf_counter() - t0
        if not chunks:
            print("error: the voice produced no audio for this text", file=sys.stderr)
            return 1
        rate = chunks[0].sample_rate
        audio = np.concatenate([c.pcm for c in chunks])
        if args.phone:
            audio = phone_roundtrip(audio, rate)
        if args.rate and args.rate != rate:
            audio, rate = resample(audio, rate, args.rate), args.rate
        path = write_wav(args.out, audio, rate)
    except (ModelNotFoundError, ModelLoadError, EngineNotInstalledError, AudioFormatError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    seconds = len(audio) / rate
    print(f"wrote {path}: {seconds:.2f}s at {rate} Hz (first audio after {first:.2f}s, "
          f"synthesis {elapsed:.2f}s, RTF {elapsed / seconds:.3f})", file=sys.stderr)
    return 0
