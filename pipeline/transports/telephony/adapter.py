"""A phone call (the bridge's TelephonyCall) as a Call's source and sink.

    on_call = make_call_handler(config)     # loads the shared models once
    bridge = Bridge(config.bridge, on_call, tokens)

In: 20 ms mu-law 8 kHz `media` -> int16 -> float32 -> 16 kHz (one streaming resampler
per call, so no edge clicks between packets) -> AudioFrame stamped with the packet's
capture time (arrival minus its duration).
Out: the call's output (`TelephonyCall.output`, the one paced output over a TwilioWriter):
20 ms frames of 8 kHz mu-law `media` in real time, a `mark` after each sentence (Twilio
echoes it once it has played, which confirms it), `clear` on barge-in.
Keys: a `dtmf` event becomes a KeyPress in the frame stream; the call gathers the keys
into one turn's text (pipeline/stages/listen.py, Keypad).
Transfer: when a tool ended the call ("transfer", "end_call"), the handler tells the
TelephonyCall (`agent_action`) before it returns; the bridge then closes the stream and
answers Twilio's request for what comes next (server.py: a <Dial> for a transfer). With no
number to transfer to (bridge.transfer_to empty), transfer_to_human fails with a sentence
the model acts on (offer to take a message) instead of ending the call on an empty promise.
Caller ID: the `start` message's `From` custom parameter (the /voice TwiML passes Twilio's
`From` as a <Parameter>) goes to the call's tools: bookings and messages record who called.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.config import Config
from pipeline.events import KeyPress
from pipeline.ports import AudioFrame, ToolRunner
from pipeline.transports.telephony.protocol import Dtmf, Media, Start, Stop
from pipeline.transports.telephony.call import TelephonyCall
from voice import mulaw
from voice.audio import PHONE_RATE, STT_RATE, to_float32

if TYPE_CHECKING:  # the call is imported when a handler is made: a bare server starts without the models' code
    from pipeline.agent import ModelSet
    from pipeline.call import Call

log = logging.getLogger(__name__)

__all__ = ["NoTransferLine", "TelephonySource", "caller_id", "make_call_handler"]

KEEP_CALLS = 64  # finished pipeline Calls kept in `on_call.calls` (tests, the in-process demo)


class TelephonySource:
    """Inbound media of a TelephonyCall as 16 kHz AudioFrames, and its DTMF keys as
    KeyPress. Ends when the caller stops. (Mark echoes confirm marks on the call's output,
    in the server.)"""

    def __init__(self, call: TelephonyCall):
        import soxr

        self.call = call
        self.hangup = True  # a phone stream only ends when the caller goes away
        self.stopped = False  # a `stop` message came (versus the connection dropping)
        self.dtmf: list[str] = []
        self._resampler = soxr.ResampleStream(PHONE_RATE, STT_RATE, 1, dtype="float32", quality="HQ")

    @property
    def end_reason(self) -> str | None:
        """Set by the bridge when it ended the call (idle_timeout, protocol_error,
        server_shutdown); None when the caller hung up."""
        return self.call.end_reason

    def __aiter__(self) -> AsyncIterator[AudioFrame | KeyPress]:
        return self._frames()

    async def _frames(self) -> AsyncIterator[AudioFrame | KeyPress]:
        async for event in self.call:
            if isinstance(event, Media):
                payload = event.payload
                if not payload:
                    continue
                arrived = time.monotonic()
                pcm8 = to_float32(mulaw.decode(payload))
                pcm16 = self._resampler.resample_chunk(pcm8)
                if len(pcm16):
                    yield AudioFrame(np.asarray(pcm16, dtype=np.float32), arrived - len(pcm8) / PHONE_RATE)
            elif isinstance(event, Stop):
                self.stopped = True
                return
            elif isinstance(event, Dtmf):
                self.dtmf.append(event.digit)
                log.info("call %s: DTMF %s", self.call.stream_sid, event.digit)
                yield KeyPress(event.digit, time.monotonic())


def _write_recording(call: TelephonyCall, pipeline_call: Call) -> None:
    """Both sides of the call beside its report, when the server records phone calls."""
    recording = call.recording
    if recording is None or pipeline_call.report_path is None or pipeline_call.report is None:
        return
    try:
        recording.write(pipeline_call.report_path.with_suffix(".wav"), pipeline_call.report.t0)
    except OSError:
        log.exception("call %s: cannot write the recording", pipeline_call.call_id)


class NoTransferLine:
    """A call's tools when the bridge has no number to transfer to: a valid
    transfer_to_human comes back failed, with a sentence for the model, and no action."""

    UNAVAILABLE = ("transfer_to_human: nobody can take the call now (no transfer line is set up); "
                   "tell the caller and offer to take a message")

    def __init__(self, toolbox: ToolRunner):
        self.toolbox = toolbox
        self.store, self.call_id = toolbox.store, toolbox.call_id  # the same database, the same call

    def open_slots(self) -> list[str] | None:
        return self.toolbox.open_slots()

    def callers_bookings(self, name: str | None = None) -> list[str]:
        return self.toolbox.callers_bookings(name)

    def run(self, name: str, arguments: str | dict) -> Any:
        outcome = self.toolbox.run(name, arguments)  # bad arguments are still reported as such
        if outcome.action != "transfer":
            return outcome
        return dataclasses.replace(outcome, ok=False, result=None, error=self.UNAVAILABLE, action=None, reason=None)


def caller_id(start: Start) -> str | None:
    """The caller's number from the `start` message: the `From` custom parameter, which the
    /voice TwiML sets from Twilio's webhook (`<Parameter name="From" .../>`). None when the
    stream did not come through that TwiML (a client that sent no parameters)."""
    value = (start.custom_parameters or {}).get("From")
    return (value.strip() or None) if isinstance(value, str) else None


def make_call_handler(
    config: Config,
    models: ModelSet | None = None,
    *,
    report_dir: str | Path | None = None,
    greeting: bool | str = True,
    on_turn: Callable[[str, dict], None] | None = None,
    on_call_end: Callable[[Call], None] | None = None,
    preload: bool = True,
):
    """`async def on_call(call)` for the bridge: one Call per phone call, shared models.

    The models load now (preload=True: `specvoice serve` is ready before the first ring)
    or on the first call. `on_turn(call_id, turn_entry)` sees every finished turn;
    `on_call_end(call)` gets the finished pipeline.call.Call (report, turns).
    """
    from pipeline.agent import AgentModels
    from pipeline.call import Call

    state: dict[str, ModelSet | None] = {"models": models}
    lock: asyncio.Lock | None = None  # created on the loop, below

    if state["models"] is None and preload:
        state["models"] = AgentModels.load(config)

    async def get_models() -> ModelSet:
        nonlocal lock
        if (loaded := state["models"]) is not None:
            return loaded
        if lock is None:
            lock = asyncio.Lock()
        async with lock:
            if (loaded := state["models"]) is None:
                loaded = state["models"] = await asyncio.to_thread(AgentModels.load, config)
        return loaded

    async def on_call(call: TelephonyCall) -> None:
        agent_models = await get_models()
        start = call.start
        call_id = start.call_sid or start.stream_sid
        source, sink = TelephonySource(call), call.output
        toolbox = agent_models.new_toolbox(call_id, caller_id(start))
        if toolbox is not None and not config.bridge.transfer_to:
            toolbox = NoTransferLine(toolbox)
        pipeline_call = Call.from_models(
            config, agent_models, source, sink, call_id=call_id, report_dir=report_dir, greeting=greeting,
            on_turn=(lambda entry: on_turn(call_id, entry)) if on_turn is not None else None, toolbox=toolbox,
        )
        on_call.calls.append(pipeline_call)
        del on_call.calls[:-KEEP_CALLS]  # a long-running server must not keep every call
        try:
            await pipeline_call.run()
            if pipeline_call.ended_by is not None:
                call.agent_action = pipeline_call.ended_by[0]  # the bridge acts on it when the stream ends
        finally:
            _write_recording(call, pipeline_call)
            # (The call's run closed its backend: its KV cache is freed even though the
            # last KEEP_CALLS Calls stay listed.)
            if on_call_end is not None:
                on_call_end(pipeline_call)

    on_call.calls = []  # the last KEEP_CALLS pipeline Calls served, for tests and the in-process demo
    on_call.get_models = get_models
    return on_call
