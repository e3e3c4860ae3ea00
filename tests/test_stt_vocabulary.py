"""Domain words for Whisper (issue 11): a vocabulary list -> initial_prompt / hotwords,
passed to faster-whisper, never turning noise into words, configurable, and on real
audio fixing the words the issue reported ("Tuesday morning slot", not "Flot")."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from pipeline.config import Config, ConfigError, STTConfig, load_config
from voice.stt import (
    COMPRESSION_RATIO_LIMIT,
    MAX_VOCABULARY_CHARS,
    VOCABULARY_MODES,
    WhisperPrompt,
    WhisperSTT,
    vocabulary_text,
)

DENTAL = ["Riverside Dental", "Dr. Patel", "Dr. Moreno", "cleaning", "check-up", "whitening", "filling",
          "Delta Dental", "Aetna", "Tuesday", "Wednesday", "Friday", "Saturday", "slot", "appointment"]


# ---------------------------------------------------------------- vocabulary -> prompt text


def test_vocabulary_text_joins_phrases_in_order_without_blanks_or_repeats():
    assert vocabulary_text(["Dr. Patel", "  cleaning ", "", "dr. patel", "Aetna"]) == "Dr. Patel, cleaning, Aetna."
    assert vocabulary_text(["Tuesday morning  slot"]) == "Tuesday morning slot."
    assert vocabulary_text([]) is None and vocabulary_text(["", "  "]) is None


def test_vocabulary_text_stops_at_a_phrase_boundary_under_the_limit():
    words = [f"phrase{i:03d}" for i in range(200)]  # 200 * 10 chars: far over the limit
    text = vocabulary_text(words)
    assert len(text) <= MAX_VOCABULARY_CHARS
    kept = text.rstrip(".").split(", ")
    assert kept == words[:len(kept)] and len(kept) > 10  # whole phrases, the first ones


@pytest.mark.parametrize("mode, initial, hot", [
    ("none", False, False), ("initial_prompt", True, False), ("hotwords", False, True), ("both", True, True)])
def test_prompt_from_vocabulary_per_mode(mode, initial, hot):
    p = WhisperPrompt.from_vocabulary(DENTAL, mode)
    text = vocabulary_text(DENTAL)
    assert p.initial_prompt == (text if initial else None)
    assert p.hotwords == (text if hot else None)
    assert bool(p) == (initial or hot)


def test_empty_vocabulary_gives_no_prompt_in_any_mode():
    assert all(not WhisperPrompt.from_vocabulary([], m) for m in VOCABULARY_MODES)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="initial_prompt"):
        WhisperPrompt.from_vocabulary(DENTAL, "prompt")


# ---------------------------------------------------------------- config


def test_stt_config_defaults_give_no_prompt():
    cfg = STTConfig()
    assert cfg.vocabulary == [] and cfg.vocabulary_mode == "initial_prompt"
    assert not WhisperPrompt.from_vocabulary(cfg.vocabulary, cfg.vocabulary_mode)


def test_stt_vocabulary_from_toml(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[stt]\nvocabulary = ["Riverside Dental", "Aetna"]\nvocabulary_mode = "hotwords"\n')
    cfg = load_config(path)
    assert cfg.stt.vocabulary == ["Riverside Dental", "Aetna"] and cfg.stt.vocabulary_mode == "hotwords"
    path.write_text('[stt]\nvocabulary_mode = "prompt"\n')
    with pytest.raises(ConfigError, match="vocabulary_mode"):
        load_config(path)


def test_agent_builds_whisper_with_the_configured_prompt(monkeypatch):
    """AgentModels.load hands the vocabulary to the STT engine (LLM, TTS, VAD stubbed)."""
    import modelstore
    import voice.stt
    import voice.tts
    import voice.vad
    from pipeline.agent import AgentModels

    built = {}

    class RecordingSTT:
        def __init__(self, path, **kwargs):
            built.update(kwargs, path=path)

    monkeypatch.setattr(voice.stt, "WhisperSTT", RecordingSTT)
    monkeypatch.setattr(voice.tts, "load_tts", lambda *a, **k: object())
    monkeypatch.setattr(voice.vad, "SileroModel", lambda: object())
    monkeypatch.setattr(modelstore, "resolve_model", lambda name, kind=None: f"/models/{name}")
    cfg = Config.model_validate({"llm": {"backend": "openai"},
                                 "stt": {"vocabulary": ["Aetna", "Dr. Patel"], "vocabulary_mode": "both"}})
    AgentModels.load(cfg, warm=False)
    assert built["initial_prompt"] == built["hotwords"] == "Aetna, Dr. Patel."
    AgentModels.load(Config.model_validate({"llm": {"backend": "openai"}}), warm=False)
    assert built["initial_prompt"] is None and built["hotwords"] is None


# ---------------------------------------------------------------- what reaches faster-whisper (fake model)


@dataclass
class Seg:
    text: str
    no_speech_prob: float = 0.05
    avg_logprob: float = -0.2
    compression_ratio: float = 1.0


class FakeWhisperModel:
    """Records each transcribe call; answers `prompted` when given any prompt, else `plain`."""

    def __init__(self, prompted: list[Seg], plain: list[Seg]):
        self.prompted, self.plain, self.calls = prompted, plain, []

    def transcribe(self, audio, **kwargs):
        self.calls.append(kwargs)
        has_prompt = kwargs.get("initial_prompt") or kwargs.get("hotwords")
        return iter(self.prompted if has_prompt else self.plain), None


def fake_stt(model: FakeWhisperModel, **options) -> WhisperSTT:
    stt = object.__new__(WhisperSTT)  # no model folder: only the decoding logic is under test
    stt.model = model
    stt.language, stt.beam_size, stt.vad_filter = "en", 1, False
    stt.window, stt.window_pad_s = "full", 4.0
    stt.silence_dbfs, stt.no_speech_threshold, stt.logprob_threshold = -55.0, 0.6, -1.0
    stt.initial_prompt = options.get("initial_prompt")
    stt.hotwords = options.get("hotwords")
    return stt


SPEECH = (0.1 * np.sin(np.arange(16000) / 5)).astype(np.float32)  # loud enough to reach the model


def test_engine_passes_its_prompt_and_a_per_call_prompt_replaces_it():
    model = FakeWhisperModel([Seg(" Can I book the Tuesday morning slot?")], [Seg(" Can I book the Tuesday morning flight?")])
    stt = fake_stt(model, initial_prompt="Riverside Dental, slot.", hotwords="Aetna.")
    assert stt.transcribe(SPEECH) == "Can I book the Tuesday morning slot?"
    assert model.calls[-1]["initial_prompt"] == "Riverside Dental, slot." and model.calls[-1]["hotwords"] == "Aetna."
    r = stt.transcribe_full(SPEECH, prompt=WhisperPrompt(hotwords="Luigi's Bistro."))
    assert model.calls[-1]["initial_prompt"] is None and model.calls[-1]["hotwords"] == "Luigi's Bistro."
    r = stt.transcribe_full(SPEECH, prompt=WhisperPrompt())
    assert model.calls[-1]["initial_prompt"] is None and model.calls[-1]["hotwords"] is None
    assert r.text.endswith("flight?") and not r.prompt_dropped
    assert len(model.calls) == 3  # one decode each: nothing suspect


@pytest.mark.parametrize("suspect", [
    Seg(" Dr. Patel, Dr. Moreno, Dr.", no_speech_prob=0.89, avg_logprob=-0.6),  # measured on -30 dBFS noise
    Seg(" Dr. Patel, Dr. Moreno, Dr. Moreno, Dr. Moreno", no_speech_prob=0.3,
        compression_ratio=COMPRESSION_RATIO_LIMIT + 0.1),  # a repetition loop
    Seg(" Riverside Dental, Dr. Patel, Dr. Moreno", no_speech_prob=0.3),  # three prompt phrases in a row
])
def test_prompt_echo_is_decoded_again_without_the_prompt(suspect):
    model = FakeWhisperModel([suspect], [])  # without the prompt: nothing heard
    stt = fake_stt(model, initial_prompt=vocabulary_text(DENTAL))
    r = stt.transcribe_full(SPEECH)
    assert r.text == "" and r.prompt_dropped
    assert [bool(c["initial_prompt"]) for c in model.calls] == [True, False]


def test_vocabulary_words_in_a_real_sentence_are_not_an_echo():
    said = Seg(" Is Dr. Moreno available on Wednesday, or Dr. Patel on Friday?")
    model = FakeWhisperModel([said], [Seg(" something else")])
    stt = fake_stt(model, initial_prompt=vocabulary_text(DENTAL))
    r = stt.transcribe_full(SPEECH)
    assert r.text == said.text.strip() and not r.prompt_dropped and len(model.calls) == 1


def test_no_prompt_never_decodes_twice():
    model = FakeWhisperModel([], [Seg(" hmm", no_speech_prob=0.9, avg_logprob=-0.1)])
    stt = fake_stt(model)
    r = stt.transcribe_full(SPEECH)
    assert r.text == "hmm" and not r.prompt_dropped and len(model.calls) == 1


# ---------------------------------------------------------------- real models


def _model(name: str) -> WhisperSTT:
    from conftest import require_model

    if name not in _loaded:
        _loaded[name] = WhisperSTT(require_model(name))
    return _loaded[name]


_loaded: dict[str, WhisperSTT] = {}


def _noise(kind: str) -> np.ndarray:
    from voice.mulaw import phone_roundtrip

    rng = np.random.default_rng(5)
    n = 3 * 16000
    t = np.arange(n) / 16000
    pcm = {
        "white -45 dBFS": 10 ** (-45 / 20) * rng.normal(0, 1, n),
        "white -26 dBFS": 0.05 * rng.normal(0, 1, n),
        "hum 60 Hz + hiss": 0.02 * np.sin(2 * np.pi * 60 * t) + 0.003 * rng.normal(0, 1, n),
    }[kind]
    return phone_roundtrip(pcm.astype(np.float32), 16000)


@pytest.mark.models
@pytest.mark.parametrize("name", ["whisper-tiny.en", "whisper-base"])
@pytest.mark.parametrize("kind", ["white -45 dBFS", "white -26 dBFS", "hum 60 Hz + hiss"])
@pytest.mark.parametrize("mode", ["initial_prompt", "hotwords", "both"])
def test_prompted_whisper_hears_nothing_in_noise(name, kind, mode):
    """Without the guard, prompted Whisper answers this noise with 'Dr. Patel, Dr. Moreno, ...'."""
    stt = _model(name)
    r = stt.transcribe_full(_noise(kind), prompt=WhisperPrompt.from_vocabulary(DENTAL, mode))
    assert r.text == "", r


def _spoken(text: str) -> np.ndarray:
    """Piper (without its random noise: the same audio every run) over the phone line."""
    from conftest import require_model
    from bench.voice import _pad, piper_audio
    from voice.audio import resample
    from voice.mulaw import phone_roundtrip
    from voice.tts import PiperTTS

    tts = PiperTTS(require_model("piper-joe-medium") / "en_US-joe-medium.onnx")
    pcm, rate = piper_audio(tts, text, flat=True)
    return phone_roundtrip(_pad(resample(pcm, rate, 16000)), 16000)


@pytest.mark.models
@pytest.mark.parametrize("sentence, word", [
    ("Can I book the Tuesday morning slot?", "tuesday morning slot"),  # the issue's own sentence
    ("Do you take Delta Dental or only Aetna?", "aetna"),
    ("Is Dr. Moreno available on Wednesday afternoon?", "moreno"),
])
def test_domain_words_are_heard_right_with_the_vocabulary(sentence, word):
    """Issue 11 over the phone line, Whisper base. In this rendering, without the prompt it
    hears 'morning flight' (the call heard 'Flot'), 'only eat Neth', 'Dr. Morno'
    (`specvoice bench voice --vocabulary --phone`); with the dental vocabulary, the words."""
    stt = _model("whisper-base")
    text = stt.transcribe_full(_spoken(sentence),
                               prompt=WhisperPrompt.from_vocabulary(DENTAL, "initial_prompt")).text.lower()
    assert word in text, text


@pytest.mark.models
def test_vocabulary_keeps_lj_clips_under_the_phone_limit():
    """A business vocabulary on unrelated speech (LJ Speech) must not wreck it."""
    import jiwer

    from conftest import speech_clips
    from bench.voice import wer_words
    from voice.mulaw import phone_roundtrip
    from voice.wav import read_wav

    stt = _model("whisper-base")
    prompt = WhisperPrompt.from_vocabulary(DENTAL, "initial_prompt")
    refs, hyps = [], []
    for path, ref in speech_clips():
        refs.append(wer_words(ref))
        hyps.append(wer_words(stt.transcribe_full(phone_roundtrip(read_wav(path)[0], 16000), prompt=prompt).text))
    assert jiwer.wer(refs, hyps) < 0.25  # the same ceiling as without a prompt (test_voice_stt)
