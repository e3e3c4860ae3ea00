"""The whole server `specvoice serve` runs, assembled in one place (the CLI and the tests
build it the same way): the telephony handler and the browser handler on one set of
models, every finished turn observed by /metrics, and the report pages.

    bridge = agent_server(config, tokens, render_report=render_html)
    port = await bridge.start()
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from pipeline.agent import ModelSet
from pipeline.config import BridgeConfig, Config
from pipeline.transports.telephony.auth import BridgeTokens
from pipeline.transports.web.server import Bridge, Site

__all__ = ["agent_server"]


def agent_server(
    config: Config,
    tokens: BridgeTokens,
    *,
    bridge_config: BridgeConfig | None = None,
    models: ModelSet | None = None,
    insecure: bool = False,
    render_report: Callable[[dict, str | None], str] | None = None,
    greeting: bool | str = True,
    preload: bool = True,
    **bridge_kw: Any,
) -> Bridge:
    """A Bridge serving phone and browser calls with `models` (loaded from `config` now when
    None and `preload`). `render_report(report, recording_url)` draws report pages
    (demo.report_html.render_html; pipeline/ does not import demo/)."""
    from pipeline.transports.telephony.adapter import make_call_handler
    from pipeline.transports.web.adapter import make_browser_handler

    server: list[Bridge] = []  # the handlers observe turns into the server's metrics, made below

    def observer(transport: str) -> Callable[[str, dict], None]:
        def on_turn(call_id: str, entry: dict) -> None:
            if server:
                server[0].metrics.observe_turn(entry, transport)
        return on_turn

    report_dir = Path(config.report.dir)
    on_call = make_call_handler(config, models, report_dir=report_dir, greeting=greeting,
                                on_turn=observer("twilio"), preload=preload)
    on_browser_call = make_browser_handler(config, on_call.get_models, greeting=greeting,
                                           on_turn=observer("browser"), record=config.report.record != "none")
    bridge = Bridge(bridge_config if bridge_config is not None else config.bridge, on_call, tokens,
                    insecure=insecure, on_browser_call=on_browser_call,
                    site=Site(report_dir, render_report=render_report),
                    record_phone_calls=config.report.record == "all", **bridge_kw)
    server.append(bridge)
    return bridge
