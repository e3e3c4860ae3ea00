"""Coverage-guided fuzzing (atheris / libFuzzer) of the Twilio Media Streams parser.

    bash fuzz/run.sh 600            # ten minutes; installs atheris if missing
    python fuzz/fuzz_protocol.py -max_total_time=60 fuzz/corpus

The property: whatever bytes arrive on the socket, `parse_message` returns one of the
inbound event types or raises `ProtocolError` (UnknownEvent included) -- never any other
exception, never a hang (libFuzzer's -timeout turns a slow input into a crash). A parsed
event also survives `encode_event` -> `parse_message` unchanged, and the outbound
parser obeys the same rule.

Each input is used three ways: as raw bytes (what a hostile peer sends), as text, and
as a structured Twilio message built from the bytes (so the fuzzer gets deep into the
per-event field checks, not only the JSON decoder).
"""

from __future__ import annotations

import base64
import json
import sys

import atheris

with atheris.instrument_imports():
    from pipeline.transports.telephony.protocol import (
        Connected,
        Dtmf,
        Mark,
        Media,
        ProtocolError,
        Start,
        Stop,
        encode_event,
        parse_message,
        parse_outbound,
    )

EVENTS = (Connected, Start, Media, Dtmf, Mark, Stop)
NAMES = ["connected", "start", "media", "dtmf", "mark", "stop", "clear", "", "Start", "media\x00"]
MAX_PAYLOAD = 1024


def _value(fdp: atheris.FuzzedDataProvider, depth: int = 0):
    """A JSON value: mostly the types Twilio sends, sometimes the wrong ones."""
    kind = fdp.ConsumeIntInRange(0, 9 if depth < 3 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return fdp.ConsumeBool()
    if kind == 2:
        return fdp.ConsumeInt(8)
    if kind == 3:
        return fdp.ConsumeRegularFloat()
    if kind in (4, 5):
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 40))
    if kind == 6:
        return str(fdp.ConsumeIntInRange(0, 2**64))
    if kind == 7:
        return base64.b64encode(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 400))).decode()
    if kind == 8:
        return [_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 3))]
    return {fdp.ConsumeUnicodeNoSurrogates(8): _value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 3))}


def _message(fdp: atheris.FuzzedDataProvider) -> dict:
    event = NAMES[fdp.ConsumeIntInRange(0, len(NAMES) - 1)]
    msg: dict = {"event": event, "streamSid": _value(fdp) if fdp.ConsumeBool() else "MZ1"}
    if fdp.ConsumeBool():
        msg["sequenceNumber"] = _value(fdp)
    body: dict = {}
    if event == "start":
        body = {"streamSid": _value(fdp), "callSid": _value(fdp), "accountSid": _value(fdp),
                "customParameters": _value(fdp), "tracks": _value(fdp),
                "mediaFormat": {"encoding": "audio/x-mulaw" if fdp.ConsumeBool() else _value(fdp),
                                "sampleRate": 8000 if fdp.ConsumeBool() else _value(fdp),
                                "channels": 1 if fdp.ConsumeBool() else _value(fdp)}}
    elif event == "media":
        body = {"payload": _value(fdp), "chunk": _value(fdp), "timestamp": _value(fdp), "track": _value(fdp)}
    elif event == "dtmf":
        body = {"digit": _value(fdp), "track": _value(fdp)}
    elif event == "mark":
        body = {"name": _value(fdp)}
    elif event == "stop":
        body = {"callSid": _value(fdp), "accountSid": _value(fdp)}
    for key in list(body):
        if fdp.ConsumeIntInRange(0, 7) == 0:
            del body[key]  # a missing field
    msg[event or "x"] = body if fdp.ConsumeIntInRange(0, 7) else _value(fdp)
    return msg


def _check(data: bytes | str) -> None:
    try:
        event = parse_message(data, MAX_PAYLOAD)
    except ProtocolError:
        return
    if not isinstance(event, EVENTS):
        raise AssertionError(f"parse_message returned {type(event).__name__}")
    again = parse_message(encode_event(event), MAX_PAYLOAD)
    if not isinstance(event, Connected) and again != event:
        raise AssertionError(f"round trip changed the event: {event!r} -> {again!r}")


def TestOneInput(data: bytes) -> None:
    _check(data)  # raw bytes off the wire
    try:
        parse_outbound(data)
    except ProtocolError:
        pass
    fdp = atheris.FuzzedDataProvider(data)
    if fdp.remaining_bytes() > 2:
        try:
            text = json.dumps(_message(fdp))
        except (ValueError, OverflowError):
            return
        _check(text)


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
