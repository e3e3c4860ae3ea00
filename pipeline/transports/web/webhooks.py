"""Twilio's HTTP webhooks: the voice webhook (`/voice`) and the stream-ended action.

Twilio's default for the voice webhook is a form POST (`application/x-www-form-urlencoded`:
CallSid, From, To, ...), signed as base64(HMAC-SHA1(auth token, full URL + every POST
parameter's name and value, sorted by name)); a GET webhook carries them in the query
string, which the URL then covers. Both are answered with the same TwiML.
https://www.twilio.com/docs/usage/security#validating-requests
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from pipeline.transports.telephony.twiml import after_stream_twiml, connect_twiml, public_url
from pipeline.transports.web.access import valid_host

if TYPE_CHECKING:
    from pipeline.transports.web.server import Bridge

log = logging.getLogger("pipeline.transports.telephony.server")

__all__ = ["ACTION_PATH", "VOICE_PATH", "stream_ended", "voice"]

VOICE_PATH = "/voice"
ACTION_PATH = "/stream-ended"
STREAM_PATH = "/media-stream"
MAX_FORM_BYTES = 64 * 1024  # Twilio's voice webhook sends about 1 KB of parameters
TWIML = "text/xml; charset=utf-8"


def path_with_query(request: Request) -> str:
    """The request target as sent (not percent-decoded): what Twilio's signature covers."""
    raw = request.scope.get("raw_path") or request.url.path.encode()
    query = request.scope.get("query_string") or b""
    return raw.decode("latin-1") + ("?" + query.decode("latin-1") if query else "")


async def form_params(request: Request) -> dict[str, list[str]] | None:
    """A form POST's parameters (each name with all its values); None when the body is too
    large or not a form. A body-less POST has none."""
    if request.method != "POST":
        return {}
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            return None
    if not body:
        return {}
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/x-www-form-urlencoded":
        return None
    params: dict[str, list[str]] = {}
    for key, value in parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True):
        params.setdefault(key, []).append(value)
    return params


async def _checked(request: Request, bridge: "Bridge") -> tuple[dict[str, list[str]], int]:
    """The form's parameters and 0 when the request may be answered, else the status to
    refuse with: 401/403 (credentials) before 415 (a body that is not a form), so a caller
    without credentials learns nothing about what the endpoint accepts."""
    params = await form_params(request)
    status = bridge.access.twilio(request.headers, path_with_query(request), params or {})
    if status:
        return {}, status
    return (params, 0) if params is not None else ({}, 415)


def _not_a_form() -> Response:
    return PlainTextResponse("expected a form POST (application/x-www-form-urlencoded)\n", 415)


def _refused(what: str, status: int, peer: str) -> Response:
    log.warning("%s refused (%d) from %s", what, status, peer)
    return PlainTextResponse("unauthorized\n" if status == 401 else "forbidden\n", status)


async def voice(request: Request) -> Response:
    bridge: Bridge = request.app.state.bridge
    peer = _peer(request)
    if bridge.draining:
        bridge.metrics.refused("draining")
        log.warning("%s refused (503: draining) from %s", VOICE_PATH, peer)
        return PlainTextResponse("shutting down, try another server\n", 503, headers={"Retry-After": "5"})
    params, status = await _checked(request, bridge)
    if status:
        return _refused("voice webhook", status, peer) if status != 415 else _not_a_form()
    host = request.headers.get("host", "")
    if not bridge.config.public_url and not valid_host(host):
        return PlainTextResponse("bad Host header\n", 400)
    # The call's parameters: the form's (POST) over the query string's (GET).
    values = {k: v for k, v in request.query_params.items()}
    values.update({k: v[-1] for k, v in params.items()})
    stream = public_url(host, STREAM_PATH, True, bridge.config.public_url)
    action = public_url(host, ACTION_PATH, False, bridge.config.public_url) if bridge.transfer_to else None
    return Response(connect_twiml(stream, values, action), 200, media_type=TWIML, headers=_no_store())


async def stream_ended(request: Request) -> Response:
    bridge: Bridge = request.app.state.bridge
    params, status = await _checked(request, bridge)
    if status:
        return _refused("stream-ended request", status, _peer(request)) if status != 415 else _not_a_form()
    call_sid = (params.get("CallSid") or [request.query_params.get("CallSid", "")])[-1]
    action = bridge.agent_action(call_sid)
    if action == "transfer":
        if bridge.transfer_to:
            log.info("call %s: transferring to the configured number", call_sid[:64])
        else:
            log.warning("call %s asked for a transfer but bridge.transfer_to is empty: hanging up", call_sid[:64])
    return Response(after_stream_twiml(action, bridge.transfer_to), 200, media_type=TWIML, headers=_no_store())


def _no_store() -> dict[str, str]:
    return {"Cache-Control": "no-store"}


def _peer(request: Request) -> str:
    client = request.client
    return f"{client.host}:{client.port}" if client else "?"
