"""Twilio Media Streams messages: parsing, validation, serializers, and auth helpers."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json

import pytest
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.transports.telephony import auth
from pipeline.transports.telephony.protocol import (
    Clear,
    Connected,
    Dtmf,
    Mark,
    Media,
    MediaFormat,
    OutboundMark,
    OutboundMedia,
    ProtocolError,
    Start,
    Stop,
    UnknownEvent,
    encode_event,
    parse_message,
    parse_outbound,
    serialize_clear,
    serialize_mark,
    serialize_media,
)

# Messages as Twilio documents them (numbers as strings, streamSid at the top level).
START = {
    "event": "start",
    "sequenceNumber": "1",
    "start": {
        "accountSid": "AC123",
        "streamSid": "MZ456",
        "callSid": "CA789",
        "tracks": ["inbound"],
        "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
        "customParameters": {"From": "+15550100"},
    },
    "streamSid": "MZ456",
}


def media_msg(payload: str = base64.b64encode(b"\xff" * 160).decode(), **media) -> dict:
    return {
        "event": "media",
        "sequenceNumber": "3",
        "media": {"track": "inbound", "chunk": "1", "timestamp": "5", "payload": payload, **media},
        "streamSid": "MZ456",
    }


def test_documented_messages_parse():
    assert parse_message('{"event": "connected", "protocol": "Call", "version": "1.0.0"}') == Connected("Call", "1.0.0")
    start = parse_message(json.dumps(START))
    assert start == Start("MZ456", "CA789", "AC123", {"From": "+15550100"}, MediaFormat(), ("inbound",), 1)
    media = parse_message(json.dumps(media_msg()))
    assert media == Media("MZ456", b"\xff" * 160, "inbound", 1, 5, 3)
    dtmf = parse_message(json.dumps({"event": "dtmf", "streamSid": "MZ456", "sequenceNumber": "5",
                                     "dtmf": {"track": "inbound_track", "digit": "1"}}))
    assert dtmf == Dtmf("MZ456", "1", "inbound_track", 5)
    mark = parse_message(json.dumps({"event": "mark", "sequenceNumber": "4", "streamSid": "MZ456",
                                     "mark": {"name": "my label"}}))
    assert mark == Mark("MZ456", "my label", 4)
    stop = parse_message(json.dumps({"event": "stop", "sequenceNumber": "5", "streamSid": "MZ456",
                                     "stop": {"accountSid": "AC123", "callSid": "CA789"}}))
    assert stop == Stop("MZ456", "CA789", "AC123", 5)
    assert parse_message(json.dumps(media_msg()).encode()) == media  # bytes accepted


@pytest.mark.parametrize(
    "text, kind",
    [
        ("{not json", "json"),
        (b"\xff\xfe", "json"),
        ("[" * 100_000, "json"),  # deep nesting must not escape as RecursionError
        ("[1, 2]", "type"),
        ('"media"', "type"),
        ("{}", "missing"),
        ('{"event": 5}', "field"),
        ('{"event": "media", "streamSid": "MZ"}', "missing"),
        (json.dumps({**media_msg(), "media": {"track": "inbound"}}), "missing"),
        (json.dumps(media_msg(payload="!!!notbase64")), "base64"),
        (json.dumps(media_msg(payload="é")), "base64"),
        (json.dumps(media_msg(payload=base64.b64encode(b"\0" * 20_000).decode())), "oversized"),
        (json.dumps(media_msg(chunk="1e3")), "field"),
        (json.dumps(media_msg(chunk=True)), "field"),
        (json.dumps({**START, "start": {**START["start"], "mediaFormat": {"encoding": "audio/l16", "sampleRate": 16000, "channels": 1}}}), "format"),
        (json.dumps({**START, "start": {**START["start"], "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 2}}}), "format"),
        (json.dumps({**START, "start": {k: v for k, v in START["start"].items() if k != "callSid"}}), "missing"),
        ('{"event": "dtmf", "streamSid": "MZ", "dtmf": {"digit": "x"}}', "field"),
        ('{"event": "mark", "streamSid": "MZ", "mark": {}}', "missing"),
    ],
)
def test_invalid_messages_raise_protocol_error_with_kind(text, kind):
    with pytest.raises(ProtocolError) as info:
        parse_message(text)
    assert info.value.kind == kind
    assert str(info.value)  # a message a log line can use


def test_unknown_event_is_its_own_kind():
    with pytest.raises(UnknownEvent) as info:
        parse_message('{"event": "telepathy", "streamSid": "MZ"}')
    assert info.value.kind == "unknown_event" and info.value.event == "telepathy"


def test_payload_limit_is_configurable():
    text = json.dumps(media_msg(payload=base64.b64encode(b"\0" * 400).decode()))
    assert len(parse_message(text, max_payload_bytes=400).payload) == 400
    with pytest.raises(ProtocolError, match="larger than 399"):
        parse_message(text, max_payload_bytes=399)


def test_outbound_serializers():
    assert json.loads(serialize_media("MZ1", b"\x01\x02")) == {
        "event": "media", "streamSid": "MZ1", "media": {"payload": "AQI="}}
    assert json.loads(serialize_mark("MZ1", "a")) == {"event": "mark", "streamSid": "MZ1", "mark": {"name": "a"}}
    assert json.loads(serialize_clear("MZ1")) == {"event": "clear", "streamSid": "MZ1"}
    assert parse_outbound(serialize_clear("MZ1")) == Clear("MZ1")


# ---------------------------------------------------------------- properties

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20,
)
event_names = st.sampled_from(["connected", "start", "media", "dtmf", "mark", "stop", "clear", "x"])
# Near-valid messages reach deeper into the parser than random JSON does.
near_valid = st.fixed_dictionaries(
    {"event": event_names, "streamSid": st.one_of(st.text(max_size=5), json_values)},
    optional={
        "sequenceNumber": json_values | st.from_regex(r"\d{1,30}", fullmatch=True),
        "start": st.fixed_dictionaries({"streamSid": json_values, "callSid": json_values},
                                       optional={"mediaFormat": json_values, "customParameters": json_values,
                                                 "tracks": json_values, "accountSid": json_values}),
        "media": st.fixed_dictionaries({"payload": json_values | st.text(alphabet="ABCD+/=", max_size=12)},
                                       optional={"chunk": json_values, "timestamp": json_values, "track": json_values}),
        "dtmf": st.fixed_dictionaries({}, optional={"digit": json_values, "track": json_values}),
        "mark": st.fixed_dictionaries({}, optional={"name": json_values}),
        "stop": json_values,
    },
)


@settings(max_examples=examples(300), deadline=None)
@given(st.one_of(st.text(), st.binary(), json_values.map(json.dumps), near_valid.map(json.dumps)))
def test_parser_raises_only_protocol_error(text):
    for parse in (parse_message, parse_outbound):
        try:
            parse(text)
        except ProtocolError:
            pass


short = st.text(max_size=40)
sids = st.text(alphabet="ABCDEFabcdef0123456789", min_size=1, max_size=34)
seq = st.none() | st.integers(0, 2**40)
inbound_events = st.one_of(
    st.builds(Connected, short, short),
    st.builds(Start, sids, sids, short, st.dictionaries(short, short, max_size=4), st.just(MediaFormat()),
              st.lists(st.sampled_from(["inbound", "outbound"]), min_size=1, max_size=2).map(tuple), seq),
    st.builds(Media, sids, st.binary(max_size=1024), short, st.integers(0, 2**40), st.integers(0, 2**40), seq),
    st.builds(Dtmf, sids, st.sampled_from(sorted("0123456789*#")), short, seq),
    st.builds(Mark, sids, short, seq),
    st.builds(Stop, sids, short, short, seq),
)


@given(inbound_events)
def test_inbound_round_trip(event):
    assert parse_message(encode_event(event)) == event


@given(sids, st.binary(max_size=4096), short)
def test_outbound_round_trip(sid, payload, name):
    assert parse_outbound(serialize_media(sid, payload)) == OutboundMedia(sid, payload)
    assert parse_outbound(serialize_mark(sid, name)) == OutboundMark(sid, name)
    assert parse_outbound(serialize_clear(sid)) == Clear(sid)


# ---------------------------------------------------------------- auth helpers

def reference_signature(token: str, url: str, params: dict[str, str] | None = None) -> str:
    """Twilio's documented algorithm, written independently of pipeline.transports.telephony.auth."""
    data = url + "".join(k + params[k] for k in sorted(params or {}))
    return base64.b64encode(hmac.new(token.encode(), data.encode(), hashlib.sha1).digest()).decode()


def test_twilio_signature_matches_documented_example():
    # The example from Twilio's security docs.
    token = "12345"
    url = "https://mycompany.com/myapp.php?foo=1&bar=2"
    params = {"CallSid": "CA1234567890ABCDE", "Caller": "+12349013030", "Digits": "1234",
              "From": "+12349013030", "To": "+18005551212"}
    assert auth.twilio_signature(token, url, params) == "0/KCTR6DLpKmkAf8muzZqo1nDgQ="
    assert auth.twilio_signature(token, url, params) == reference_signature(token, url, params)
    assert auth.validate_twilio_signature(token, [url], "0/KCTR6DLpKmkAf8muzZqo1nDgQ=", params)
    assert not auth.validate_twilio_signature(token, [url], "0/KCTR6DLpKmkAf8muzZqo1nDgQX", params)
    assert not auth.validate_twilio_signature("other", [url], "0/KCTR6DLpKmkAf8muzZqo1nDgQ=", params)
    assert not auth.validate_twilio_signature(token, [url], None, params)


def test_signed_url_candidates_accept_scheme_variants():
    sig = reference_signature("tok", "wss://example.com/media-stream?a=1")
    urls = auth.signed_url_candidates("/media-stream?a=1", "example.com", None)
    assert auth.validate_twilio_signature("tok", urls, sig)
    sig_ws = reference_signature("tok", "ws://example.com/media-stream?a=1")
    assert auth.validate_twilio_signature("tok", urls, sig_ws)
    # public_url wins over the Host header the server sees behind a proxy.
    urls = auth.signed_url_candidates("/media-stream", "127.0.0.1:8765", "wss://pub.example.com/media-stream")
    assert auth.validate_twilio_signature("tok", urls, reference_signature("tok", "wss://pub.example.com/media-stream"))
    assert not auth.validate_twilio_signature("tok", urls, reference_signature("tok", "wss://127.0.0.1:8765/media-stream"))


def test_bearer_and_secret_masking(tmp_path):
    assert auth.validate_bearer("Bearer s3cret", auth.Secret("s3cret"))
    assert auth.validate_bearer("bearer   s3cret ", "s3cret")
    assert not auth.validate_bearer("Bearer s3cre", "s3cret")
    assert not auth.validate_bearer("Basic s3cret", "s3cret")
    assert not auth.validate_bearer(None, "s3cret")
    assert not auth.validate_bearer("Bearer ünïcode", "s3cret")
    tokens = auth.BridgeTokens.of("twilio-secret", "bearer-secret")
    assert "secret" not in repr(tokens) and "secret" not in str(tokens.bearer_token)

    class Cfg:
        twilio_auth_token_file = None
        auth_token_file = str(tmp_path / "bearer.txt")

    (tmp_path / "bearer.txt").write_text("from-file\n")
    loaded = auth.load_tokens(Cfg, {"TWILIO_AUTH_TOKEN": "from-env", "SPECVOICE_BRIDGE_TOKEN": "ignored"})
    assert loaded.twilio_auth_token.reveal() == "from-env"
    assert loaded.bearer_token.reveal() == "from-file"
    Cfg.auth_token_file = str(tmp_path / "missing.txt")
    with pytest.raises(auth.AuthConfigError, match="cannot read"):
        auth.load_tokens(Cfg, {})
    Cfg.auth_token_file = None
    assert not auth.load_tokens(Cfg, {}).configured
