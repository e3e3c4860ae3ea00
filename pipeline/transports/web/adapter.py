"""A browser call (web/browser.py) as a Call's source and sink, its events sent to the page.

    on_browser_call = make_browser_handler(config, get_models, on_turn=...)
    bridge = Bridge(config.bridge, on_call, tokens, on_browser_call=on_browser_call, site=...)

The page sees the call's own events as they happen (the ones MQTT publishes, and the
transcript and the agent's sentences), and every finished turn's report entry (its
latency figures). Once the call is over its report is written as every call's is, its
recording beside it, and the page gets the report page's address.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from pipeline.config import Config
from pipeline.transports.web.browser import BrowserCall

if TYPE_CHECKING:
    from pipeline.agent import ModelSet
    from pipeline.call import Call

log = logging.getLogger(__name__)

__all__ = ["make_browser_handler"]

KEEP_CALLS = 64


def make_browser_handler(
    config: Config,
    get_models: Callable[[], Awaitable[ModelSet]],
    *,
    greeting: bool | str = True,
    on_turn: Callable[[str, dict], None] | None = None,
    on_call_end: Callable[[Call], None] | None = None,
    record: bool = True,
):
    """`async def on_browser_call(call: BrowserCall)`: one pipeline Call per page call, on the
    models the phone calls use (`get_models`: the telephony handler's)."""
    from pipeline.call import Call
    from pipeline.transports.telephony.adapter import NoTransferLine

    async def on_browser_call(call: BrowserCall) -> None:
        models = await get_models()
        toolbox = models.new_toolbox(call.call_id, None)
        if toolbox is not None:
            # Nobody to transfer a browser call to: the tool says so and the agent offers a message.
            toolbox = NoTransferLine(toolbox)

        def turn_done(entry: dict) -> None:
            call.publish_turn(entry)
            if on_turn is not None:
                on_turn(call.call_id, entry)

        pipeline_call = Call.from_models(
            config, models, call.source, call.output, call_id=call.call_id, greeting=greeting,
            on_event=call.publish, on_turn=turn_done, toolbox=toolbox,
        )
        on_browser_call.calls.append(pipeline_call)
        del on_browser_call.calls[:-KEEP_CALLS]
        try:
            await pipeline_call.run()
        finally:
            report_path = pipeline_call.report_path
            if report_path is not None and pipeline_call.report is not None:
                if record:
                    call.write_recording(report_path.with_suffix(".wav"), pipeline_call.report.t0)
                call.report_url = f"/calls/{report_path.stem}"
            if on_call_end is not None:
                on_call_end(pipeline_call)

    on_browser_call.calls = []
    return on_browser_call
