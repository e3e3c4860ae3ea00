"""`specvoice transcribe FILE.wav`: speech to text with the agent's own STT."""

from __future__ import annotations

import argparse
import sys

HELP = "transcribe a WAV file with Whisper or Moonshine (optionally as heard over a phone line)"
DESCRIPTION = """\
Print the transcript of an audio file, using the same Whisper engine as the agent
(faster-whisper, int8 on CPU). Any rate and channel count is accepted: stereo is mixed
down and the audio resampled to 16 kHz first.

--phone first sends the audio through what a phone call does to it (down to 8 kHz,
G.711 mu-law, back up), so you can hear-check how the agent copes with telephony.

  specvoice transcribe hello.wav                          # Whisper base (the default)
  specvoice transcribe hello.wav --model whisper-tiny.en  # faster, a little less accurate
  specvoice transcribe hello.wav --phone --timing         # as over a call, with timing on stderr
  specvoice transcribe hello.wav --model ~/models/my-ct2-whisper   # any CTranslate2 model folder
  specvoice transcribe call.wav --phone --vocabulary "Riverside Dental, Dr. Patel, Aetna, slot"
  specvoice transcribe hello.wav --window audio           # Whisper encodes the audio + 4 s, not 30 s
  specvoice transcribe hello.wav --engine moonshine       # Moonshine base: cost follows the audio

--vocabulary gives Whisper the words a caller is likely to say that it may not know
(names, services, days), comma-separated, as its initial prompt (the agent's
`stt.vocabulary`); --vocabulary-mode picks how (see `specvoice bench voice --vocabulary`).

Models are catalog names pulled with `specvoice models pull NAME` (faster-whisper's names
`base` and `tiny.en` work too), or a local folder.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE.wav", help="audio file to transcribe (WAV, FLAC, OGG: anything libsndfile reads)")
    parser.add_argument("--engine", default="whisper", choices=["whisper", "moonshine"],
                        help="faster-whisper or Moonshine base English (default: %(default)s)")
    parser.add_argument("--model", default=None,
                        help="catalog name (whisper-base, whisper-tiny.en; or base, tiny.en; moonshine-base-en) "
                             "or a model folder (default: whisper-base, or moonshine-base-en with --engine moonshine)")
    parser.add_argument("--window", default="full", choices=["full", "audio"],
                        help="Whisper: encode the 30 s window, or the audio + 4 s (default: %(default)s)")
    parser.add_argument("--phone", action="store_true", help="pass the audio through 8 kHz mu-law first, as a phone call would")
    parser.add_argument("--beam-size", type=int, default=1, help="beam search width; 1 is greedy and fastest (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    parser.add_argument("--compute-type", default="int8", help="CTranslate2 compute type (default: %(default)s)")
    parser.add_argument("--timing", action="store_true", help="print audio length, compute time and real-time factor to stderr")
    parser.add_argument("--vocabulary", default="", metavar="WORDS",
                        help="comma-separated words and phrases the speaker is likely to say (names, services)")
    parser.add_argument("--vocabulary-mode", default="initial_prompt",
                        choices=["none", "initial_prompt", "hotwords", "both"],
                        help="how the vocabulary reaches Whisper (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    from modelstore import ModelNotFoundError, resolve_model
    from voice.errors import AudioFormatError, ModelLoadError
    from voice.mulaw import phone_roundtrip
    from voice.stt import WhisperPrompt, WhisperSTT
    from voice.wav import read_wav

    prompt = WhisperPrompt.from_vocabulary(args.vocabulary.split(","), args.vocabulary_mode)
    try:
        audio, rate = read_wav(args.file)
        if args.phone:
            audio = phone_roundtrip(audio, rate)
        if args.engine == "moonshine":
            from voice.moonshine import MoonshineSTT

            # No prompt: the vocabulary is matched onto the transcript.
            stt = MoonshineSTT(resolve_model(args.model or "moonshine-base-en", kind="stt"),
                               vocabulary=[w for w in args.vocabulary.split(",") if w.strip()])
            result = stt.transcribe_full(audio, rate)
        else:
            stt = WhisperSTT(resolve_model(args.model or "whisper-base", kind="stt"), device=args.device,
                             compute_type=args.compute_type, beam_size=args.beam_size,
                             initial_prompt=prompt.initial_prompt, hotwords=prompt.hotwords, window=args.window)
            result = stt.transcribe_full(audio, rate)
    except (AudioFormatError, ModelNotFoundError, ModelLoadError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(result.text)
    if args.timing:
        print(f"audio {result.audio_s:.2f}s  compute {result.compute_s:.2f}s  RTF {result.rtf:.3f}"
              f"{'  (via 8 kHz mu-law)' if args.phone else ''}"
              f"{'  (vocabulary prompt not trusted for this audio: decoded without it)' if result.prompt_dropped else ''}",
              file=sys.stderr)
    return 0
