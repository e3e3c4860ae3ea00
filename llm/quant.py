"""Linear layers whose every output row depends only on its own input row.

Speculative decoding is exact only if verifying k tokens in one forward gives each
token the logits it would get alone. `torch.ao` dynamic int8 breaks that: it picks one
activation scale for the whole batch, so a draft token changes the rounding of the
token before it (measured: logits off by up to 4.35, argmax flipped).

Two batch-invariant int8 kernels, both with per-channel int8 weights:

- fbgemm (preferred, x86): each row is divided by its own max |x|, and every row gets two
  pinned columns (+1, -1) whose weights are zero, so the dynamic quantiser always sees the
  range [-1, 1] and quantises every row with the same parameters whatever else is in the
  batch. The integer GEMM is exact (the zero columns add exactly 0); the row's max is
  multiplied back elementwise. Measured on the 2-core dev machine (1536 -> 8960): 0.45 ms
  for 1 row, 0.57 ms for 9, against 0.34 / 0.45 ms for plain (not invariant) fbgemm
  dynamic int8 -- with the pin as an extra row, which doubled a one-token decode's rows.
  Pinned columns give bit-identical outputs with one row fewer (tests/test_quant.py).
- `torch._int_mm` (fallback): symmetric per-row int8 activations; 0.67 / 0.74 ms there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: weight ~= qweight * scale[:, None]."""
    w = weight.detach().to(torch.float32)
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    qweight = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return qweight.contiguous(), scale.contiguous()


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


# The pinned columns appended to every input row (+1, -1); their weights are zero.
PIN_COLUMNS = 2


def pack_fbgemm(weight: torch.Tensor):
    """Per-output-channel symmetric int8 weights, with PIN_COLUMNS zero columns, prepacked for fbgemm."""
    import warnings

    w = weight.detach().to(torch.float32)
    w = torch.cat([w, w.new_zeros(w.shape[0], PIN_COLUMNS)], dim=1)
    scale = (w.abs().amax(dim=1).clamp(min=1e-12) / 127.0).to(torch.float64)
    with warnings.catch_warnings():  # quantized tensors are deprecated upstream; pinned torch has them
        warnings.simplefilter("ignore")
        wq = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(wq, None)


def fbgemm_linear(x: torch.Tensor, packed, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).to(torch.float32)
    row_max = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    # Columns, not an extra row: a row would double a one-token decode's GEMM rows.
    pin = rows.new_zeros(rows.shape[0], PIN_COLUMNS)
    pin[:, 0], pin[:, 1] = 1.0, -1.0
    # reduce_range: 7-bit activations, so AVX2's pairwise int16 accumulation cannot saturate.
    y = torch.ops.quantized.linear_dynamic(torch.cat([rows / row_max, pin], dim=1), packed, True)
    y = y * row_max
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], out_features)


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """y = x @ W.T (+ b) with per-row activation scales and an exact integer GEMM."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.float32)
    x_scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    xq = torch.round(rows / x_scale).clamp(-127, 127).to(torch.int8)
    acc = torch._int_mm(xq, qweight.t())
    y = acc.to(torch.float32) * (x_scale * w_scale)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], qweight.shape[0])


class Linear(torch.nn.Module):
    """A linear layer in one of three numerics, chosen once at load time.

    - "int8": per-row int8 activations x per-channel int8 weights (CPU fast path; batch-invariant).
    - "rowwise": float, computed one row at a time, so each row sees exactly the kernel a
      single-token decode sees (batch-invariant; slow, for float checks on CPU).
    - "float": one float GEMM over all rows (fastest on GPU; not bitwise batch-invariant,
      so the decoder verifies at a fixed width there).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, mode: str, dtype: torch.dtype):
        super().__init__()
        self.mode = mode
        self.out_features, self.in_features = weight.shape
        self.packed = None
        if mode == "int8":
            if fbgemm_available() and self.in_features >= 2:
                self.packed = pack_fbgemm(weight)
            else:
                qweight, scale = quantize_weight(weight)
                self.register_buffer("qweight", qweight)
                self.register_buffer("w_scale", scale)
            self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32).contiguous())
        elif mode in ("float", "rowwise"):
            self.register_buffer("weight", weight.detach().to(dtype).contiguous())
            self.register_buffer("bias", None if bias is None else bias.detach().to(dtype).contiguous())
        else:
            raise ValueError(f"unknown linear mode {mode!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "int8":
            if self.packed is not None:
                return fbgemm_linear(x, self.packed, self.out_features, self.bias)
            return int8_linear(x, self.qweight, self.w_scale, self.bias)
        if self.mode == "rowwise" and x.shape[0] > 1:
            return torch.cat([F.linear(x[i : i + 1], self.weight, self.bias) for i in range(x.shape[0])])
        return F.linear(x, self.weight, self.bias)
