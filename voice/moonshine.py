"""Speech to text with Moonshine base English (ONNX int8 on onnxruntime).

Moonshine (Useful Sensors / Moonshine AI, MIT) encodes exactly the audio it is given, no
fixed window, so its cost follows the utterance (~50 ms a second of audio on one core,
against a flat ~1.8 s for faster-whisper base's 30 s window). The model files come from
the `moonshine-cpp==0.1.4` wheel, converted once at `specvoice models pull`
(voice/moonshine_convert.py): an encoder, a first-step decoder and a with-past decoder.

Decoding is greedy from `<s>` until `</s>`, under the same guards as Whisper's short
window (voice/decode_guard.py): a token cap that follows the audio and a cut of trailing
repetition loops. Moonshine takes no prompt: the business's words are put right after
decoding by `voice.vocabulary.VocabularyMatcher` (when a vocabulary is given). A turn
transcribed again as it grows (the speech prefill, each pause) drafts the decoder from the
transcript of its beginning, several tokens checked in one forward (voice/heard_before.py).

onnxruntime's worker threads spin while they wait for work by default; on two shared
cores that spinning takes the CPU from the LLM and the other STT (issue 26: 2 spinning
threads 472 ms a turn under contention, 1 thread 175 ms), so spinning is off. Without it,
1 and 2 threads cost the same here under load (73 and 75 ms per audio second, p50).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from voice.audio import STT_RATE, rms_dbfs
from voice.decode_guard import max_new_tokens, repetition_keep
from voice.errors import AudioFormatError, ModelFileMissingError, ModelLoadError, pull_hint_for
from voice.heard_before import HeardBefore, next_guess
from voice.moonshine_convert import CONVERTED_FILES, DECODER_FIRST, DECODER_WITH_PAST, ENCODER, TOKENIZER
from voice.stt import ThreadedSTT, Transcript, stt_audio

REQUIRED_FILES = (*CONVERTED_FILES, TOKENIZER)
BOS, EOS = 1, 2
SPACE = "\u2581".encode()  # SentencePiece's word boundary
# Moonshine was trained on 1-64 s clips; shorter input makes its convolutions run dry.
MIN_AUDIO_S = 0.1
MAX_AUDIO_S = 64.0


def read_tokenizer(path: str | Path) -> list[bytes]:
    """moonshine-cpp's tokenizer.bin: for each token id in order, its byte length (a
    LEB128 varint) then its bytes; "\u2581" marks a word boundary, ids 3-258 are raw bytes."""
    data = Path(path).read_bytes()
    tokens, i = [], 0
    while i < len(data):
        length, shift = 0, 0
        while True:
            byte = data[i]
            i += 1
            length |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        if i + length > len(data):
            raise ModelLoadError(f"{path} is cut short at token {len(tokens)}: re-pull the model", Path(path))
        tokens.append(data[i:i + length])
        i += length
    return tokens


class MoonshineTokenizer:
    def __init__(self, path: str | Path):
        self.tokens = read_tokenizer(path)

    def decode(self, ids: Iterable[int]) -> str:
        raw = b"".join(self.tokens[i] for i in ids if EOS < i < len(self.tokens))
        return raw.replace(SPACE, b" ").decode("utf-8", errors="replace").strip()

    def whole_words(self) -> set[str]:
        """The words the tokenizer holds as one piece: words Moonshine spells right."""
        return {p[len(SPACE):].decode("utf-8", "replace").lower() for p in self.tokens
                if p.startswith(SPACE) and len(p) > len(SPACE) + 1}


def check_moonshine_dir(model_path: str | Path) -> Path:
    path = Path(model_path).expanduser()
    hint = pull_hint_for(path, f"a folder holding the converted Moonshine model ({', '.join(REQUIRED_FILES)})")
    if not path.is_dir():
        raise ModelFileMissingError(f"Moonshine model folder {path} does not exist: {hint}", path)
    for name in REQUIRED_FILES:
        f = path / name
        if not f.is_file() or f.stat().st_size == 0:
            raise ModelFileMissingError(f"Moonshine model file {f} is missing or empty: {hint}", f)
    return path


class MoonshineSTT(ThreadedSTT):
    """Moonshine base English: load once, transcribe many utterances (16 kHz mono PCM)."""

    sample_rate = STT_RATE

    def __init__(self, model_path: str | Path, cpu_threads: int = 1, silence_dbfs: float = -55.0,
                 vocabulary: Iterable[str] = (), remember: int = 32):
        """cpu_threads: onnxruntime intra-op threads per transcription (several may run at
        once from different threads). vocabulary: the business's words and phrases,
        matched onto what Moonshine heard (it takes no prompt); empty: none. remember: the
        utterances kept as drafts for the decoder when their audio grows (a turn
        transcribed again as the caller goes on, voice/heard_before.py); 0: none."""
        import onnxruntime as ort

        from voice.ort_options import sleeping_threads
        from voice.vocabulary import VocabularyMatcher

        self.model_path = check_moonshine_dir(model_path)
        self.silence_dbfs = silence_dbfs
        self.heard = HeardBefore(remember)
        self.tokenizer = MoonshineTokenizer(self.model_path / TOKENIZER)
        self.matcher = VocabularyMatcher(vocabulary, known_words=self.tokenizer.whole_words())
        options = sleeping_threads(cpu_threads)
        try:
            self.encoder = ort.InferenceSession(str(self.model_path / ENCODER), options,
                                                providers=["CPUExecutionProvider"])
            self.first = ort.InferenceSession(str(self.model_path / DECODER_FIRST), options,
                                              providers=["CPUExecutionProvider"])
            self.with_past = ort.InferenceSession(str(self.model_path / DECODER_WITH_PAST), options,
                                                  providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidProtobuf with terse text
            raise ModelLoadError(f"cannot load Moonshine from {self.model_path} ({type(exc).__name__}: {exc}): "
                                 f"delete the folder and run `specvoice models pull moonshine-base-en`",
                                 self.model_path) from exc
        # The with-past model reads every cache the first step wrote; its own outputs are
        # the decoder's (the encoder's keys/values do not change after the first step).
        self._past_inputs = [i.name for i in self.with_past.get_inputs() if i.name.startswith("past_key_values.")]
        self._past_outputs = ["logits"] + [o.name for o in self.with_past.get_outputs()
                                           if o.name.startswith("present.") and ".decoder." in o.name]
        self._first_outputs = [o.name for o in self.first.get_outputs()]

    # -------------------------------------------------------------- sync

    def generate(self, hidden: np.ndarray, max_tokens: int, draft: list[int] | None = None) -> tuple[list[int], int]:
        """Greedy token ids (without <s> and </s>) for the encoder's states of one utterance,
        and how many of them came from `draft` (an earlier transcript of the audio's
        beginning, voice/heard_before.py): each with-past forward checks the token just
        written and the draft's guess of what follows it, at once."""
        if max_tokens <= 0:
            return [], 0
        outputs = self.first.run(self._first_outputs, {"input_ids": np.array([[BOS]], np.int64),
                                                         "encoder_hidden_states": hidden})
        named = dict(zip(self._first_outputs, outputs))
        cache = {name: named[name.replace("past_key_values.", "present.")] for name in self._past_inputs}
        tokens: list[int] = []
        drafted = 0
        row = named["logits"][0, -1]
        while True:
            token = int(np.argmax(row))
            if token == EOS:
                break
            tokens.append(token)
            if len(tokens) == max_tokens:
                break
            guess = next_guess(draft, tokens, max_tokens - len(tokens)) if draft else []
            feed = [token, *guess]
            outputs = self.with_past.run(self._past_outputs, {"input_ids": np.array([feed], np.int64), **cache})
            logits = outputs[0][0]  # one row per token fed: row i predicts what follows feed[i]
            taken = 0
            while taken < len(guess) and int(np.argmax(logits[taken])) == guess[taken]:
                taken += 1
            tokens.extend(guess[:taken])
            drafted += taken
            keep = cache[self._past_inputs[0]].shape[2] + 1 + taken  # the cache up to the last token kept
            for name, value in zip(self._past_outputs[1:], outputs[1:]):
                cache[name.replace("present.", "past_key_values.")] = (
                    value if taken == len(guess) else np.ascontiguousarray(value[:, :, :keep]))
            if len(tokens) >= max_tokens:
                break
            row = logits[taken]
        return tokens, drafted

    def transcribe_full(self, audio: np.ndarray, sample_rate: int = STT_RATE) -> Transcript:
        audio = stt_audio(audio, sample_rate, "Moonshine")
        t0 = time.perf_counter()
        audio_s = len(audio) / STT_RATE
        if audio_s < MIN_AUDIO_S or rms_dbfs(audio) < self.silence_dbfs:
            return Transcript("", audio_s, time.perf_counter() - t0)
        if audio_s > MAX_AUDIO_S:
            raise AudioFormatError(f"Moonshine takes at most {MAX_AUDIO_S:.0f} s at once, got {audio_s:.1f} s: "
                                   f"split the audio (the endpointer's max utterance length)")
        draft, same = self.heard.draft_for(audio)
        if same:  # this very audio again (a pause's, then its turn's end): the same transcript
            ids, drafted = draft, len(draft)
        else:
            hidden = self.encoder.run(None, {"input_values": audio[None, :]})[0]
            ids, drafted = self.generate(hidden, max_new_tokens(audio_s), draft)
            self.heard.remember(audio, ids)
        text = self.tokenizer.decode(ids)
        words = text.split()
        keep = repetition_keep(words)
        cut = keep < len(words)
        if cut:
            text = " ".join(words[:keep])
        return Transcript(self.matcher.correct(text), audio_s, time.perf_counter() - t0, repetition_cut=cut,
                          drafted_tokens=drafted)

    def transcribe(self, audio: np.ndarray, sample_rate: int = STT_RATE) -> str:
        """Finished utterance (16 kHz mono float32) -> text ("" for silence)."""
        return self.transcribe_full(audio, sample_rate).text

    def transcribe_partial(self, audio: np.ndarray, sample_rate: int = STT_RATE) -> str:
        return self.transcribe_full(audio, sample_rate).text
