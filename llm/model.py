"""A decoder-only transformer (Llama / Qwen2 / Mistral family) built for speculation.

Why our own forward instead of the Hugging Face module: speculative decoding needs
(1) a KV cache that rolls back by moving a position, not by copying, (2) every row of a
k-token verify to get bitwise the logits a one-token step would give, and (3) a
per-step forward simple enough to capture in a CUDA graph. Weights come from any
Hugging Face checkpoint of these architectures.

State is explicit: `forward(model, cache, tokens, start)` writes K/V for positions
[start, start + len(tokens)) into `cache` and returns logits; rolling back is just
calling the next forward with a smaller `start` (stale entries are never read: each
query row attends to keys [0, its position]).

Two ways to run a step:

- eager, variable width (`forward` on an ordinary cache): attention one query row at a
  time (`attend_rowwise`), so with batch-invariant linears (int8, rowwise) a k-row verify
  is bitwise k one-row steps. The CPU default.
- fixed width (`forward_fixed`, reached through `forward` when the cache is static and
  carries fixed-width steps, see llm/cuda_graphs.py): every decode and verify pass runs
  the same R rows over the whole preallocated cache, with a mask built from positions
  (row i at position p sees keys [0, p]) and `start` as a tensor. Same shapes every
  pass: a float GEMM treats each row identically whatever the other rows hold, so
  greedy output is the same at gamma 0 and gamma k, and the step can be captured in a
  CUDA graph. The GPU path.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llm.quant import Linear

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    qkv_bias: bool
    max_position: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, config) -> "ModelArgs":
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model architecture {model_type!r}: specvoice's decoder runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} models (Qwen2.5, Llama 3, SmolLM2, Mistral, ...)"
            )
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) and model_type == "mistral":
            raise ValueError("sliding-window attention is not supported; pick a model without it")
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rope_type not in ("default", None):
            raise ValueError(f"rope scaling {rope_type!r} is not supported yet (only plain RoPE)")
        theta = getattr(config, "rope_theta", None) or (rope.get("rope_theta") if isinstance(rope, dict) else None) or 10000.0
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        if model_type == "qwen2":
            qkv_bias = True
        else:
            qkv_bias = bool(getattr(config, "attention_bias", False))
        if getattr(config, "mlp_bias", False):
            raise ValueError("MLP biases are not supported")
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            rope_theta=float(theta),
            rms_norm_eps=float(config.rms_norm_eps),
            qkv_bias=qkv_bias,
            max_position=int(getattr(config, "max_position_embeddings", 4096)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )


class Block(torch.nn.Module):
    def __init__(self, args: ModelArgs, weights: dict[str, torch.Tensor], prefix: str, mode: str, dtype: torch.dtype):
        super().__init__()
        w = lambda name: weights[prefix + name]  # noqa: E731
        b = lambda name: weights.get(prefix + name)  # noqa: E731
        # q, k, v fused into one GEMM and gate, up into another: fewer, larger kernels.
        qkv_w = torch.cat([w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")])
        qkv_b = None
        if args.qkv_bias:
            qkv_b = torch.cat([b("self_attn.q_proj.bias"), b("self_attn.k_proj.bias"), b("self_attn.v_proj.bias")])
        self.qkv = Linear(qkv_w, qkv_b, mode, dtype)
        self.o = Linear(w("self_attn.o_proj.weight"), b("self_attn.o_proj.bias"), mode, dtype)
        self.gate_up = Linear(torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]), None, mode, dtype)
        self.down = Linear(w("mlp.down_proj.weight"), None, mode, dtype)
        act_dtype = torch.float32 if mode == "int8" else dtype
        self.register_buffer("input_norm", w("input_layernorm.weight").to(act_dtype))
        self.register_buffer("post_norm", w("post_attention_layernorm.weight").to(act_dtype))


class Transformer(torch.nn.Module):
    """Weights only; the forward pass is the pure function `forward` below."""

    def __init__(self, args: ModelArgs, weights: dict[str, torch.Tensor], mode: str, dtype: torch.dtype):
        super().__init__()
        self.args = args
        self.mode = mode
        self.act_dtype = torch.float32 if mode == "int8" else dtype
        self.register_buffer("embed", weights["model.embed_tokens.weight"].to(self.act_dtype))
        self.register_buffer("final_norm", weights["model.norm.weight"].to(self.act_dtype))
        head = weights.get("lm_head.weight")
        if head is None or args.tie_word_embeddings:
            head = weights["model.embed_tokens.weight"]
        # The head and the layers are built side by side: packing int8 weights for fbgemm
        # is most of a load (10 of 20 s for the 1.5B target on 2 cores) and runs outside
        # the GIL. The head, the largest matrix, goes first.
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            lm_head = pool.submit(Linear, head, None, mode, dtype)
            blocks = list(pool.map(lambda i: Block(args, weights, f"model.layers.{i}.", mode, dtype), range(args.num_layers)))
            self.lm_head = lm_head.result()
        self.blocks = torch.nn.ModuleList(blocks)
        inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.int64).float() / args.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def device(self) -> torch.device:
        return self.embed.device


@dataclass
class KVCache:
    """Per-layer K/V buffers of shape (kv_heads, capacity, head_dim) for one sequence.

    `length` is how many positions hold valid entries; rollback lowers it, and the
    next forward overwrites from there. Capacity grows by doubling when needed, except
    for a static cache: preallocated to its full capacity, its buffers are never
    replaced (a captured CUDA graph holds their addresses), and `steps` (a
    llm.cuda_graphs.FixedSteps) runs short forwards over it at a fixed width.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0
    static: bool = False
    steps: object | None = None

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    def ensure(self, needed: int, limit: int) -> None:
        if needed <= self.capacity:
            return
        if self.static:
            limit = min(limit, self.capacity)
        if needed > limit:
            raise ValueError(f"sequence of {needed} tokens exceeds the context limit of {limit}")
        new_cap = min(max(needed, 2 * self.capacity), limit)
        for i in range(len(self.keys)):
            for buf in (self.keys, self.values):
                old = buf[i]
                grown = old.new_zeros(old.shape[0], new_cap, old.shape[2])
                grown[:, : old.shape[1]] = old
                buf[i] = grown

    def copy_prefix_from(self, other: "KVCache", n: int) -> None:
        """Share a computed prefix (a system prompt) by copying its first n positions."""
        self.ensure(n, max(n, other.capacity))
        for dst, src in ((self.keys, other.keys), (self.values, other.values)):
            for i in range(len(dst)):
                dst[i][:, :n] = src[i][:, :n]
        self.length = n


def new_cache(model: Transformer, capacity: int = 256, static: bool = False) -> KVCache:
    a = model.args
    shape = (a.num_kv_heads, capacity, a.head_dim)
    make = lambda: [torch.zeros(shape, dtype=model.act_dtype, device=model.device) for _ in range(a.num_layers)]  # noqa: E731
    return KVCache(keys=make(), values=make(), static=static)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Matches Hugging Face's LlamaRMSNorm / Qwen2RMSNorm: normalise in float32.
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_tables(model: Transformer, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.to(torch.float32)[:, None] * model.inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    # (T, 1, head_dim): broadcasts over heads.
    return emb.cos()[:, None, :].to(model.act_dtype), emb.sin()[:, None, :].to(model.act_dtype)


def attend_rowwise(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Causal attention computed one query row at a time.

    Row i (position start + i) attends to cached keys [0, start + i] with exactly the
    tensor shapes a one-token decode at that position uses, so its result is bitwise the
    same whether it is verified alone or in a batch of k. q: (T, heads, d); keys/values:
    (kv_heads, capacity, d). Returns (T, heads * d).
    """
    t, heads, d = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    out = torch.empty(t, kv_heads, group, d, dtype=q.dtype, device=q.device)
    for i in range(t):
        n = start + i + 1
        qi = q[i].view(kv_heads, group, d)
        scores = torch.matmul(qi, keys[:, :n].transpose(1, 2)) * scale
        probs = torch.softmax(scores.to(torch.float32), dim=-1).to(q.dtype)
        out[i] = torch.matmul(probs, values[:, :n])
    return out.view(t, heads * d)


def attend_masked(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of T query rows over the whole static cache, on fixed shapes.

    Row i (at positions[i]) sees keys [0, positions[i]]; everything after it (stale
    entries of a rolled-back pass, padding rows' writes, zeros) gets probability exactly
    0. Stale keys are never used (`where`, so even NaN keys are harmless); stale values
    are multiplied by exact zeros, so they only need to be finite, which every written
    entry is. q: (T, heads, d); keys/values: (kv_heads, capacity, d). Returns (T, heads * d).
    """
    t, heads, d = q.shape
    kv_heads, capacity = keys.shape[0], keys.shape[1]
    group = heads // kv_heads
    qg = q.view(t, kv_heads, group, d).permute(1, 0, 2, 3).reshape(kv_heads, t * group, d)
    scores = torch.matmul(qg, keys.transpose(1, 2)) * scale  # (kv_heads, T * group, capacity)
    visible = torch.arange(capacity, device=q.device)[None, :] <= positions[:, None]  # (T, capacity)
    visible = visible[:, None, :].expand(t, group, capacity).reshape(t * group, capacity)  # no host sync
    scores = torch.where(visible, scores.to(torch.float32), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs, values)  # (kv_heads, T * group, d)
    return out.view(kv_heads, t, group, d).permute(1, 0, 2, 3).reshape(t, heads * d)


def run_blocks(model: Transformer, x: torch.Tensor, cos, sin, store, attend) -> torch.Tensor:
    """The decoder layers over hidden states x (T, hidden), shared by every forward.

    `store(layer, k, v)` writes this pass's K/V (kv_heads, T, d) into the layer's cache(s);
    `attend(layer, q)` is the attention of q (T, heads, d) over them, (T, heads * d)."""
    a = model.args
    t = x.shape[0]
    q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    for layer, blk in enumerate(model.blocks):
        h = rms_norm(x, blk.input_norm, a.rms_norm_eps)
        qkv = blk.qkv(h)
        q = qkv[:, :q_size].view(t, a.num_heads, a.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(t, a.num_kv_heads, a.head_dim)
        v = qkv[:, q_size + kv_size :].view(t, a.num_kv_heads, a.head_dim)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        store(layer, k.transpose(0, 1), v.transpose(0, 1))
        x = x + blk.o(attend(layer, q))
        h = rms_norm(x, blk.post_norm, a.rms_norm_eps)
        gate, up = blk.gate_up(h).chunk(2, dim=-1)
        x = x + blk.down(F.silu(gate) * up)
    return x


def forward_fixed(model: Transformer, cache: KVCache, tokens: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """One fixed-width step: `tokens` (W,) at positions start + [0, W); float32 logits (W, vocab).

    `start` is a one-element long tensor on the model's device, so the step has no
    Python value baked in and can be captured once and replayed at any position. K/V
    of all W rows are written (rows past the valid length land beyond it and are
    overwritten later); `cache.length` is left to the caller. Needs start + W <= capacity.
    """
    a = model.args
    w = tokens.shape[0]
    positions = start + torch.arange(w, device=tokens.device)
    cos, sin = rope_tables(model, positions)
    scale = 1.0 / math.sqrt(a.head_dim)

    def store(layer, k, v):
        cache.keys[layer].index_copy_(1, positions, k)
        cache.values[layer].index_copy_(1, positions, v)

    x = run_blocks(model, F.embedding(tokens, model.embed), cos, sin, store,
                   lambda layer, q: attend_masked(q, cache.keys[layer], cache.values[layer], positions, scale))
    x = rms_norm(x, model.final_norm, a.rms_norm_eps)
    return model.lm_head(x).to(torch.float32)


def forward(
    model: Transformer,
    cache: KVCache,
    tokens: torch.Tensor,
    start: int,
    all_logits: bool = True,
    also_row: int | None = None,
) -> torch.Tensor:
    """Run `tokens` (1-D) at positions [start, start + T); return float32 logits.

    all_logits=False returns only the last row's logits (a prefill needs no more, and
    the vocabulary head is the most expensive layer of a small model); with `also_row`
    (an index below T - 1) that row's first, then the last's: a prefill that also reads
    the distribution after a caller's words (decoder.first_pass, Generation.observe).

    On a cache with fixed-width steps, up to their widest width of tokens run as one
    padded fixed-width step (decode, verify, a draft's catch-up); longer inputs (a
    prefill) run eagerly.
    """
    a = model.args
    t = tokens.shape[0]
    steps = cache.steps
    if steps is not None and t <= steps.max_width:
        logits = steps.run(tokens, start)
        cache.length = start + t
        return logits if all_logits else logits[_kept_rows(t, also_row)]
    cache.ensure(start + t, a.max_position)
    positions = torch.arange(start, start + t, device=tokens.device)
    cos, sin = rope_tables(model, positions)
    scale = 1.0 / math.sqrt(a.head_dim)

    def store(layer, k, v):
        cache.keys[layer][:, start : start + t] = k
        cache.values[layer][:, start : start + t] = v

    x = run_blocks(model, F.embedding(tokens, model.embed), cos, sin, store,
                   lambda layer, q: attend_rowwise(q, cache.keys[layer], cache.values[layer], start, scale))
    cache.length = start + t
    if not all_logits:
        x = x[_kept_rows(t, also_row)]
    x = rms_norm(x, model.final_norm, a.rms_norm_eps)
    return model.lm_head(x).to(torch.float32)


def _kept_rows(t: int, also_row: int | None) -> slice | list[int]:
    """The rows a forward with all_logits=False returns logits for, of its `t`."""
    if also_row is None:
        return slice(t - 1, t)
    if not 0 <= also_row < t - 1:
        raise ValueError(f"also_row must be below the last of {t} rows, got {also_row}")
    return [also_row, t - 1]


@dataclass
class Segment:
    """One sequence's rows in a pass over several sequences (`forward_many`): `tokens` (1-D)
    at positions [start, start + T) of `cache`; all_logits=False keeps only the last row's."""

    cache: KVCache
    tokens: torch.Tensor
    start: int
    all_logits: bool = True
    also_row: int | None = None  # with all_logits=False: this row's logits too, first (forward)


def forward_many(model: Transformer, segments: list[Segment]) -> list[torch.Tensor]:
    """One forward over the rows of several sequences (conversations), each with its own
    cache and positions; float32 logits per segment, as `forward` gives each alone.

    The linears (int8 or rowwise: each output row depends only on its own input row) run
    once over all rows; RoPE tables are built per segment, exactly as a lone forward
    builds them; attention runs per segment over its own cache, one query row at a time
    (`attend_rowwise`). So every segment gets bitwise the logits of `forward` on its own.
    For variable-width (eager) caches only; a fixed-width step runs alone."""
    a = model.args
    for seg in segments:
        if seg.cache.steps is not None:
            raise ValueError("forward_many runs eager caches; a fixed-width step runs alone")
        seg.cache.ensure(seg.start + seg.tokens.shape[0], a.max_position)
    bounds, offset = [], 0
    for seg in segments:
        bounds.append((offset, offset + seg.tokens.shape[0]))
        offset += seg.tokens.shape[0]
    tables = [rope_tables(model, torch.arange(s.start, s.start + s.tokens.shape[0], device=s.tokens.device)) for s in segments]
    cos = torch.cat([c for c, _ in tables]) if len(tables) > 1 else tables[0][0]
    sin = torch.cat([s for _, s in tables]) if len(tables) > 1 else tables[0][1]
    scale = 1.0 / math.sqrt(a.head_dim)

    def store(layer, k, v):
        for seg, (lo, hi) in zip(segments, bounds):
            seg.cache.keys[layer][:, seg.start : seg.start + hi - lo] = k[:, lo:hi]
            seg.cache.values[layer][:, seg.start : seg.start + hi - lo] = v[:, lo:hi]

    def attend(layer, q):
        outs = [attend_rowwise(q[lo:hi], seg.cache.keys[layer], seg.cache.values[layer], seg.start, scale)
                for seg, (lo, hi) in zip(segments, bounds)]
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    tokens = torch.cat([s.tokens for s in segments]) if len(segments) > 1 else segments[0].tokens
    x = run_blocks(model, F.embedding(tokens, model.embed), cos, sin, store, attend)
    keep = []
    for seg, (lo, hi) in zip(segments, bounds):
        seg.cache.length = seg.start + hi - lo
        if seg.all_logits:
            keep.extend(range(lo, hi))
        else:
            rows = _kept_rows(hi - lo, seg.also_row)
            keep.extend(range(lo + rows.start, lo + rows.stop) if isinstance(rows, slice) else [lo + r for r in rows])
    x = x[torch.tensor(keep, device=x.device)]
    x = rms_norm(x, model.final_norm, a.rms_norm_eps)
    logits = model.lm_head(x).to(torch.float32)
    out, row = [], 0
    for seg, (lo, hi) in zip(segments, bounds):
        n = hi - lo if seg.all_logits else 1 + (seg.also_row is not None)
        out.append(logits[row : row + n])
        row += n
    return out


def build_model(hf_config, state_dict: dict[str, torch.Tensor], mode: str, dtype: torch.dtype, device: str | torch.device) -> Transformer:
    args = ModelArgs.from_hf_config(hf_config)
    # Hugging Face checkpoints sometimes prefix weights with "model." twice or not at all.
    weights = {k.removeprefix("base_model."): v for k, v in state_dict.items()}
    missing = [k for k in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight") if k not in weights]
    if missing:
        raise ValueError(f"checkpoint is missing expected weights {missing}; is it a {args.model_type} causal LM?")
    model = Transformer(args, weights, mode, dtype)
    return model.to(device).eval()
