"""`specvoice serve`: the agent on one HTTP port: phone calls (Twilio), a call page, metrics."""

from __future__ import annotations

import argparse
import sys

HELP = "serve the agent: Twilio phone calls, a browser call page, /calls and /metrics, on one port"
DESCRIPTION = """\
Serve the agent on one port (an ASGI app on uvicorn):

  /               the call page: press Call, allow the microphone, talk to the agent
  /calls          recent calls, each linking to its report page (with the recording)
  /metrics        Prometheus metrics (calls, refusals, turns, latency histograms, LLM speed)
  /voice          Twilio's voice webhook (POST, Twilio's default, or GET): TwiML that
                  connects the call to the stream
  /media-stream   Twilio Media Streams WebSocket (one phone call per connection)
  /stream-ended   what Twilio does once the stream ends (transfer or hang up)
  /health         JSON: ok, calls active, max calls (503 while draining)

Talk to it from this machine's browser:

  specvoice serve --insecure --open          # opens http://127.0.0.1:8765/

Twilio's paths take a Twilio signature (TWILIO_AUTH_TOKEN or bridge.twilio_auth_token_file)
or `Authorization: Bearer` (SPECVOICE_BRIDGE_TOKEN or bridge.auth_token_file). The page,
/calls and /metrics are open while the server listens on loopback only; on any other
address (or behind bridge.public_url) they need SPECVOICE_BRIDGE_TOKEN, as a bearer token or
as the password of HTTP basic auth (the browser asks). Behind a tunnel or proxy set
bridge.public_url (the URL Twilio sees), since that is the URL Twilio signs.

  TWILIO_AUTH_TOKEN=... SPECVOICE_BRIDGE_TOKEN=... specvoice serve --host 0.0.0.0 --port 8765

SIGTERM drains: no new calls (503), calls in progress go on for up to bridge.drain_s.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="interface to listen on (default: bridge.host)")
    parser.add_argument("--port", type=int, help="port (default: bridge.port; 0 picks a free one)")
    parser.add_argument("--config", help="config name or TOML file (default: configs/default.toml)")
    parser.add_argument("--public-url", help="the public URL of the server, as Twilio sees it (default: bridge.public_url)")
    parser.add_argument("--insecure", action="store_true",
                        help="accept calls without authentication (local development only)")
    parser.add_argument("--open", action="store_true", help="open the call page in a web browser once ready")


def page_url(host: str, port: int) -> str:
    """Where a person on this machine finds the page (a wildcard address is reached on loopback)."""
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}/"


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal

    from demo.commands import load_config_or_exit
    from pipeline.transports.telephony.auth import AuthConfigError, load_tokens
    from pipeline.transports.web.server import check_auth_configured

    config = load_config_or_exit(args.config, "specvoice serve")
    updates = {k: v for k, v in (("host", args.host), ("port", args.port), ("public_url", args.public_url))
               if v is not None}
    bridge_config = config.bridge.model_copy(update=updates)
    try:
        tokens = load_tokens(bridge_config)
        check_auth_configured(bridge_config, tokens, args.insecure)
    except AuthConfigError as exc:
        print(f"specvoice serve: {exc}", file=sys.stderr)
        return 2
    if args.insecure and not tokens.configured:
        logging.getLogger("demo.serve").warning("--insecure: anyone who can reach the port can place calls")

    from demo.report_html import render_html
    from modelstore import ModelNotFoundError
    from pipeline.transports.web.agent_server import agent_server

    try:
        # Loads the models now: a missing one is a one-line error, and the first call rings a ready server.
        bridge = agent_server(config, tokens, bridge_config=bridge_config, insecure=args.insecure,
                              render_report=render_html)
    except (ModelNotFoundError, OSError, RuntimeError, ValueError, ImportError) as exc:
        print(f"specvoice serve: cannot load the models: {exc}", file=sys.stderr)
        return 2
    if not bridge.access.pages_reachable:
        print("specvoice serve: the call page, /calls and /metrics need SPECVOICE_BRIDGE_TOKEN on this address "
              "(none is set: they refuse everyone; Twilio calls are served)", file=sys.stderr)

    async def main() -> None:
        port = await bridge.start()
        url = page_url(bridge_config.host, port)
        print(f"specvoice bridge listening on {bridge_config.host}:{port} "
              f"(/media-stream, /voice, /health; max {bridge_config.max_calls} calls)", flush=True)
        print(f"talk to the agent: {url}   recent calls: {url}calls   metrics: {url}metrics", flush=True)
        if args.open:
            import webbrowser

            webbrowser.open(url)
        # SIGTERM (what systemd, Docker and Kubernetes send) drains: no new calls (503, and
        # /health 503 so a load balancer moves on), calls in progress go on for up to
        # bridge.drain_s, then the rest are closed (1001, going away) with their reports, and
        # the process exits 0. A second SIGTERM, or Ctrl-C, closes them at once.
        serving = asyncio.current_task()
        loop = asyncio.get_running_loop()
        drain: asyncio.Task | None = None

        def on_sigterm() -> None:
            nonlocal drain
            if drain is not None or bridge_config.drain_s <= 0:
                serving.cancel()
                return
            print(f"specvoice serve: SIGTERM, draining: no new calls, {bridge.active_calls} in progress "
                  f"(up to {bridge_config.drain_s:.0f} s; SIGTERM again to stop now)", file=sys.stderr, flush=True)

            async def drain_then_stop() -> None:
                left = await bridge.drain(bridge_config.drain_s)
                if left:
                    print(f"specvoice serve: drain time over, closing {left} call(s)", file=sys.stderr, flush=True)
                serving.cancel()

            drain = loop.create_task(drain_then_stop())

        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
        try:
            await bridge.serve_forever()
        except asyncio.CancelledError:
            print("specvoice serve: calls closed, stopped", file=sys.stderr, flush=True)

    try:
        asyncio.run(main())
    except OSError as exc:
        print(f"specvoice serve: cannot listen on {bridge_config.host}:{bridge_config.port}: {exc}", file=sys.stderr)
        return 1
    return 0
