"""The fbgemm int8 linear: per-row results whatever the batch, with the pin as columns."""

import pytest
import torch

from llm.quant import Linear, fbgemm_available, pack_fbgemm

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="fbgemm is x86 only; int8_linear covers the rest")


def pinned_row_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The earlier formulation, as an oracle: one extra input row (+1, -1, 0, ...) per call."""
    import warnings

    w = weight.to(torch.float32)
    scale = (w.abs().amax(dim=1).clamp(min=1e-12) / 127.0).to(torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wq = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(wq, None)
    row_max = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    pin = x.new_zeros(1, x.shape[1])
    pin[0, 0], pin[0, 1] = 1.0, -1.0
    return torch.ops.quantized.linear_dynamic(torch.cat([x / row_max, pin]), packed, True)[:-1] * row_max


def test_pinned_columns_give_the_pinned_row_results_bit_for_bit():
    torch.manual_seed(0)
    weight = torch.randn(80, 48) * 0.05
    lin = Linear(weight, None, "int8", torch.float32)
    x = torch.randn(7, 48) * torch.logspace(-3, 3, 7)[:, None]
    assert torch.equal(lin(x), pinned_row_linear(x, weight))


def test_a_one_sided_row_is_quantised_alike_alone_and_in_a_batch():
    """Alone, an all-positive row has no negative value; without the pin its range would
    be [0, 1], and [-1, 1] beside a negative row, so its rounding would change."""
    torch.manual_seed(1)
    lin = Linear(torch.randn(32, 40), torch.randn(32), "int8", torch.float32)
    positive = torch.rand(1, 40) + 0.1
    negative = -(torch.rand(1, 40) + 0.1) * 50
    batch = lin(torch.cat([positive, negative]))
    assert torch.equal(batch[:1], lin(positive))
    assert torch.equal(batch[1:], lin(negative))


def test_int8_is_close_to_the_float_linear():
    torch.manual_seed(2)
    weight, bias = torch.randn(64, 256) * 0.05, torch.randn(64)
    x = torch.randn(5, 256)
    exact = torch.nn.functional.linear(x, weight, bias)
    got = Linear(weight, bias, "int8", torch.float32)(x)
    assert (got - exact).abs().max() < 0.05 * exact.abs().max()


def test_the_pin_columns_are_packed_with_zero_weights():
    weight = torch.randn(16, 24)
    unpacked, _ = torch.ops.quantized.linear_unpack(pack_fbgemm(weight))
    assert unpacked.shape == (16, 26)
    assert torch.equal(unpacked.int_repr()[:, 24:], torch.zeros(16, 2, dtype=torch.int8))
