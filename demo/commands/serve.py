"""`specvoice serve`: the telephony bridge with the agent behind it."""

from __future__ import annotations

import argparse
import sys

HELP = "serve phone calls: Twilio Media Streams WebSocket bridge"
DESCRIPTION = """\
Serve phone calls over the Twilio Media Streams WebSocket protocol. One port serves:
  /media-stream   the WebSocket stream (one call per connection)
  /voice          Twilio's voice webhook (configure it with HTTP GET): TwiML that
                  connects the call to the stream
  /health         JSON: ok, calls active, max calls

Callers authenticate at the handshake with a Twilio signature (TWILIO_AUTH_TOKEN or
bridge.twilio_auth_token_file) or `Authorization: Bearer` (SPECVOICE_BRIDGE_TOKEN or
bridge.auth_token_file). Behind a tunnel or proxy set bridge.public_url (the wss:// URL
Twilio sees), since that is the URL Twilio signs.

  TWILIO_AUTH_TOKEN=... specvoice serve --host 0.0.0.0 --port 8765
  specvoice serve --insecure          # local development only: no authentication
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="interface to listen on (default: bridge.host)")
    parser.add_argument("--port", type=int, help="port (default: bridge.port; 0 picks a free one)")
    parser.add_argument("--config", help="config name or TOML file (default: configs/default.toml)")
    parser.add_argument("--public-url", help="the public wss:// URL of the bridge (default: bridge.public_url)")
    parser.add_argument("--insecure", action="store_true",
                        help="accept calls without authentication (local development only)")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import signal
    import logging

    from pipeline.transports.telephony.auth import AuthConfigError, load_tokens
    from pipeline.transports.telephony.server import Bridge, check_auth_configured
    from demo.commands import load_config_or_exit

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

    try:
        from pipeline.transports.telephony.adapter import make_call_handler
    except ImportError as exc:
        print(
            "specvoice serve: the telephony pipeline is not available "
            f"(pipeline.transports.telephony.adapter.make_call_handler: {exc})", file=sys.stderr,
        )
        return 2

    from pipeline.models import ModelNotFoundError

    try:
        on_call = make_call_handler(config)  # loads the models now: a missing one is a one-line error
    except (ModelNotFoundError, OSError, RuntimeError, ValueError, ImportError) as exc:
        print(f"specvoice serve: cannot load the models: {exc}", file=sys.stderr)
        return 2
    bridge = Bridge(bridge_config, on_call, tokens, insecure=args.insecure)

    async def main() -> None:
        port = await bridge.start()
        print(f"specvoice bridge listening on {bridge_config.host}:{port} "
              f"(/media-stream, /voice, /health; max {bridge_config.max_calls} calls)", flush=True)
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
