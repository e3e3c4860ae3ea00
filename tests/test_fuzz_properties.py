"""Property-based fuzzing (hypothesis) of what untrusted input reaches, beyond the
properties already in test_twilio_protocol, test_voice_audio, test_sentences and
test_report_html:

- protocol: valid messages mutated at any one place (deleted key, any JSON value), and
  what a successful parse may keep (bounded strings, payload, parameters);
- the bridge's outbound framer: any chunking of agent audio and marks gives 20 ms frames,
  in order, nothing lost;
- mu-law and the telephony input path: any bytes, any (odd) lengths;
- the sentence splitter reused across turns, and on any Unicode;
- the report renderer on structurally broken reports; report file names and writes;
- the caller's name, the greeting check and the fact guard on any transcript text.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import re

import numpy as np
import pytest
from conftest import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from demo import report_html
from pipeline.transports.telephony.protocol import (FRAME_BYTES, MAX_CUSTOM_PARAMETERS, MAX_STRING, Connected, Dtmf,
                                                   Mark, Media, ProtocolError, Start, Stop, encode_event, parse_message)
from pipeline.report import SCHEMA, load_report, report_filename, write_report
from pipeline.sentences import SentenceSplitter, split_sentences
from voice import mulaw

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                      st.text(max_size=30), st.just("A" * 2000), st.just("9" * 25), st.just("-1"))
json_any = st.recursive(json_leaf, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                                                                max_size=4),
                        max_leaves=12)

VALID = [
    encode_event(Connected()),
    encode_event(Start("MZ1", "CA1", "AC1", {"From": "+15550100", "x": "y"})),
    encode_event(Media("MZ1", b"\xff" * 160, chunk=3, timestamp=60, sequence_number=4)),
    encode_event(Dtmf("MZ1", "7")),
    encode_event(Mark("MZ1", "s1")),
    encode_event(Stop("MZ1", "CA1", "AC1")),
]


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _mutate(obj, path, value, delete):
    if not path:
        return value
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    if delete and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return obj


def _bounded(event) -> None:
    for name, value in vars(event).items():
        if isinstance(value, str):
            assert len(value) <= MAX_STRING, name
    if isinstance(event, Start):
        assert len(event.custom_parameters) <= MAX_CUSTOM_PARAMETERS
        assert all(len(k) <= MAX_STRING and len(v) <= MAX_STRING for k, v in event.custom_parameters.items())
        assert (event.media_format.encoding, event.media_format.sample_rate, event.media_format.channels) == \
            ("audio/x-mulaw", 8000, 1)
    if isinstance(event, Media):
        assert isinstance(event.payload, bytes) and len(event.payload) <= 16 * 1024


@settings(max_examples=examples(600), deadline=None)
@given(st.sampled_from(VALID), st.data(), json_any, st.booleans())
def test_valid_messages_mutated_anywhere_parse_or_raise_protocol_error(text, data, value, delete):
    message = json.loads(text)
    path = data.draw(st.sampled_from(list(_paths(message))))
    mutated = _mutate(copy.deepcopy(message), path, value, delete)
    try:
        event = parse_message(json.dumps(mutated))
    except ProtocolError as exc:
        assert exc.kind in {"json", "type", "missing", "field", "base64", "oversized", "format", "unknown_event"}
        assert len(str(exc)) < 400  # error messages (logged) stay short whatever came in
        return
    _bounded(event)
    assert parse_message(encode_event(event)) == event or isinstance(event, Connected)


@settings(max_examples=examples(200), deadline=None)
@given(st.binary(max_size=3000), st.integers(160, 4096))
def test_payload_limit_is_exact(payload, limit):
    text = encode_event(Media("MZ1", payload))
    if len(payload) <= limit:
        assert parse_message(text, limit).payload == payload
    else:
        with pytest.raises(ProtocolError) as info:
            parse_message(text, limit)
        assert info.value.kind == "oversized"


# ---------------------------------------------------------------- the outbound framer


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.one_of(st.binary(min_size=0, max_size=700), st.text(alphabet="abc", min_size=1, max_size=3)),
                max_size=25))
def test_outbound_framer_any_chunking_gives_whole_frames_in_order(items):
    """The paced output (a phone call's, 8 kHz): audio chunks of any size and marks ->
    160-sample frames (only the last before a mark or the end may be short), samples and
    marks in order. Sent far ahead of real time, so nothing waits on the clock."""
    from pipeline.playout import Playout
    from pipeline.transports.telephony.call import TwilioWriter
    from voice import mulaw
    from voice.tts import AudioChunk

    class Wire:
        """What a TwilioWriter sends: media payloads and mark names, in order (a call
        with no recording, as a TelephonyCall is by default)."""

        recording = None

        def __init__(self):
            self.out: list = []

        async def send_media_now(self, payload: bytes) -> None:
            self.out.append(payload)

        async def send_mark_now(self, name: str) -> None:
            self.out.append(name)

        async def send_clear_now(self) -> None:
            self.out.append(None)

    async def run():
        wire = Wire()
        output = Playout(TwilioWriter(wire), ahead_s=1e6)
        for item in items:
            if isinstance(item, bytes):
                output.play(AudioChunk(mulaw.decode(item), 8000))
            else:
                output.mark(item)
        assert await output.drain(timeout=60)
        await output.aclose()
        return wire.out

    out = asyncio.run(run())
    # mu-law has two zeros (0x7f, 0xff); the output writes the positive one.
    expected_audio = b"".join(i for i in items if isinstance(i, bytes)).replace(b"\x7f", b"\xff")
    assert b"".join(o for o in out if isinstance(o, bytes)) == expected_audio
    assert [o for o in out if isinstance(o, str)] == [i for i in items if isinstance(i, str)]
    for a, b in zip(out, out[1:] + [None]):
        if isinstance(a, bytes):
            assert 0 < len(a) <= FRAME_BYTES
            if len(a) < FRAME_BYTES:
                assert b is None or isinstance(b, str)  # a short frame only before a mark or the end


async def _noop_send(text: str) -> None:
    return None


# ---------------------------------------------------------------- mu-law and the telephony input path


@given(st.binary(max_size=2001))
def test_mulaw_decode_any_bytes(data):
    pcm = mulaw.decode(data)
    assert pcm.dtype == np.int16 and len(pcm) == len(data)
    assert np.array_equal(mulaw.decode(mulaw.encode(pcm)), pcm)  # decoded values are exact code points


@given(st.lists(st.floats(-4.0, 4.0, allow_nan=False), max_size=500))
def test_mulaw_encode_floats_clips_not_wraps(values):
    x = np.array(values, dtype=np.float32)
    back = mulaw.decode(mulaw.encode(x)).astype(np.float64) / 32768.0
    assert back.shape == x.shape
    # Loud input clips at full scale with the right sign; it never wraps around.
    loud = np.abs(x) >= 1.0
    assert np.all(np.sign(back[loud]) == np.sign(x[loud]))
    assert np.all(np.abs(back[loud]) > 0.9)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=999), max_size=30))
def test_telephony_source_any_payload_lengths(payloads):
    """Odd, empty and uneven media payloads: 16 kHz float frames, finite, about twice as
    many samples as bytes in (the resampler's latency aside)."""
    from pipeline.transports.telephony.adapter import TelephonySource

    class Call:
        stream_sid = "MZ1"

        def __aiter__(self):
            async def gen():
                for p in payloads:
                    yield Media("MZ1", p)
                yield Stop("MZ1")
            return gen()

    async def run():
        src = TelephonySource(Call())
        return [f async for f in src], src

    frames, src = asyncio.run(run())
    assert src.stopped
    n = sum(len(f.pcm) for f in frames)
    total = sum(len(p) for p in payloads)
    assert n <= 2 * total
    assert n >= 2 * total - 2000  # the resampler holds back a little until more comes
    for f in frames:
        assert f.pcm.dtype == np.float32 and np.all(np.isfinite(f.pcm)) and np.max(np.abs(f.pcm), initial=0) <= 1.5


# ---------------------------------------------------------------- sentences


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.text(max_size=50), min_size=1, max_size=4), st.booleans())
def test_splitter_reused_across_turns_equals_fresh_ones(turn_texts, first_clause):
    kw = dict(first_clause=first_clause, first_clause_min_words=2)
    reused = SentenceSplitter(**kw)
    for text in turn_texts:
        got = []
        for i in range(0, len(text), 7):
            got += reused.feed(text[i:i + 7])
        got += reused.flush()
        assert got == split_sentences(text, **kw)
        assert reused.pending == ""


@settings(max_examples=examples(200), deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=()), max_size=300))
def test_splitter_any_unicode_never_raises_and_loses_nothing(text):
    sentences = split_sentences(text)
    assert " ".join(" ".join(sentences).split()) == " ".join(text.split())


def test_splitter_long_unpunctuated_stream_is_not_quadratic():
    import time

    s = SentenceSplitter()
    t = time.perf_counter()
    for _ in range(20000):
        s.feed("word ")
    out = s.flush()
    assert time.perf_counter() - t < 5.0
    assert len(out) == 1 and out[0].count("word") == 20000


# ---------------------------------------------------------------- the report renderer and files


def _make_good_report() -> dict:
    from pipeline.report import CallReport
    from pipeline.timeline import EVENTS, TurnTimeline

    report = CallReport(call_id="CA-fuzz", models={"llm_target": "t", "stt": "s"}, t0=0.0)
    for i, (user, agent) in enumerate([("What are your hours?", "Nine to five. See you."),
                                       ("And Saturday?", "Nine to one.")]):
        tl = TurnTimeline(index=i)
        for k, name in enumerate(EVENTS):
            tl.mark(name, 10.0 * i + 0.1 * k)
        report.add_turn(tl, user, agent, agent[:8], interrupted=bool(i),
                        llm={"new_tokens": 12, "passes": 5, "drafted": 8, "accepted": 6, "total_s": 0.4})
    report.finish("caller_hangup")
    return report.to_dict()


GOOD_REPORT = json.dumps(_make_good_report())


def _good_report() -> dict:
    return json.loads(GOOD_REPORT)


@settings(max_examples=examples(250), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), json_any, st.booleans())
def test_renderer_survives_structurally_broken_reports(data, value, delete):
    report = _good_report()
    paths = [p for p in _paths(report) if p]
    path = data.draw(st.sampled_from(paths))
    broken = _mutate(report, path, value, delete)
    try:
        page = report_html.render_html(broken)
        summary = report_html.text_summary(broken)
    except report_html.ReportError:
        return
    assert page.startswith("<!DOCTYPE html>") or "<html" in page[:200]
    assert "<script" not in page.lower()
    assert isinstance(summary, str) and "\x1b" not in summary


@settings(max_examples=examples(300), deadline=None)
@given(st.text(max_size=300), st.text(max_size=300))
def test_report_filenames_safe_and_distinct(a, b):
    fa, fb = report_filename(a), report_filename(b)
    for name in (fa, fb):
        # The documented contract: [A-Za-z0-9_.-] only, no leading dot, no "..".
        assert re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*\.json", name), name
        assert ".." not in name and len(name) <= 120
    if a != b:
        assert fa != fb


def test_report_filenames_for_ids_hypothesis_found_and_digest_shaped_ids():
    """'0.' once became '0..json'; an id shaped like a digested name must not meet one."""
    assert report_filename("0.") != "0..json" and ".." not in report_filename("0.")
    assert report_filename("") != report_filename("0.")
    assert report_filename("call-42") == "call-42.json"  # a safe id keeps its name
    altered = report_filename("a/b")  # "a_b-<digest>.json"
    assert report_filename(altered[: -len(".json")]) != altered
    for call_id in (".", "..", "...x", "x.", "x..", "." * 200, "x." * 100):
        name = report_filename(call_id)
        assert ".." not in name and not name.startswith("."), (call_id, name)


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=80), st.integers(2, 4))
def test_same_call_id_never_overwrites_another_calls_report(tmp_path_factory, call_id, n):
    """A call id reused by several calls: each report gets its own file, all readable."""
    folder = tmp_path_factory.mktemp("reports")
    paths = []
    for i in range(n):
        data = {"schema": SCHEMA, "call_id": call_id, "started_at": f"2026-01-01T00:00:0{i}Z", "turns": [],
                "summary": {}, "end_reason": "completed", "n": i}
        paths.append(write_report(data, folder))
    assert len(set(paths)) == n
    assert sorted(load_report(p)["n"] for p in paths) == list(range(n))
    assert all(p.parent == folder.resolve() for p in paths)
    # The same call rewriting its report replaces it in place.
    again = {"schema": SCHEMA, "call_id": call_id, "started_at": "2026-01-01T00:00:00Z", "turns": [], "summary": {},
             "end_reason": "error", "n": 0}
    assert write_report(again, folder) == paths[0] and load_report(paths[0])["end_reason"] == "error"
    assert len(list(folder.iterdir())) == n


# ---------------------------------------------------------------- the caller's words and the guard on any text


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.text(alphabet=st.characters(codec="utf-8"), max_size=120), max_size=4), st.text(max_size=120))
def test_reading_the_callers_words_and_judging_any_sentence_never_raises(lines, sentence):
    """A transcript is anything an STT wrote: the caller's name, the greeting check and the
    fact guard (with the caller's bookings) take any text and answer, never raise."""
    from pipeline.receptionist.caller import caller_name, greets_only, only_greets
    from pipeline.receptionist.guard import Support

    name = caller_name(lines)
    assert name is None or 1 <= len(name.split()) <= 2
    messages = [{"role": "user", "content": x} for x in lines]
    for line in lines:
        assert isinstance(only_greets(line), bool) and isinstance(greets_only(line, messages), bool)
    support = Support.of(caller=lines[-1] if lines else "", earlier=lines[:-1], booked=["Tuesday 10:30 a.m. with Dr. Patel"])
    verdict = _dental_guard().check(sentence, support)
    assert verdict.ok or verdict.why  # a sentence held back says why


@functools.lru_cache(maxsize=1)
def _dental_guard():
    from pipeline.receptionist.business import default_business
    from pipeline.receptionist.guard import FactGuard

    return FactGuard(default_business())
