"""Moonshine base English: the ORT -> ONNX conversion, the tokenizer, the engine on real
speech (LJ clips, phone line, noise), the business vocabulary matched onto its
transcript, and `[stt] engine = "moonshine"` in the agent (issue 26)."""

from __future__ import annotations

import numpy as np
import pytest

from voice.vocabulary import VocabularyMatcher

# ---------------------------------------------------------------- conversion (small models, no download)


def _save_ort(model, path) -> None:
    """Write `model` in the ORT flatbuffer format, unoptimised (as moonshine-cpp ships its files)."""
    import onnx
    import onnxruntime as ort

    src = path.with_suffix(".onnx")
    onnx.save(model, src)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.optimized_model_filepath = str(path)
    options.add_session_config_entry("session.save_model_format", "ORT")
    ort.InferenceSession(str(src), options, providers=["CPUExecutionProvider"])


def _run(path, feeds, outputs=None):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(outputs, feeds)


def _dequantized_matmul(name: str, x: str, out: str, rng) -> tuple[list, list]:
    """int8 weight -> Cast -> Mul(scale) -> MatMul: the shipped files' pattern."""
    from onnx import helper, numpy_helper

    # Spread like trained weights (most small): uniform +-127 would saturate AVX2's u8 x s8
    # pair sums, a property of onnxruntime's kernels on such CPUs, not of the conversion.
    q = np.clip(rng.normal(0, 25, (16, 16)), -127, 127).astype(np.int8)
    inits = [numpy_helper.from_array(q, f"{name}_quantized"),
             numpy_helper.from_array(np.array([0.02], np.float32), f"{name}_scale")]
    nodes = [helper.make_node("Cast", [f"{name}_quantized"], [f"{name}_cast"], to=1),
             helper.make_node("Mul", [f"{name}_cast", f"{name}_scale"], [f"{name}_w"]),
             helper.make_node("MatMul", [x, f"{name}_w"], [out])]
    return nodes, inits


def test_ort_file_becomes_plain_onnx_with_folded_int8_weights(tmp_path):
    from onnx import TensorProto, helper

    from voice.moonshine_convert import fold_constant_nodes, ort_to_onnx, quantize_int8

    rng = np.random.default_rng(0)
    nodes, inits = _dequantized_matmul("w1", "x", "h", rng)
    nodes.append(helper.make_node("Relu", ["h"], ["y"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 16])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    _save_ort(model, tmp_path / "m.ort")

    converted = ort_to_onnx(tmp_path / "m.ort")
    assert [n.op_type for n in converted.graph.node] == ["Cast", "Mul", "MatMul", "Relu"]
    assert fold_constant_nodes(converted) == 2
    assert [n.op_type for n in converted.graph.node] == ["MatMul", "Relu"]
    quantize_int8(converted, tmp_path / "q.onnx")

    x = rng.normal(size=(3, 16)).astype(np.float32)
    want = _run(tmp_path / "m.onnx", {"x": x})[0]
    got = _run(tmp_path / "q.onnx", {"x": x})[0]
    import onnx

    ops = {n.op_type for n in onnx.load(tmp_path / "q.onnx").graph.node}
    assert "MatMulInteger" in ops or "DynamicQuantizeMatMul" in ops  # int8 GEMM, no per-call de-quantisation
    assert np.sqrt(((got - want) ** 2).mean() / (want ** 2).mean()) < 0.05


def test_merged_decoder_splits_into_first_step_and_with_past(tmp_path):
    """An optimum-style merged model: If(use_cache_branch) over two branches reading outer
    weights; each split model computes what the merged one does for its flag."""
    from onnx import TensorProto, helper

    from voice.moonshine_convert import fold_constant_nodes, ort_to_onnx, split_merged_decoder

    rng = np.random.default_rng(1)
    w_nodes, inits = _dequantized_matmul("w", "ids_f", "unused", rng)
    w_nodes = w_nodes[:2]  # Cast, Mul -> "w_w", read by both branches
    f = TensorProto.FLOAT
    first = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w_w"], ["l0"]), helper.make_node("Identity", ["x"], ["p0"])],
        "first", [], [helper.make_tensor_value_info("l0", f, None), helper.make_tensor_value_info("p0", f, None)])
    past = helper.make_graph(
        [helper.make_node("Add", ["x", "past"], ["s"]), helper.make_node("MatMul", ["s", "w_w"], ["l1"]),
         helper.make_node("Identity", ["s"], ["p1"])],
        "past", [], [helper.make_tensor_value_info("l1", f, None), helper.make_tensor_value_info("p1", f, None)])
    node = helper.make_node("If", ["use_cache_branch"], ["logits", "present"], then_branch=past, else_branch=first)
    graph = helper.make_graph(
        w_nodes + [node], "merged",
        [helper.make_tensor_value_info("x", f, [1, 16]), helper.make_tensor_value_info("past", f, [1, 16]),
         helper.make_tensor_value_info("use_cache_branch", TensorProto.BOOL, [1])],
        [helper.make_tensor_value_info("logits", f, [1, 16]), helper.make_tensor_value_info("present", f, [1, 16])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    _save_ort(model, tmp_path / "merged.ort")

    merged = ort_to_onnx(tmp_path / "merged.ort")
    fold_constant_nodes(merged)
    first_m, past_m = split_merged_decoder(merged)
    import onnx

    onnx.save(first_m, tmp_path / "first.onnx")
    onnx.save(past_m, tmp_path / "past.onnx")
    assert [i.name for i in first_m.graph.input] == ["x"]
    assert [i.name for i in past_m.graph.input] == ["x", "past"]
    x, p = rng.normal(size=(1, 16)).astype(np.float32), rng.normal(size=(1, 16)).astype(np.float32)
    for flag, path, feeds in ((False, "first.onnx", {"x": x}), (True, "past.onnx", {"x": x, "past": p})):
        want = _run(tmp_path / "merged.onnx", {"x": x, "past": p, "use_cache_branch": np.array([flag])})
        got = _run(tmp_path / path, feeds, ["logits", "present"])
        for a, b in zip(want, got):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_tokenizer_file_reads_varint_lengths_and_decodes_word_marks(tmp_path):
    from voice.moonshine import MoonshineTokenizer

    pieces = [b"<unk>", b"<s>", b"</s>", "\u2581Has".encode(), "\u2581never".encode(), b"!", b"x" * 200]
    data = b""
    for p in pieces:
        n = len(p)
        data += bytes([n]) if n < 128 else bytes([(n & 0x7F) | 0x80, n >> 7])
        data += p
    (tmp_path / "tokenizer.bin").write_bytes(data)
    tok = MoonshineTokenizer(tmp_path / "tokenizer.bin")
    assert tok.tokens == pieces  # the 200-byte piece needs a two-byte length
    assert tok.decode([1, 3, 4, 5, 2]) == "Has never!"
    assert tok.whole_words() == {"has", "never"}


def test_missing_model_folder_says_what_to_do(tmp_path):
    from voice.errors import ModelFileMissingError
    from voice.moonshine import MoonshineSTT

    with pytest.raises(ModelFileMissingError, match="specvoice models"):
        MoonshineSTT(tmp_path / "moonshine-base-en")


# ---------------------------------------------------------------- the vocabulary matcher (pure)

DENTAL = ["Riverside Dental", "Dr. Patel", "Dr. Moreno", "cleaning", "check-up", "whitening", "filling",
          "Delta Dental", "Aetna", "Harbor Street", "Friday", "Saturday", "slot"]
KNOWN = {"his", "doctor", "available", "on", "wednesday", "do", "you", "take", "delta", "or", "only", "how",
         "much", "is", "after", "a", "the", "office", "i", "like", "it", "lot", "fried", "an", "egg", "are",
         "open", "returned", "can", "book", "slow", "feeling", "saturdays", "dental"}


@pytest.mark.parametrize("heard, meant", [
    ("His doctor, Mornow, available on Wednesday.", "His doctor, Moreno, available on Wednesday."),
    ("Do you take Delta Dental or only Eatna?", "Do you take Delta Dental or only Aetna?"),
    ("How much is a checkup?", "How much is a check-up?"),  # respelling: always
    ("Is the Riverside Dentle office?", "Is the Riverside Dental office?"),
])
def test_vocabulary_puts_back_the_business_words(heard, meant):
    assert VocabularyMatcher(DENTAL, KNOWN).correct(heard) == meant


@pytest.mark.parametrize("said", [
    "I like it a lot.",  # known words stay: "lot" is not a misheard "slot"
    "I fried an egg on Friday.",
    "Are you open on Saturdays?",  # another form of a vocabulary word
    "Is the Riverside Dental office?",  # already right
    "Do you take Delta Dental?",  # "Dental" is not a misheard "Delta"
])
def test_vocabulary_leaves_what_was_said(said):
    assert VocabularyMatcher(DENTAL, KNOWN).correct(said) == said


# ---------------------------------------------------------------- the real model

_loaded: dict = {}


def _moonshine(vocabulary=()):
    from conftest import require_model
    from voice.moonshine import MoonshineSTT

    key = tuple(vocabulary)
    if key not in _loaded:
        _loaded[key] = MoonshineSTT(require_model("moonshine-base-en"), vocabulary=vocabulary)
    return _loaded[key]


@pytest.mark.models
@pytest.mark.parametrize("phone", [False, True], ids=["direct", "phone"])
def test_moonshine_transcribes_the_lj_clips(phone):
    import jiwer

    from conftest import speech_clips
    from bench.voice import wer_words
    from voice.mulaw import phone_roundtrip
    from voice.wav import read_wav

    clips = [(read_wav(path)[0], ref) for path, ref in speech_clips()]
    stt = _moonshine()
    hyps = [stt.transcribe(phone_roundtrip(a, 16000) if phone else a) for a, _ in clips]
    score = jiwer.wer([wer_words(r) for _, r in clips], [wer_words(h) for h in hyps])
    print(f"\nMoonshine {'phone' if phone else 'direct'}: WER {score:.1%}")
    for (_, ref), hyp in zip(clips, hyps):
        print(f"  ref: {ref}\n  hyp: {hyp}")
    assert score < 0.10  # whisper-base: 6.8% direct in the same bench


@pytest.mark.models
@pytest.mark.parametrize("kind", ["white -45 dBFS", "white -26 dBFS", "hum 60 Hz + hiss"])
def test_moonshine_hears_nothing_in_noise(kind):
    from test_stt_vocabulary import _noise

    assert _moonshine(DENTAL).transcribe(_noise(kind)) == ""


@pytest.mark.models
def test_moonshine_with_the_vocabulary_writes_the_business_words():
    """Piper over the phone line: Moonshine alone writes "Eatna" and "Mornow" (measured);
    with the dental vocabulary the transcript has the names."""
    from test_stt_vocabulary import _spoken

    for sentence, word in (("Do you take Delta Dental or only Aetna?", "aetna"),
                           ("Is Dr. Moreno available on Wednesday afternoon?", "moreno")):
        audio = _spoken(sentence)
        plain = _moonshine().transcribe(audio).lower()
        fixed = _moonshine(DENTAL).transcribe(audio).lower()
        assert word not in plain and word in fixed, (plain, fixed)


@pytest.mark.models
def test_moonshine_cost_follows_the_audio():
    """The encoder's output grows with the input (no fixed window): frames, not time."""
    stt = _moonshine()
    frames = [stt.encoder.run(None, {"input_values": np.zeros((1, n * 16000), np.float32)})[0].shape[1]
              for n in (1, 2, 4)]
    assert frames[0] < frames[1] < frames[2] and frames[2] > 3.5 * frames[0]


# ---------------------------------------------------------------- the config picks the engine


def test_agent_builds_moonshine_with_the_vocabulary(monkeypatch):
    import modelstore
    import voice.moonshine
    import voice.stt
    import voice.tts
    import voice.vad
    from pipeline.agent import AgentModels
    from pipeline.config import Config

    built = {}

    class Recording:
        def __init__(self, path, **kwargs):
            built.update(kwargs, path=path, cls=type(self).__name__)

    class RecordingMoonshine(Recording):
        pass

    class RecordingWhisper(Recording):
        pass

    monkeypatch.setattr(voice.moonshine, "MoonshineSTT", RecordingMoonshine)
    monkeypatch.setattr(voice.stt, "WhisperSTT", RecordingWhisper)
    monkeypatch.setattr(voice.tts, "load_tts", lambda *a, **k: object())
    monkeypatch.setattr(voice.vad, "SileroModel", lambda: object())
    monkeypatch.setattr(modelstore, "resolve_model", lambda name, kind=None: f"/models/{name}")
    AgentModels.load(Config.model_validate({"llm": {"backend": "openai"},
                                            "stt": {"engine": "moonshine", "vocabulary": ["Aetna"]}}), warm=False)
    assert built["cls"] == "RecordingMoonshine" and built["path"] == "/models/moonshine-base-en"
    assert list(built["vocabulary"]) == ["Aetna"]
    AgentModels.load(Config.model_validate({"llm": {"backend": "openai"}, "stt": {"window": "audio"}}), warm=False)
    assert built["cls"] == "RecordingWhisper" and built["window"] == "audio"


@pytest.mark.models
def test_transcribe_command_takes_the_engine(capsys):
    from conftest import require_model, speech_clips
    from demo.cli import main

    require_model("moonshine-base-en")
    path, _ref = speech_clips()[3]  # "has never been surpassed."
    assert main(["transcribe", str(path), "--engine", "moonshine", "--phone"]) == 0
    assert "surpassed" in capsys.readouterr().out.lower()


def test_default_config_uses_moonshine_with_the_business_vocabulary():
    """The default chosen by `specvoice bench voice --engines` (README "Choosing the STT")."""
    from pipeline.config import load_config
    from modelstore import CATALOG

    stt = load_config().stt
    assert stt.engine == "moonshine" and CATALOG[stt.model_for_engine].kind == "stt"
    assert CATALOG[stt.model_for_engine].convert_moonshine and "Aetna" in stt.vocabulary
    assert not stt.streaming  # streaming needs Whisper's word timestamps


def test_catalog_pins_every_moonshine_file_and_converts_the_two_ort_files():
    from modelstore import CATALOG, DEFAULT_ORDER

    spec = CATALOG["moonshine-base-en"]
    assert spec.kind == "stt" and spec.packages == ("moonshine-cpp==0.1.4",)
    assert all(plan.sha256 for plan in spec.files)  # weights, tokenizer and license all pinned
    assert set(spec.convert_moonshine) == {"encoder_model.ort", "decoder_model_merged.ort"}
    assert {p.dest for p in spec.files} >= set(spec.convert_moonshine) | {"tokenizer.bin", "LICENSE"}
    assert "moonshine-base-en" in DEFAULT_ORDER  # `specvoice models pull` fetches the default STT


def test_pull_without_onnx_says_how_to_fix(monkeypatch, tmp_path):
    """The conversion's dependency missing: a PullError naming the fix, before any work."""
    import builtins

    import modelstore as models

    real_import = builtins.__import__

    def no_onnx(name, *args, **kwargs):
        if name == "onnx":
            raise ImportError("No module named 'onnx'")
        return real_import(name, *args, **kwargs)

    spec = models.ModelSpec("m", "stt", (), "test", files=(), convert_moonshine=("a.ort", "b.ort"))
    monkeypatch.setattr(builtins, "__import__", no_onnx)
    with pytest.raises(models.PullError, match="pip install onnx"):
        models._build(spec, tmp_path, [], progress=False)
