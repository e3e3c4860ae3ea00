"""Steps of a test call that many tests take, over tests/callfakes.py's RawCaller."""

from __future__ import annotations

from callfakes import RawCaller, report_of


async def answered_then_hung_up(c: RawCaller, reply_timeout: float = 10.0) -> int | None:
    """The call goes on: the caller asks, the agent answers; then the caller hangs up
    (`stop`). Returns the stream's close code."""
    await c.say()
    assert await c.wait_reply(reply_timeout), "no reply"
    await c.stop()
    return await c.wait_closed()


async def one_answered_call(port: int, cfg) -> tuple[RawCaller, dict]:
    """A call of one question, answered, then hung up: the caller and the call's report."""
    c = await RawCaller(port).open()
    await answered_then_hung_up(c)
    return c, await report_of(cfg, c.call_sid)
