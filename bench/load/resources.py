"""What the benchmark process holds while calls run: RSS, open file descriptors and threads
sampled on a clock (`Sampler`), live Python objects and malloc's bytes (`heap_stats`), and the
soak's slopes over them (steady memory = an RSS slope near zero)."""

from __future__ import annotations

import asyncio
import gc
import time


class Sampler:
    """RSS (MB), open file descriptors and threads of this process, every `period` s."""

    def __init__(self, period: float):
        import psutil

        self.proc = psutil.Process()
        self.period = period
        self.samples: list[tuple[float, float, int, int]] = []  # (t, rss MB, fds, threads)
        self.peak_mb = 0.0
        self._task: asyncio.Task | None = None

    def sample(self) -> tuple[float, float, int, int]:
        rss = self.proc.memory_info().rss / 2 ** 20
        self.peak_mb = max(self.peak_mb, rss)
        s = (time.monotonic(), rss, self.proc.num_fds(), self.proc.num_threads())
        self.samples.append(s)
        return s

    async def _loop(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.period)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.sample()


def heap_stats() -> dict[str, float]:
    """Where this process's memory is, to tell a leak from allocator behaviour when RSS
    grows: live Python objects and blocks, and what glibc malloc holds in use (torch's
    CPU tensors included) against what it has taken from the system. Live figures flat
    while RSS climbs means fragmentation or arenas kept, not lost objects."""
    import ctypes
    import ctypes.util
    import sys

    out: dict[str, float] = {"python_blocks": sys.getallocatedblocks(), "gc_objects": len(gc.get_objects())}

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        m = libc.mallinfo2()
        out["malloc_in_use_mb"] = (m.uordblks + m.hblkhd) / 2 ** 20
        out["malloc_held_mb"] = (m.arena + m.hblkhd) / 2 ** 20
    except (OSError, AttributeError):  # not glibc (or older than 2.33): Python figures only
        pass
    return out


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (t seconds, y) in y per minute."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return None
    return 60.0 * sum((t - mt) * (y - my) for t, y in points) / var


def soak_resources(samples: list[tuple[float, float, int, int]], heap: list[tuple[float, dict[str, float]]],
                   warm_t: float | None) -> dict:
    """The soak's resource figures from the samples and heap stats taken after `warm_t` (the
    end of the first round: caches, pools and allocator arenas warm), times from the first."""
    after = [s for s in samples if warm_t is not None and s[0] >= warm_t]
    t_base = after[0][0] if after else 0.0
    first, last = (after[0], after[-1]) if after else (None, None)
    heap_after = [(t - t_base, h) for t, h in heap if warm_t is not None and t >= warm_t]
    return {
        "rss_slope_mb_per_min": slope_per_min([(t - t_base, rss) for t, rss, _, _ in after]),
        # Allocator warm-up shows as early steps; a leak keeps climbing in the second half too.
        "rss_slope_second_half_mb_per_min": slope_per_min(
            [(t - t_base, rss) for t, rss, _, _ in after if t - t_base >= (after[-1][0] - t_base) / 2] if after else []),
        "fds_slope_per_min": slope_per_min([(t - t_base, fds) for t, _, fds, _ in after]),
        "threads_slope_per_min": slope_per_min([(t - t_base, th) for t, _, _, th in after]),
        "rss_mb_first_last": [round(first[1], 1), round(last[1], 1)] if first else None,
        "fds_first_last_max": [first[2], last[2], max(s[2] for s in after)] if first else None,
        "threads_first_last_max": [first[3], last[3], max(s[3] for s in after)] if first else None,
        # Per round, after gc: slopes of live Python objects and of malloc's in-use and held bytes.
        "heap_slopes_per_min": {key: slope_per_min([(t, h[key]) for t, h in heap_after if key in h])
                                for key in (heap_after[0][1] if heap_after else {})},
        "heap_first_last": {key: [heap_after[0][1][key], heap_after[-1][1][key]] for key in heap_after[0][1]}
                           if heap_after else None,
        "samples": [[round(t - t_base, 1), round(rss, 1), fds, th] for t, rss, fds, th in after],
    }
