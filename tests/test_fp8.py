import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from everybyte.formats.fp8 import FP8Tensor, dequantize, dequantize_raw, quantize, quantize_raw

EXAMPLES = int(os.environ.get("EVERYBYTE_HYPOTHESIS_EXAMPLES", "40"))  # raise for a deeper search
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_raw_known_values_and_saturation():
    x = torch.tensor([0.0, 1.0, -1.0, 448.0, 460.0, 1e30, -1e30, 1.0625, 2 ** -9, 2 ** -11, -0.0])
    q = quantize_raw(x, 1.0)
    assert q.dtype == torch.float8_e4m3fn
    assert bits(q).tolist() == [0x00, 0x38, 0xB8, 0x7E, 0x7E, 0x7E, 0xFE, 0x38, 0x01, 0x00, 0x80]
    assert dequantize_raw(q, 2.0).tolist()[:4] == [0.0, 2.0, -2.0, 896.0]
    assert not quantize_raw(x, 0.0).float().isnan().any()
    assert quantize_raw(torch.tensor([0.0, 5.0]), 0.0).float().tolist() == [0.0, 448.0]


def test_per_tensor_scale_and_error():
    x = torch.randn(64, 32) * 7
    t = quantize(x)
    assert t.scale.shape == () and t.scale.item() == pytest.approx(x.abs().max().item() / 448, rel=1e-6)
    assert (bits(t.data) & 0x7F).max().item() == 0x7E  # the amax element maps to 448
    rel = ((dequantize(t) - x).abs() / x.abs().clamp(min=1e-3)).max()
    assert rel <= 2 ** -4 + 1e-6 or (dequantize(t) - x).abs().max() <= 2 ** -9 * t.scale


def test_per_channel_axis():
    x = torch.randn(3, 4, 5) * torch.tensor([1e-3, 1.0, 1e3, 0.0]).reshape(1, 4, 1)
    t = quantize(x, axis=1)
    assert t.scale.shape == (4,) and t.axis == 1 and t.scale[3].item() == 1.0
    for c in range(4):
        assert torch.equal(bits(t.data[:, c]), bits(quantize(x[:, c], scale=t.scale[c]).data))
    t2 = quantize(x, axis=-2)
    assert t2.axis == 1 and torch.equal(bits(t2.data), bits(t.data))
    back = FP8Tensor.from_bytes(t.to_bytes())
    assert back.axis == 1 and torch.equal(dequantize(back), dequantize(t))
    with pytest.raises(ValueError, match="axis"):
        quantize(x, axis=3)
    with pytest.raises(ValueError, match="shape"):
        quantize(x, scale=torch.ones(3), axis=1)


def test_given_scale_saturates():
    t = quantize(torch.tensor([1.0, 1000.0, -1000.0]), scale=1.0)
    assert dequantize(t).tolist() == [1.0, 448.0, -448.0]
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="scale"):
            quantize(torch.ones(3), scale=bad)


def test_zero_tensor_and_empty():
    z = quantize(torch.zeros(4, 4, dtype=torch.bfloat16))
    assert z.scale.item() == 1.0 and dequantize(z, torch.bfloat16).eq(0).all()
    for shape in [(0,), (2, 0), (0, 3)]:
        e = quantize(torch.empty(shape), axis=None)
        assert dequantize(e).shape == shape and FP8Tensor.from_bytes(e.to_bytes()).shape == shape
    e = quantize(torch.empty(0, 3), axis=1)
    assert e.scale.tolist() == [1.0, 1.0, 1.0] and dequantize(e).shape == (0, 3)


def test_bad_inputs():
    x = torch.ones(2, 3, 4)
    x[1, 0, 2] = float("inf")
    with pytest.raises(ValueError, match=r"\(1, 0, 2\)"):
        quantize(x)
    x[1, 0, 2], x[0, 2, 1] = 1.0, float("nan")
    with pytest.raises(ValueError, match=r"\(0, 2, 1\)"):
        quantize(x, axis=2)
    with pytest.raises(TypeError):
        quantize(torch.ones(3, dtype=torch.int64))
    with pytest.raises(TypeError):
        quantize(torch.ones(3).to(torch.float8_e4m3fn))


def test_bytes_corruption():
    buf = quantize(torch.randn(8, 8)).to_bytes()
    for bad, why in [(b"NOPE" + buf[4:], "magic"), (buf[:-3], "truncated"), (buf[:-1] + bytes([buf[-1] ^ 4]), "checksum")]:
        with pytest.raises(ValueError, match=why):
            FP8Tensor.from_bytes(bad)
    from everybyte.formats import nvfp4
    with pytest.raises(ValueError, match="format"):
        FP8Tensor.from_bytes(nvfp4.quantize(torch.ones(16)).to_bytes())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_path_matches_reference(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(256, 64, generator=g) * torch.exp(torch.randn(256, 1, generator=g) * 3)).to(dtype)
    x[0, :4] = torch.tensor([0.0, -0.0, 1e30, -1e30]).to(dtype)
    s = torch.tensor(0.01)
    assert torch.equal(bits(quantize_raw(x, s, fast="never")), bits(quantize_raw(x, s, fast="always")))
    q = quantize_raw(x, s)
    assert torch.equal(dequantize_raw(q, s, dtype, fast="never"), dequantize_raw(q, s, dtype, fast="always"))


@st.composite
def tensors(draw):
    shape = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31)))
    x = torch.randn(shape, generator=g) * 10.0 ** draw(st.integers(-20, 20))
    if draw(st.booleans()):
        x = x / (torch.rand(shape, generator=g) + 1e-3)
    axis = draw(st.one_of(st.none(), st.integers(-len(shape), len(shape) - 1)))
    return x.to(draw(st.sampled_from([torch.float32, torch.bfloat16]))), axis


@SETTINGS
@given(tensors())
def test_property_error_and_round_trips(case):
    """|deq - x| <= 2^-4 |x| (half an E4M3 mantissa step) + 2^-10 * scale (half the smallest
    subnormal step), up to float32 rounding; no element saturates with the automatic scale."""
    x, axis = case
    t = quantize(x, axis=axis)
    s = t.broadcast_scale().double()
    err = (dequantize(t).double() - x.double()).abs()
    assert bool((err <= (2 ** -4 * x.double().abs() + 2 ** -10 * s) * (1 + 1e-6)).all())
    back = FP8Tensor.from_bytes(t.to_bytes())
    assert back.axis == t.axis and torch.equal(bits(back.data), bits(t.data)) and torch.equal(back.scale, t.scale)
    again = quantize(dequantize(t), scale=t.scale, axis=t.axis)
    assert torch.equal(bits(again.data), bits(t.data))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    x = torch.randn(64, 128) * 3
    for fast in ("never", "always"):
        assert torch.equal(bits(quantize_raw(x.cuda(), 0.02, fast=fast)).cpu(), bits(quantize_raw(x, 0.02)))
    assert torch.equal(dequantize(quantize(x.cuda(), axis=0)).cpu(), dequantize(quantize(x, axis=0)))
