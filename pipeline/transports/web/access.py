"""Who may use what on the server.

Twilio paths (the voice webhook, the stream-ended action, the media stream): a valid
`X-Twilio-Signature` (over the public URL, plus the POST parameters of a form POST) or
`Authorization: Bearer <SPECVOICE_BRIDGE_TOKEN>`.

People's paths (the call page and its WebSocket, /calls, /metrics): open while the server
listens on loopback only and has no public URL (a laptop's own browser); otherwise the
bridge's bearer token, as `Authorization: Bearer` (Prometheus, scripts) or as the password
of HTTP basic auth (a browser asks for it once, and sends it again on the page's WebSocket).
The token itself is never put in a page, a URL or a log line.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import re
from typing import Iterable, Mapping

from pipeline.transports.telephony.auth import (
    BridgeTokens,
    signed_url_candidates,
    validate_bearer,
    validate_twilio_signature,
)

__all__ = ["Access", "is_loopback"]

BASIC_REALM = 'Basic realm="specvoice", charset="UTF-8"'
_HOST_RE = re.compile(r"^[A-Za-z0-9.\-]+(:\d{1,5})?$|^\[[0-9A-Fa-f:.]+\](:\d{1,5})?$")


def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def valid_host(host: str) -> bool:
    """A Host header we may put into TwiML (a name or address and a port, nothing else)."""
    return bool(_HOST_RE.match(host))


class Access:
    def __init__(self, tokens: BridgeTokens, public_url: str | None, listen_host: str, open_all: bool):
        self.tokens = tokens
        self.public_url = public_url
        self.open_all = open_all  # --insecure / require_auth = false with no token: nothing is checked
        # A laptop's own browser on a loopback-only server needs no token; anything reachable
        # from elsewhere (another interface, or a proxy in front: public_url) does.
        self.pages_open = open_all or (is_loopback(listen_host) and not public_url)

    @property
    def pages_reachable(self) -> bool:
        """False when the pages need a token and none is configured: they would refuse everyone."""
        return self.pages_open or self.tokens.bearer_token is not None

    def twilio(self, headers: Mapping[str, str], path_with_query: str,
               params: Mapping[str, str | Iterable[str]] | None = None) -> int:
        """0 when allowed, else the HTTP status to refuse with (401 no credentials, 403 wrong)."""
        if self.open_all:
            return 0
        signature = headers.get("x-twilio-signature")
        authorization = headers.get("authorization")
        if signature and self.tokens.twilio_auth_token is not None:
            urls = signed_url_candidates(path_with_query, headers.get("host"), self.public_url)
            if validate_twilio_signature(self.tokens.twilio_auth_token, urls, signature, params):
                return 0
        if authorization and self.tokens.bearer_token is not None:
            if validate_bearer(authorization, self.tokens.bearer_token):
                return 0
        return 403 if (signature or authorization) else 401

    def person(self, headers: Mapping[str, str]) -> int:
        """0 when a person's path may be used, else 401 (ask for credentials) or 403."""
        if self.pages_open:
            return 0
        authorization = headers.get("authorization")
        if not authorization:
            return 401
        token = self.tokens.bearer_token
        if token is None:
            return 403
        if validate_bearer(authorization, token):
            return 0
        password = _basic_password(authorization)
        if password is not None and hmac.compare_digest(password.encode(), token.reveal().encode()):
            return 0
        return 401  # wrong basic credentials: let the browser ask again


def _basic_password(header: str) -> str | None:
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    _, sep, password = decoded.partition(":")
    return password if sep else None
