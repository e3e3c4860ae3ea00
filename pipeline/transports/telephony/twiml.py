"""TwiML: what the bridge answers Twilio's voice webhook and its stream-ended action with.

    connect_twiml(stream_url, params, action_url)   <Connect><Stream> (the call's audio to us)
    after_stream_twiml(action, transfer_to)          <Dial> for a transfer, else <Hangup/>
    public_url(host, path, websocket, public_url)    the URL Twilio uses for a path of ours

Only the wire format: the HTTP endpoints that serve it (and check Twilio's signature) are
pipeline/transports/web/webhooks.py.
"""

from __future__ import annotations

from xml.sax.saxutils import escape, quoteattr

from pipeline.transports.telephony.auth import public_base

__all__ = ["NO_TRANSFER_LINE", "after_stream_twiml", "connect_twiml", "public_url"]

# Said when a call asks for a transfer the bridge cannot make (no bridge.transfer_to).
NO_TRANSFER_LINE = "Sorry, nobody can take your call right now. Please call again later. Goodbye."
# Webhook parameters passed on to the stream as <Parameter>s: the call's id and who called.
PASSED_PARAMETERS = ("CallSid", "From", "To")
_XML = '<?xml version="1.0" encoding="UTF-8"?>'


def public_url(host: str, path: str, websocket: bool, configured: str | None) -> str:
    """`path` on the public address (bridge.public_url, else the request's host), with the
    scheme Twilio uses for it: wss/ws for the stream, https/http for webhooks."""
    if not configured:
        return f"{'wss' if websocket else 'https'}://{host}{path}"
    base = public_base(configured)
    if websocket:
        base = base.replace("https://", "wss://", 1).replace("http://", "ws://", 1)
    else:
        base = base.replace("wss://", "https://", 1).replace("ws://", "http://", 1)
    return base + path


def connect_twiml(stream_url: str, params: dict[str, str] | None = None, action_url: str | None = None) -> str:
    """<Connect><Stream> TwiML; the caller's number and call id travel as custom parameters.
    With an action URL (a transfer number is set), Twilio asks it (GET) when the stream ends."""
    parameters = ""
    for key in PASSED_PARAMETERS:
        value = (params or {}).get(key)
        if value:
            parameters += f"<Parameter name={quoteattr(key)} value={quoteattr(value[:256])}/>"
    stream = f"<Stream url={quoteattr(stream_url)}>{parameters}</Stream>" if parameters else \
        f"<Stream url={quoteattr(stream_url)}/>"
    connect = f"<Connect action={quoteattr(action_url)} method=\"GET\">" if action_url else "<Connect>"
    return f"{_XML}<Response>{connect}{stream}</Connect></Response>"


def after_stream_twiml(action: str | None, transfer_to: str) -> str:
    """What the call does once its stream ended: <Dial> the transfer number for a call whose
    agent asked for a transfer, an apology when there is no number, else hang up."""
    if action == "transfer" and transfer_to:
        verbs = f"<Dial>{escape(transfer_to)}</Dial>"
    elif action == "transfer":
        verbs = f"<Say>{escape(NO_TRANSFER_LINE)}</Say><Hangup/>"
    else:
        verbs = "<Hangup/>"
    return f"{_XML}<Response>{verbs}</Response>"
