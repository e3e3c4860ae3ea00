"""Smart Turn v3.2: pulled and pinned like every model, Pipecat's exact input, sensible decisions."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import require_model
import modelstore as models
from voice.audio import STT_RATE, resample
from voice.errors import AudioFormatError, ModelFileMissingError, ModelLoadError
from voice.turn_detector import (
    CATALOG_NAME, MODEL_FILE, N_FRAMES, N_MELS, WINDOW_SAMPLES, TurnDetector, fit_window, smart_turn_features,
)

PINNED = "2bb026316b14a660486a75b1733cd3fbab8c2fd0314dc9af7be49f8cca967e4f"
QUESTIONS = [
    "Can I book a cleaning for next Tuesday?",
    "What time do you open on Saturday?",
    "Do you take my insurance?",
]
PAUSE = np.zeros(int(0.3 * STT_RATE), np.float32)  # the silence the VAD waited for before asking


@pytest.fixture(scope="module")
def detector():
    return TurnDetector.load(require_model(CATALOG_NAME))


@pytest.fixture(scope="module")
def speak():
    from voice.tts import PiperTTS

    # No sampling noise: the same text gives the same samples, so a score here is one figure,
    # not a draw (with Piper's default noise the full question below scored 0.70-0.98).
    piper = PiperTTS(require_model("piper-joe-medium") / "en_US-joe-medium.onnx", noise_scale=0.0, noise_w_scale=0.0)

    def say(text: str) -> np.ndarray:
        chunks = list(piper.synthesize(text))
        return resample(np.concatenate([c.pcm for c in chunks]), chunks[0].sample_rate, STT_RATE)

    return say


# ---------------------------------------------------------------- no model needed


def test_catalog_pins_the_one_wheel_member():
    spec = models.CATALOG[CATALOG_NAME]
    assert spec.packages == ("pipecat-ai==1.14.0",)
    (plan,) = spec.files
    assert plan.dest == MODEL_FILE == spec.entry
    assert plan.members == (("pipecat-ai", "pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"),)
    assert plan.sha256 == PINNED
    assert CATALOG_NAME in models.default_names()  # `specvoice models pull` fetches it


def test_missing_model_names_the_pull(tmp_path):
    for path in (tmp_path, tmp_path / MODEL_FILE, tmp_path / "nowhere" / MODEL_FILE):
        with pytest.raises(ModelFileMissingError, match=f"specvoice models pull {CATALOG_NAME}"):
            TurnDetector.load(path)


def test_corrupt_model_names_the_fix(tmp_path):
    (tmp_path / MODEL_FILE).write_bytes(b"not an onnx model")
    with pytest.raises(ModelLoadError, match=f"specvoice models pull {CATALOG_NAME}"):
        TurnDetector.load(tmp_path)


def test_window_keeps_the_last_8_s_and_left_pads():
    short = np.ones(STT_RATE, np.float32)
    out = fit_window(short)
    assert out.size == WINDOW_SAMPLES and not out[:-STT_RATE].any() and out[-STT_RATE:].all()
    long = np.arange(WINDOW_SAMPLES + 5, dtype=np.float32)
    assert np.array_equal(fit_window(long), long[5:])


def test_features_match_transformers_as_pipecat_calls_it():
    """Pipecat 1.14: left-pad/truncate to 8 s, then WhisperFeatureExtractor(chunk_length=8) with
    do_normalize=True (its vendored numpy copy replicates exactly this call)."""
    from transformers import WhisperFeatureExtractor

    rng = np.random.default_rng(0)
    t = np.arange(int(2.5 * STT_RATE)) / STT_RATE
    audio = (0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)
    reference = WhisperFeatureExtractor(chunk_length=8)(
        fit_window(audio), sampling_rate=STT_RATE, padding="max_length", max_length=WINDOW_SAMPLES,
        truncation=True, do_normalize=True, return_tensors="np",
    ).input_features[0]
    ours = smart_turn_features(audio)
    assert ours.shape == (N_MELS, N_FRAMES) and ours.dtype == np.float32
    assert np.abs(ours - reference).max() < 1e-4  # float32 FFT here, float64 there: ~2e-5
    int16 = (audio * 32767).astype(np.int16)  # int16 input is scaled like the rest of voice/
    assert np.array_equal(smart_turn_features(int16), smart_turn_features(int16.astype(np.float32) / 32768))


def test_bad_audio_is_refused():
    with pytest.raises(AudioFormatError):
        smart_turn_features(np.zeros((2, 100), np.float32))
    with pytest.raises(AudioFormatError):
        smart_turn_features(np.array([0.0, np.nan], np.float32))


# ---------------------------------------------------------------- the real model


@pytest.mark.models
def test_pulled_file_is_the_pinned_one():
    folder = require_model(CATALOG_NAME)
    manifest = models.verify_model(CATALOG_NAME)  # re-hashes against what the pull checked
    assert manifest["files"][MODEL_FILE] == {"sha256": PINNED, "size": (folder / MODEL_FILE).stat().st_size,
                                             "verified": True}
    assert models.resolve_model(CATALOG_NAME) == str(folder / MODEL_FILE)


@pytest.mark.models
def test_complete_questions_score_high(detector, speak):
    probabilities = [detector.probability(np.concatenate([speak(q), PAUSE])) for q in QUESTIONS]
    assert min(probabilities) >= 0.62, probabilities
    assert sum(p >= 0.93 for p in probabilities) >= 2, probabilities


@pytest.mark.models
def test_unfinished_fragment_scores_lower_than_its_question(detector, speak):
    """The question, and the same words stopped at "and": Piper's voice keeps rising on the
    conjunction. (A fragment ending in "for the" is NOT caught by Smart Turn with Piper's flat
    prosody, ~0.97: that case is the transcript's job, see voice.turn_detector.dangling_word.)"""
    full = detector.probability(np.concatenate([speak("I would like to book a cleaning and a checkup."), PAUSE]))
    fragment = detector.predict(np.concatenate([speak("I would like to book a cleaning and"), PAUSE]))
    # Margins, not this CPU's figures: Piper and onnxruntime round differently across CPUs (AVX2
    # here 0.967; an AVX-512 EPYC gave 0.893), so the test asks for the decision and a wide gap.
    assert full > 0.75 and full > detector.threshold
    assert fragment.probability < 0.5 and not fragment.complete
    assert fragment.probability < full - 0.4


@pytest.mark.models
def test_silence_and_short_audio_do_not_crash(detector):
    assert detector.probability(np.zeros(0, np.float32)) == 0.0  # nothing said: no turn to end
    for audio in (np.zeros(1, np.float32), np.zeros(STT_RATE, np.float32), np.zeros(160, np.int16),
                  np.full(400, 1e-4, np.float32)):
        p = detector.probability(audio)
        assert 0.0 <= p <= 1.0


@pytest.mark.models
def test_long_audio_uses_the_last_8_s(detector, speak):
    question = np.concatenate([speak(QUESTIONS[1]), PAUSE])
    long = np.concatenate([np.tile(speak("I would like to book a cleaning and"), 6), question])
    assert long.size > WINDOW_SAMPLES
    assert detector.probability(long) == pytest.approx(detector.probability(long[-WINDOW_SAMPLES:]), abs=1e-6)
    prediction = detector.predict(long)
    assert prediction.audio_s == pytest.approx(long.size / STT_RATE)
    assert prediction.compute_ms > 0


@pytest.mark.parametrize("text, word", [
    ("Can I book a cleaning for the", "the"),
    ("I would like to book a cleaning and...", "and"),
    ("I want to move my", "my"),
    ("So, um.", "um"),
    ("Can I book a cleaning for next Tuesday?", None),
    ("What are you looking for?", None),
    ("I would like to book a cleaning for", "for"),
    ("Could you tell me if Dr. Patel is free on.", "on"),
    ("I need to move my cleaning to...", "to"),
    ("Which dentist should I ask for?", None),
    ("", None),
    ("  ...  ", None),
])
def test_dangling_word(text, word):
    from voice.turn_detector import dangling_word

    assert dangling_word(text) == word


@pytest.mark.parametrize("text, ending", [
    ("And it is worth mention in passing,", ","),  # a reader's comma pause (bench pipeline)
    ("In being comparatively modern,", ","),
    ("My insurance is with Aetna, but,", "but"),  # the dangling word first
    ("I would like a cleaning for next", "next"),
    ("Has never been surpassed.", None),
    ("Can I book the Tuesday slot, please?", None),
    ("Tuesday, Wednesday", None),  # a comma inside is not an ending
    ("", None),
])
def test_open_ending(text, ending):
    from voice.turn_detector import open_ending

    assert open_ending(text) == ending


@pytest.mark.models
def test_a_human_reader_mid_sentence_scores_low():
    """LJ Speech: a person reading. Clips whose transcript ends on "," stop mid-sentence
    (0.009-0.011 measured), those ending on "." are finished (0.97-0.99)."""
    from conftest import speech_clips
    from voice.wav import read_wav

    detector = TurnDetector.load(require_model(CATALOG_NAME))
    scored = [(text.rstrip()[-1], detector.probability(read_wav(path)[0])) for path, text in speech_clips()]
    assert {mark for mark, _ in scored} == {".", ","}, scored
    assert all(p >= 0.9 for mark, p in scored if mark == "."), scored
    assert all(p <= 0.2 for mark, p in scored if mark == ","), scored


def test_turn_policy():
    from voice.turn_detector import TurnPolicy

    policy = TurnPolicy(check_silence_s=0.2, threshold=0.5, max_silence_s=1.5)
    table = [
        # silence, P, transcript -> action, reason
        (0.0, None, None, "wait", "speaking"),
        (0.1, None, None, "wait", "pause"),
        (0.2, None, None, "ask", "pause"),
        (0.2, 0.93, None, "end", "model"),
        (0.2, 0.93, "Can I book a cleaning for next Tuesday?", "end", "model"),
        (0.2, 0.97, "Can I book a cleaning for the", "wait", "dangling"),
        (0.2, 0.97, "Can I book a cleaning for the.", "wait", "dangling"),
        (0.6, 0.40, None, "wait", "incomplete"),
        (0.6, 0.50, None, "wait", "incomplete"),  # "complete" is P > threshold, as in Pipecat
        (1.5, 0.01, "and", "end", "timeout"),
        (1.5, None, None, "end", "timeout"),
    ]
    for silence, p, text, action, reason in table:
        decision = policy.decide(silence, p, text)
        assert (decision.action, decision.reason) == (action, reason), (silence, p, text, decision)
    assert TurnPolicy(hold_on_dangling=False).decide(0.3, 0.97, "for the").action == "end"
    with pytest.raises(ValueError):
        TurnPolicy(check_silence_s=2.0, max_silence_s=1.5)
    with pytest.raises(ValueError):
        TurnPolicy(threshold=1.0)


# ---------------------------------------------------------------- the recipe for the listen stage


def take_turns(signal: np.ndarray, endpointer, detector, policy) -> list[dict]:
    """What the call's listen stage should do, on a simulated clock (20 ms frames).

    The endpointer runs with min_silence_ms = policy.check_silence_s, so its SpeechEnded is
    a *pause*, not a turn: the pause's audio joins the pending turn, Smart Turn is asked
    once on the pending turn's audio, and TurnPolicy decides; a turn left waiting ends when
    the caller speaks again (the next pause is asked anew) or at max_silence_s (checked on
    every frame's time). detector=None: every pause ends the turn (today's behaviour).
    """
    turns: list[dict] = []
    pending: list[np.ndarray] = []
    last_voiced = probability = None
    frame = int(0.02 * STT_RATE)
    for i in range(0, signal.size, frame):
        t = i / STT_RATE
        for event in endpointer.feed(signal[i:i + frame], t):
            if not hasattr(event, "last_voiced_t"):  # SpeechStarted: the caller goes on
                last_voiced = probability = None
                continue
            pending.append(event.audio)
            last_voiced = event.last_voiced_t
            probability = detector.probability(np.concatenate(pending)) if detector else 1.0
            decision = policy.decide(event.declared_t - last_voiced, probability)
            if decision.action == "end":
                turns.append({"audio": np.concatenate(pending), "delay": event.declared_t - last_voiced,
                              "reason": decision.reason, "probability": probability})
                pending, last_voiced = [], None
        now = t + frame / STT_RATE
        if last_voiced is not None and policy.decide(now - last_voiced, probability).action == "end":
            turns.append({"audio": np.concatenate(pending), "delay": now - last_voiced, "reason": "timeout",
                          "probability": probability})
            pending, last_voiced = [], None
    return turns


@pytest.mark.models
def test_recipe_keeps_a_mid_sentence_pause_in_the_turn_and_ends_sooner(detector):
    """A reader stops mid-sentence ("... the true printed book,"), pauses 0.8 s, finishes
    ("has never been surpassed."). A plain 500 ms endpointer makes two turns of it and
    answers the fragment; VAD + Smart Turn make one turn, declared ~0.2 s after the end."""
    from conftest import speech_clips
    from voice.endpointer import EndpointConfig, Endpointer
    from voice.turn_detector import TurnPolicy
    from voice.vad import SileroModel, SileroVAD
    from voice.wav import read_wav

    clips = {path.name: path for path, _ in speech_clips()}
    first, second = read_wav(clips["LJ001-0004.wav"])[0], read_wav(clips["LJ001-0008.wav"])[0]
    rng = np.random.default_rng(1)

    def room(seconds: float) -> np.ndarray:
        return (rng.standard_normal(int(seconds * STT_RATE)) * 0.002).astype(np.float32)

    signal = np.concatenate([room(0.5), first, room(0.8), second, room(2.0)])
    vad = SileroModel()
    policy = TurnPolicy(check_silence_s=0.2, max_silence_s=1.5)

    plain = take_turns(signal, Endpointer(SileroVAD(vad), EndpointConfig(min_silence_ms=500)), None, policy)
    assert len(plain) == 2  # the fragment would be answered

    turns = take_turns(signal, Endpointer(SileroVAD(vad), EndpointConfig(min_silence_ms=200)), detector, policy)
    assert len(turns) == 1, [(t["reason"], t["probability"]) for t in turns]
    (turn,) = turns
    assert turn["reason"] == "model" and turn["probability"] > 0.9
    assert turn["delay"] < 0.3  # vs 0.5 s for the plain endpointer
    assert turn["audio"].size / STT_RATE > (first.size + second.size) / STT_RATE - 0.5  # both parts, one turn
