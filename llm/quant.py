"""Linear layers whose every output row depends only on its own input row.

Speculative decoding is exact only if verifying k tokens in one forward gives each
token the logits it would get alone. `torch.ao` dynamic int8 breaks that: it picks one
activation scale for the whole batch, so a draft token changes the rounding of the
token before it (measured: logits off by up to 4.35, argmax flipped). Here every row
is quantised with its own scale and the product is an integer GEMM (`torch._int_mm`),
which is exact whatever the blocking; the float rescale afterwards is elementwise. So
the layer is bitwise batch-invariant by construction, and on this CPU an 8-row int8
GEMM costs about what a 1-row one does (memory bound on the int8 weights).
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
        if mode == "int8":
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
            return int8_linear(x, self.qweight, self.w_scale, self.bias)
        if self.mode == "rowwise" and x.shape[0] > 1:
            return torch.cat([F.linear(x[i : i + 1], self.weight, self.bias) for i in range(x.shape[0])])
        return F.linear(x, self.weight, self.bias)
