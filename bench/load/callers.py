"""Who calls and what they say: each simulated caller gives a distinct name (so a report that
holds another caller's name shows two calls mixed), and its lines are spoken by Piper."""

from __future__ import annotations

import asyncio
import re

NAMES = ["Alice", "Robert", "Maria", "David", "Sarah", "James", "Emma", "Thomas", "Laura", "Peter", "Anna",
         "Daniel", "Julia", "Henry", "Olivia", "George"]
SECOND = ["How much does a cleaning cost?", "What are your opening hours on Saturday?",
          "Where are you located?", "Which dentists work there?"]


def script_for(index: int, turns: int) -> list[str]:
    name = NAMES[index % len(NAMES)]
    lines = [f"Hi, my name is {name}. Are you open on Saturday?"]
    for t in range(1, turns):
        lines.append(SECOND[(index + t) % len(SECOND)] if t % 2 else "Can you tell me my name, please?")
    return lines


def spoken_scripts(tts, callers: int, turns: int) -> list:
    """The lines of callers 0 .. callers-1 (at most one per name), as audio spoken by `tts`."""
    from demo.caller import prepare_lines

    return [prepare_lines([{"text": x} for x in script_for(i, turns)], tts) for i in range(min(callers, len(NAMES)))]


def words(text: str) -> set[str]:
    return {w.lower() for w in re.findall(r"[A-Za-z]+", text or "")}


class BridgeClosed(Exception):
    pass


async def _first_of(main: asyncio.Future, watch: asyncio.Future) -> None:
    """Until `main` or `watch` ends; then `watch` is cancelled, and `main` too if still running."""
    try:
        await asyncio.wait({main, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (watch, main):
            if not task.done():
                task.cancel()
        await asyncio.gather(watch, return_exceptions=True)


def bridge_caller_class():
    """SimulatedCaller (imported only when callers are dialled) as BridgeCaller."""
    from demo.caller import SimulatedCaller

    class BridgeCaller(SimulatedCaller):
        """A SimulatedCaller that notices when the bridge closes the call under it (a stopped
        process): the base caller's sender dies with the connection and its script would then
        wait for a line that is never sent. Here the script ends and `run()` raises
        BridgeClosed, with the close code and reason."""

        connected = False
        closed_by_bridge: tuple[int | None, str | None] | None = None

        async def _script(self) -> None:
            self.connected = True
            script = asyncio.ensure_future(super()._script())
            await _first_of(script, asyncio.ensure_future(self._ws.wait_closed()))
            if script.cancelled():
                self.closed_by_bridge = (self._ws.close_code, self._ws.close_reason)
                raise BridgeClosed(self.closed_by_bridge)
            script.result()

    return BridgeCaller


async def wait_or_cancel(tasks: list[asyncio.Task], timeout_s: float) -> set[asyncio.Task]:
    """Wait up to `timeout_s` for the callers' tasks; cancel (and reap) the rest; the done ones."""
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return done
