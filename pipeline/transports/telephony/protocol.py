"""The Twilio Media Streams WebSocket protocol: typed messages, strict parsing, serializers.

Inbound (Twilio -> us): `connected`, `start`, `media`, `dtmf`, `mark`, `stop`.
Outbound (us -> Twilio): `media`, `mark`, `clear`.
https://www.twilio.com/docs/voice/media-streams/websocket-messages

Everything arriving on the socket is untrusted: `parse_message` raises only
`ProtocolError` (with a `kind` the server maps to a close code), never anything else,
whatever the input. Unknown events raise `UnknownEvent`, a ProtocolError subclass the
server logs and ignores (Twilio may add events; a new one must not drop the call).

The encoders for inbound messages (`encode_event`) exist for the simulated caller and
the tests: they write exactly what Twilio writes, so parse(encode(e)) == e.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from typing import Any, Union

MULAW_ENCODING = "audio/x-mulaw"
SAMPLE_RATE = 8000
CHANNELS = 1
FRAME_BYTES = 160  # 20 ms of 8 kHz mu-law, what Twilio sends per media message
DEFAULT_MAX_PAYLOAD_BYTES = 16 * 1024
DTMF_DIGITS = frozenset("0123456789*#ABCD")
# Bound every string we keep, so a hostile peer cannot make us hold megabytes per field.
MAX_STRING = 1024
MAX_CUSTOM_PARAMETERS = 64


class ProtocolError(ValueError):
    """A message that does not follow the protocol. `kind` says which way:
    json, type, missing, field, base64, oversized, format, unknown_event."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class UnknownEvent(ProtocolError):
    """A well-formed message with an event we do not know: log it and carry on."""

    def __init__(self, event: str):
        super().__init__("unknown_event", f"unknown event {event[:64]!r}")
        self.event = event


@dataclass(frozen=True)
class MediaFormat:
    encoding: str = MULAW_ENCODING
    sample_rate: int = SAMPLE_RATE
    channels: int = CHANNELS


@dataclass(frozen=True)
class Connected:
    protocol: str = "Call"
    version: str = "1.0.0"


@dataclass(frozen=True)
class Start:
    stream_sid: str
    call_sid: str
    account_sid: str
    custom_parameters: dict[str, str] = field(default_factory=dict)
    media_format: MediaFormat = field(default_factory=MediaFormat)
    tracks: tuple[str, ...] = ("inbound",)
    sequence_number: int | None = None


@dataclass(frozen=True)
class Media:
    stream_sid: str
    payload: bytes  # decoded mu-law bytes
    track: str = "inbound"
    chunk: int = 0
    timestamp: int = 0  # milliseconds since the stream started
    sequence_number: int | None = None


@dataclass(frozen=True)
class Dtmf:
    stream_sid: str
    digit: str
    track: str = "inbound_track"
    sequence_number: int | None = None


@dataclass(frozen=True)
class Mark:
    stream_sid: str
    name: str
    sequence_number: int | None = None


@dataclass(frozen=True)
class Stop:
    stream_sid: str
    call_sid: str = ""
    account_sid: str = ""
    sequence_number: int | None = None


InboundEvent = Union[Connected, Start, Media, Dtmf, Mark, Stop]


# Outbound messages, parsed back by the simulated caller and the tests.
@dataclass(frozen=True)
class OutboundMedia:
    stream_sid: str
    payload: bytes


@dataclass(frozen=True)
class OutboundMark:
    stream_sid: str
    name: str


@dataclass(frozen=True)
class Clear:
    stream_sid: str


OutboundMessage = Union[OutboundMedia, OutboundMark, Clear]


# ---------------------------------------------------------------- field helpers

def _obj(container: dict, key: str, where: str) -> dict:
    value = container.get(key)
    if value is None:
        raise ProtocolError("missing", f"{where}: missing object {key!r}")
    if not isinstance(value, dict):
        raise ProtocolError("field", f"{where}: {key!r} must be an object")
    return value


def _str(container: dict, key: str, where: str, *, required: bool = True, default: str = "") -> str:
    value = container.get(key)
    if value is None:
        if required:
            raise ProtocolError("missing", f"{where}: missing field {key!r}")
        return default
    if not isinstance(value, str):
        raise ProtocolError("field", f"{where}: {key!r} must be a string")
    if len(value) > MAX_STRING:
        raise ProtocolError("oversized", f"{where}: {key!r} longer than {MAX_STRING} characters")
    return value


def _int(container: dict, key: str, where: str, *, required: bool = True) -> int | None:
    """Twilio sends numbers as decimal strings ("chunk": "12"); accept ints too."""
    value = container.get(key)
    if value is None:
        if required:
            raise ProtocolError("missing", f"{where}: missing field {key!r}")
        return None
    if isinstance(value, bool):
        raise ProtocolError("field", f"{where}: {key!r} must be an integer")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and 0 < len(value) <= 20 and value.isascii() and value.isdigit():
        number = int(value)
    else:
        raise ProtocolError("field", f"{where}: {key!r} must be an integer")
    if not 0 <= number < 2**63:
        raise ProtocolError("field", f"{where}: {key!r} out of range")
    return number


def _decode_payload(text: Any, max_bytes: int) -> bytes:
    if not isinstance(text, str):
        raise ProtocolError("field", "media: 'payload' must be a base64 string")
    # Refuse before decoding: base64 is 4 characters per 3 bytes.
    if len(text) > 4 * ((max_bytes + 2) // 3):
        raise ProtocolError("oversized", f"media: payload larger than {max_bytes} bytes")
    try:
        data = base64.b64decode(text.encode("ascii"), validate=True)
    except (UnicodeEncodeError, binascii.Error, ValueError):
        raise ProtocolError("base64", "media: payload is not valid base64") from None
    if len(data) > max_bytes:
        raise ProtocolError("oversized", f"media: payload larger than {max_bytes} bytes")
    return data


def _load_object(text: str | bytes) -> dict:
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("json", "message is not valid UTF-8") from None
    try:
        message = json.loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError; deep nesting recurses
        raise ProtocolError("json", "message is not valid JSON") from None
    if not isinstance(message, dict):
        raise ProtocolError("type", "message must be a JSON object")
    return message


# ---------------------------------------------------------------- inbound parsing

def parse_message(text: str | bytes, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> InboundEvent:
    """Parse one inbound Twilio message. Raises ProtocolError (UnknownEvent for new events)."""
    message = _load_object(text)
    event = message.get("event")
    if event is None:
        raise ProtocolError("missing", "message has no 'event'")
    if not isinstance(event, str):
        raise ProtocolError("field", "'event' must be a string")
    seq = _int(message, "sequenceNumber", event, required=False)

    if event == "connected":
        return Connected(
            protocol=_str(message, "protocol", "connected", required=False, default="Call"),
            version=_str(message, "version", "connected", required=False, default=""),
        )
    if event == "start":
        body = _obj(message, "start", "start")
        fmt = _obj(body, "mediaFormat", "start")
        encoding = _str(fmt, "encoding", "start.mediaFormat")
        rate = _int(fmt, "sampleRate", "start.mediaFormat")
        channels = _int(fmt, "channels", "start.mediaFormat")
        if (encoding, rate, channels) != (MULAW_ENCODING, SAMPLE_RATE, CHANNELS):
            raise ProtocolError(
                "format",
                f"unsupported media format {encoding[:40]!r} {rate} Hz {channels} ch "
                f"(expected {MULAW_ENCODING} {SAMPLE_RATE} Hz mono)",
            )
        params = body.get("customParameters") or {}
        if not isinstance(params, dict) or len(params) > MAX_CUSTOM_PARAMETERS:
            raise ProtocolError("field", "start: 'customParameters' must be a small object")
        custom = {}
        for key, value in params.items():
            if not isinstance(value, str) or len(key) > MAX_STRING or len(value) > MAX_STRING:
                raise ProtocolError("field", "start: customParameters values must be short strings")
            custom[key] = value
        tracks = body.get("tracks", ["inbound"])
        if not isinstance(tracks, list) or len(tracks) > 4 or not all(isinstance(t, str) and len(t) <= 64 for t in tracks):
            raise ProtocolError("field", "start: 'tracks' must be a list of track names")
        stream_sid = _str(body, "streamSid", "start", required=False) or _str(message, "streamSid", "start")
        return Start(
            stream_sid=stream_sid,
            call_sid=_str(body, "callSid", "start"),
            account_sid=_str(body, "accountSid", "start", required=False),
            custom_parameters=custom,
            media_format=MediaFormat(encoding, rate, channels),
            tracks=tuple(tracks),
            sequence_number=seq,
        )
    if event == "media":
        body = _obj(message, "media", "media")
        if "payload" not in body:
            raise ProtocolError("missing", "media: missing field 'payload'")
        return Media(
            stream_sid=_str(message, "streamSid", "media"),
            payload=_decode_payload(body["payload"], max_payload_bytes),
            track=_str(body, "track", "media", required=False, default="inbound"),
            chunk=_int(body, "chunk", "media", required=False) or 0,
            timestamp=_int(body, "timestamp", "media", required=False) or 0,
            sequence_number=seq,
        )
    if event == "dtmf":
        body = _obj(message, "dtmf", "dtmf")
        digit = _str(body, "digit", "dtmf")
        if digit not in DTMF_DIGITS:
            raise ProtocolError("field", f"dtmf: invalid digit {digit[:8]!r}")
        return Dtmf(
            stream_sid=_str(message, "streamSid", "dtmf"),
            digit=digit,
            track=_str(body, "track", "dtmf", required=False, default="inbound_track"),
            sequence_number=seq,
        )
    if event == "mark":
        body = _obj(message, "mark", "mark")
        return Mark(stream_sid=_str(message, "streamSid", "mark"), name=_str(body, "name", "mark"), sequence_number=seq)
    if event == "stop":
        body = message.get("stop")
        if body is not None and not isinstance(body, dict):
            raise ProtocolError("field", "stop: 'stop' must be an object")
        body = body or {}
        return Stop(
            stream_sid=_str(message, "streamSid", "stop"),
            call_sid=_str(body, "callSid", "stop", required=False),
            account_sid=_str(body, "accountSid", "stop", required=False),
            sequence_number=seq,
        )
    raise UnknownEvent(event)


def encode_event(event: InboundEvent) -> str:
    """An inbound message as Twilio writes it (for simulated callers and tests)."""
    message: dict[str, Any]
    if isinstance(event, Connected):
        return json.dumps({"event": "connected", "protocol": event.protocol, "version": event.version})
    if isinstance(event, Start):
        message = {
            "event": "start",
            "start": {
                "streamSid": event.stream_sid,
                "callSid": event.call_sid,
                "accountSid": event.account_sid,
                "tracks": list(event.tracks),
                "customParameters": dict(event.custom_parameters),
                "mediaFormat": {
                    "encoding": event.media_format.encoding,
                    "sampleRate": event.media_format.sample_rate,
                    "channels": event.media_format.channels,
                },
            },
            "streamSid": event.stream_sid,
        }
    elif isinstance(event, Media):
        message = {
            "event": "media",
            "media": {
                "track": event.track,
                "chunk": str(event.chunk),
                "timestamp": str(event.timestamp),
                "payload": base64.b64encode(event.payload).decode("ascii"),
            },
            "streamSid": event.stream_sid,
        }
    elif isinstance(event, Dtmf):
        message = {"event": "dtmf", "streamSid": event.stream_sid, "dtmf": {"track": event.track, "digit": event.digit}}
    elif isinstance(event, Mark):
        message = {"event": "mark", "streamSid": event.stream_sid, "mark": {"name": event.name}}
    elif isinstance(event, Stop):
        message = {
            "event": "stop",
            "streamSid": event.stream_sid,
            "stop": {"accountSid": event.account_sid, "callSid": event.call_sid},
        }
    else:
        raise TypeError(f"not an inbound event: {event!r}")
    if event.sequence_number is not None:
        message["sequenceNumber"] = str(event.sequence_number)
    return json.dumps(message)


# ---------------------------------------------------------------- outbound

def serialize_media(stream_sid: str, payload: bytes) -> str:
    return json.dumps(
        {"event": "media", "streamSid": stream_sid, "media": {"payload": base64.b64encode(payload).decode("ascii")}}
    )


def serialize_mark(stream_sid: str, name: str) -> str:
    return json.dumps({"event": "mark", "streamSid": stream_sid, "mark": {"name": name}})


def serialize_clear(stream_sid: str) -> str:
    return json.dumps({"event": "clear", "streamSid": stream_sid})


def parse_outbound(text: str | bytes, max_payload_bytes: int = 1 << 20) -> OutboundMessage:
    """Parse a message the bridge sends (what Twilio receives). Raises ProtocolError."""
    message = _load_object(text)
    event = message.get("event")
    if not isinstance(event, str):
        raise ProtocolError("missing", "message has no string 'event'")
    stream_sid = _str(message, "streamSid", event)
    if event == "media":
        body = _obj(message, "media", "media")
        if "payload" not in body:
            raise ProtocolError("missing", "media: missing field 'payload'")
        return OutboundMedia(stream_sid, _decode_payload(body["payload"], max_payload_bytes))
    if event == "mark":
        return OutboundMark(stream_sid, _str(_obj(message, "mark", "mark"), "name", "mark"))
    if event == "clear":
        return Clear(stream_sid)
    raise UnknownEvent(event)
