"""Small asyncio helpers the call's parts share."""

from __future__ import annotations

import asyncio

__all__ = ["settle"]


async def settle(*tasks: asyncio.Task | asyncio.Future | None) -> None:
    """Await tasks that were cancelled or finished, swallowing their outcome."""
    live = [t for t in tasks if t is not None]
    if live:
        await asyncio.gather(*live, return_exceptions=True)
