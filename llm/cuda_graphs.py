"""Fixed-width steps over a static KV cache, captured as CUDA graphs on a GPU.

On CUDA a small model's decode step is bound by kernel launches (a 24-layer model
launches several hundred kernels per token), not by arithmetic. Capturing the step once
and replaying it costs one launch. Capture needs fixed shapes and fixed addresses:

- the KV cache is preallocated to its full capacity and never reallocated
  (`new_cache(..., static=True)`); rollback is by position, stale entries are masked;
- every step runs the same number of rows W (the verify width R = max_gamma + 1 for
  the target; 1 and R for a draft model), padding unused rows with token 0 at the
  following positions (their K/V land beyond the valid length and are overwritten
  later, so the capacity covers the context plus R);
- inputs are static tensors: the tokens (W,), and `start` as a device tensor, so the
  position is data, not a Python int baked into the graph.

On CPU the same fixed-width step runs eagerly (`graphs=False`): the tests exercise
exactly the code the GPU captures.

    cache = static_cache(model, capacity, widths=(9,), graphs=True)
    logits = forward(model, cache, tokens, start)   # routed through the fixed-width step
"""

from __future__ import annotations

import time

import torch

from llm.model import (
    KVCache,
    Segment,
    Transformer,
    forward,
    forward_fixed,
    forward_many,
    new_cache,
)


class FixedStep:
    """One fixed-width forward of `model` over `cache`, eager or a captured CUDA graph."""

    def __init__(self, model: Transformer, cache: KVCache, width: int, graph: bool):
        if graph and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a model on a CUDA device, not {model.device}")
        self.model, self.cache, self.width, self.use_graph = model, cache, width, graph
        self.tokens = torch.zeros(width, dtype=torch.long, device=model.device)
        self.start = torch.zeros(1, dtype=torch.long, device=model.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        self.replays = 0

    def _capture(self) -> None:
        # Warm up on a side stream (allocator, cuBLAS workspaces), then capture. The
        # warm-up runs write the K/V of the current (already filled) inputs: the same
        # values the replay writes right after.
        side = torch.cuda.Stream(self.model.device)
        main = torch.cuda.current_stream(self.model.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for _ in range(2):
                forward_fixed(self.model, self.cache, self.tokens, self.start)
        main.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a call served from a worker thread may capture while another thread works.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.out = forward_fixed(self.model, self.cache, self.tokens, self.start)
        self.graph = graph

    def run(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Logits (len(tokens), vocab) of `tokens` at positions [start, start + len(tokens))."""
        t = tokens.shape[0]
        if t > self.width:
            raise ValueError(f"{t} tokens do not fit a step of width {self.width}")
        if start + self.width > self.cache.capacity:
            raise ValueError(
                f"a {self.width}-row step at position {start} needs {start + self.width} cache slots "
                f"but the static cache holds {self.cache.capacity}: the sequence exceeds the context limit"
            )
        self.tokens[:t].copy_(tokens)
        if t < self.width:
            self.tokens[t:].zero_()  # padding: any token; its rows are never read
        self.start.fill_(start)
        if not self.use_graph:
            return forward_fixed(self.model, self.cache, self.tokens, self.start)[:t]
        if self.graph is None:
            self._capture()
        self.graph.replay()
        self.replays += 1
        # The graph overwrites `out` on the next replay: hand out a copy.
        return self.out[:t].clone()


class FixedSteps:
    """The fixed-width steps bound to one static cache; a forward of t rows takes the
    narrowest width >= t."""

    def __init__(self, model: Transformer, cache: KVCache, widths: tuple[int, ...], graphs: bool):
        if not widths or min(widths) < 1:
            raise ValueError(f"widths must be positive, got {widths}")
        self.runners = {w: FixedStep(model, cache, w, graphs) for w in sorted(set(widths))}
        self.max_width = max(self.runners)
        self.graphs = graphs

    def run(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        t = tokens.shape[0]
        width = min(w for w in self.runners if w >= t)
        return self.runners[width].run(tokens, start)


def static_cache(model: Transformer, capacity: int, widths: tuple[int, ...], graphs: bool = False) -> KVCache:
    """A KV cache preallocated to `capacity` positions whose short forwards run at fixed widths."""
    cache = new_cache(model, capacity, static=True)
    cache.steps = FixedSteps(model, cache, widths, graphs)
    return cache


def synchronize(device: torch.device | str) -> None:
    """Wait for the device (timing on CUDA measures launches otherwise)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed_forward(model: Transformer, segments: list[Segment]) -> tuple[list[torch.Tensor], float]:
    """One forward over the segments' rows (one segment: `forward`; several: `forward_many`,
    linears batched, attention per segment), with its wall time once the device is done."""
    t0 = time.perf_counter()
    if len(segments) == 1:
        s = segments[0]
        logits = [forward(model, s.cache, s.tokens, s.start, s.all_logits, s.also_row)]
    else:
        logits = forward_many(model, segments)
    synchronize(model.device)
    return logits, time.perf_counter() - t0
