"""Who may open a call on the bridge: Twilio request signatures and bearer tokens.

Twilio signs every request with `X-Twilio-Signature` =
base64(HMAC-SHA1(auth_token, URL + concatenation of the sorted POST parameters' key+value)).
For the WebSocket upgrade and GET webhooks there are no POST parameters: the URL alone,
query string included, is signed. The URL is the *public* one Twilio used, which is not
what a server behind a proxy or tunnel sees, hence `bridge.public_url`.
https://www.twilio.com/docs/usage/security#validating-requests

Other clients (the simulated caller, load tests, a SIP gateway) send
`Authorization: Bearer <token>`. Every comparison is constant-time, and secrets are
wrapped so that a stray log line or traceback shows `Secret('***')`, never the token.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping
from urllib.parse import urlsplit, urlunsplit

if TYPE_CHECKING:
    from pipeline.config import BridgeConfig

TWILIO_TOKEN_ENV = "TWILIO_AUTH_TOKEN"
BEARER_TOKEN_ENV = "SPECVOICE_BRIDGE_TOKEN"


class AuthConfigError(ValueError):
    """A token file that cannot be read, or no token where one is required."""


class Secret:
    """A string that never shows itself in repr/str (logs, tracebacks, pydantic dumps)."""

    __slots__ = ("_value",)

    def __init__(self, value: str):
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and hmac.compare_digest(self._value.encode(), other._value.encode())

    def __hash__(self) -> int:
        return hash(Secret)


@dataclass(frozen=True)
class BridgeTokens:
    twilio_auth_token: Secret | None = None
    bearer_token: Secret | None = None

    @property
    def configured(self) -> bool:
        return self.twilio_auth_token is not None or self.bearer_token is not None

    @classmethod
    def of(cls, twilio_auth_token: str | None = None, bearer_token: str | None = None) -> "BridgeTokens":
        return cls(
            Secret(twilio_auth_token) if twilio_auth_token else None,
            Secret(bearer_token) if bearer_token else None,
        )


def _read_token_file(path: str, what: str) -> str:
    try:
        value = Path(path).expanduser().read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise AuthConfigError(f"cannot read {what} file {path}: {exc.__class__.__name__}") from None
    if not value:
        raise AuthConfigError(f"{what} file {path} is empty")
    return value


def load_tokens(config: BridgeConfig, environ: Mapping[str, str] | None = None) -> BridgeTokens:
    """Tokens for a `BridgeConfig`: a file named in the config wins over the environment
    (it was asked for explicitly, so an unreadable one is an error, not a silent fallback)."""
    env = os.environ if environ is None else environ
    twilio = bearer = None
    if config.twilio_auth_token_file:
        twilio = _read_token_file(config.twilio_auth_token_file, "bridge.twilio_auth_token_file")
    else:
        twilio = (env.get(TWILIO_TOKEN_ENV) or "").strip() or None
    if config.auth_token_file:
        bearer = _read_token_file(config.auth_token_file, "bridge.auth_token_file")
    else:
        bearer = (env.get(BEARER_TOKEN_ENV) or "").strip() or None
    return BridgeTokens.of(twilio, bearer)


# ---------------------------------------------------------------- Twilio signatures

def _signed_data(url: str, params: Mapping[str, str | Iterable[str]] | None) -> bytes:
    data = url
    if params:
        pairs: list[tuple[str, str]] = []
        for key, value in params.items():
            values = [value] if isinstance(value, str) else list(value)
            pairs.extend((key, v) for v in values)
        # Twilio sorts by key; repeated keys keep their values sorted too.
        for key, value in sorted(pairs):
            data += key + value
    return data.encode("utf-8")


def twilio_signature(token: str, url: str, params: Mapping[str, str | Iterable[str]] | None = None) -> str:
    digest = hmac.new(token.encode("utf-8"), _signed_data(url, params), hashlib.sha1).digest()
    return base64.b64encode(digest).decode("ascii")


def validate_twilio_signature(
    token: str | Secret,
    urls: str | Iterable[str],
    signature: str | None,
    params: Mapping[str, str | Iterable[str]] | None = None,
) -> bool:
    """True when `signature` matches one of the candidate `urls` (see `signed_url_candidates`)."""
    if not signature:
        return False
    secret = token.reveal() if isinstance(token, Secret) else token
    if not secret:
        return False
    candidates = [urls] if isinstance(urls, str) else list(urls)
    given = signature.strip().encode("ascii", "replace")
    ok = False
    for url in candidates:
        # Check every candidate (no early exit), so timing says nothing about which matched.
        ok |= hmac.compare_digest(twilio_signature(secret, url, params).encode("ascii"), given)
    return ok


_DEFAULT_PORTS = {"wss": 443, "https": 443, "ws": 80, "http": 80}


def public_base(public_url: str) -> str:
    """`bridge.public_url` as a base: scheme://host[:port][/prefix], without the stream path."""
    base = public_url.strip().rstrip("/")
    for suffix in ("/media-stream", "/voice"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    return base


def signed_url_candidates(request_path: str, host: str | None, public_url: str | None) -> list[str]:
    """The URLs Twilio may have signed for a request to `request_path` (path + query).

    From `public_url` when set, else from the Host header. All scheme variants (wss/ws,
    https/http) are accepted because TLS usually ends at a proxy and the server cannot
    tell which one the public URL used; the HMAC still binds host, path and query. The
    default port is tried with and without, as Twilio's own helpers do.
    """
    if public_url:
        parts = urlsplit(public_base(public_url))
        netloc, prefix = parts.netloc, parts.path
    elif host:
        netloc, prefix = host, ""
    else:
        return []
    path_part = urlsplit(request_path)
    path = prefix + path_part.path
    out: list[str] = []
    hostname, _, port = netloc.rpartition(":") if ":" in netloc and not netloc.endswith("]") else (netloc, "", "")
    # Every scheme: the stream is signed as wss://..., the voice webhook as https://...
    for sch in _DEFAULT_PORTS:
        netlocs = {netloc}
        default = _DEFAULT_PORTS.get(sch)
        if port and default and port == str(default):
            netlocs.add(hostname)
        elif not port and default:
            netlocs.add(f"{netloc}:{default}")
        for nl in sorted(netlocs):
            out.append(urlunsplit((sch, nl, path, path_part.query, "")))
    return sorted(set(out))


# ---------------------------------------------------------------- bearer tokens

def bearer_from_header(value: str | None) -> str | None:
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def validate_bearer(header_value: str | None, token: str | Secret | None) -> bool:
    given = bearer_from_header(header_value)
    if given is None or token is None:
        return False
    expected = token.reveal() if isinstance(token, Secret) else token
    if not expected:
        return False
    return hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))
