import pytest
import torch

from everybyte.formats import cpu_kernels, nvfp4
from everybyte.formats.kv_layout import KV_CACHE_DTYPES, get_kv_format, hadamard
from everybyte.formats.nvfp4_kv import divisors, quantize_blocks_best_scale

NB, BS, H, D = 6, 4, 3, 64


def _filled(fmt, seed=0):
    torch.manual_seed(seed)
    store = fmt.allocate(NB, BS, H, D, "cpu")
    x = torch.randn(NB * BS, H, D) * 2.0
    fmt.write(store, torch.arange(NB * BS), x, fmt.default_scale)
    return store, x


@pytest.mark.parametrize("name,expected", [("fp32", 768), ("fp16", 384), ("bf16", 384),
                                           ("fp8", 192), ("nvfp4", 108)])
def test_bytes_per_token_exact(name, expected):
    fmt = get_kv_format(name)
    assert fmt.bytes_per_token(H, D) == expected
    store = fmt.allocate(NB, BS, H, D, "cpu")
    total = sum(t.numel() * t.element_size() for t in store.values())
    assert total == NB * BS * expected
    assert all(t.shape[:3] == (NB, BS, H) for t in store.values())


def test_capacity_ratios():
    fp16, fp8, fp4 = (get_kv_format(n) for n in ("fp16", "fp8", "nvfp4"))
    assert fp4.bytes_per_token(1, 64) == 36 and fp4.bytes_per_token(1, 128) == 72
    assert fp16.bytes_per_token(1, 128) / fp4.bytes_per_token(1, 128) >= 3.5
    assert fp16.bytes_per_token(8, 64) / fp4.bytes_per_token(8, 64) == pytest.approx(128 / 36)
    assert fp8.bytes_per_token(8, 128) / fp4.bytes_per_token(8, 128) == pytest.approx(128 / 72)


def test_unknown_format_and_bad_head_dim():
    with pytest.raises(ValueError, match="nvfp4"):
        get_kv_format("int3")
    with pytest.raises(ValueError, match="head_dim"):
        get_kv_format("nvfp4").allocate(1, 4, 1, 40, "cpu")
    assert set(KV_CACHE_DTYPES) == {"fp32", "fp16", "bf16", "fp8", "nvfp4"}


@pytest.mark.parametrize("name,tol", [("fp32", 0.0), ("fp16", 1e-3), ("bf16", 8e-3),
                                      ("fp8", 0.07), ("nvfp4", 0.2)])
def test_round_trip(name, tol):
    fmt = get_kv_format(name)
    store, x = _filled(fmt)
    y = fmt.read(store, torch.arange(NB), fmt.default_scale, torch.float32).reshape(-1, H, D)
    err = (y - x).norm() / x.norm()
    assert err <= tol
    if name == "fp32":
        assert torch.equal(y, x)


def test_nvfp4_cache_holds_the_codec_bytes():
    fmt = get_kv_format("nvfp4")
    store, x = _filled(fmt)
    s = fmt.default_scale
    packed, scales = quantize_blocks_best_scale(x, s)
    assert torch.equal(store["data"].view(-1, H, D // 2), packed)
    assert torch.equal(store["scales"].view(-1, H, D // 16).view(torch.uint8), scales.view(torch.uint8))
    y = fmt.read(store, torch.arange(NB), s, torch.float32).reshape(-1, H, D)
    assert torch.equal(y, nvfp4.dequantize_blocks(packed, scales, s, torch.float32))


def test_best_scale_is_standard_nvfp4_and_never_worse():
    """Each block keeps the amax/6 (standard) or amax/4 scale, whichever is closer: ordinary
    NVFP4 bytes, and per block never a larger squared error than the standard encoding."""
    x = torch.randn(64, 3, 64) * torch.rand(64, 3, 1) * 5
    s = 1 / 448
    std = nvfp4.dequantize_blocks(*nvfp4.quantize_blocks(x, s), s).reshape(-1, 16)
    packed, scales = quantize_blocks_best_scale(x, s)
    best = nvfp4.dequantize_blocks(packed, scales, s).reshape(-1, 16)
    xb = x.reshape(-1, 16)
    err_std, err_best = (std - xb).square().sum(-1), (best - xb).square().sum(-1)
    assert bool((err_best <= err_std + 1e-12).all())
    assert err_best.sum() < err_std.sum()
    same = scales.reshape(-1).view(torch.uint8) == nvfp4.quantize_blocks(x, s)[1].reshape(-1).view(torch.uint8)
    assert bool(same[err_best == err_std].all())


def test_hadamard_is_orthonormal():
    for n in (16, 64, 128):
        h = hadamard(n)
        assert torch.allclose(h @ h, torch.eye(n), atol=1e-6) and torch.equal(h, h.T)
    with pytest.raises(ValueError):
        hadamard(48)


@pytest.mark.parametrize("name", KV_CACHE_DTYPES)
def test_write_skips_negative_slots_and_read_gathers(name):
    fmt = get_kv_format(name)
    store = fmt.allocate(NB, BS, H, D, "cpu")
    x = torch.randn(5, H, D)
    slots = torch.tensor([2 * BS + 1, -1, 0, -1, 5 * BS + 3])
    fmt.write(store, slots, x, 0.5)
    flat = fmt.read(store, torch.arange(NB), 0.5, torch.float32).reshape(-1, H, D)
    written = {2 * BS + 1: 0, 0: 2, 5 * BS + 3: 4}
    for slot in range(NB * BS):
        if slot not in written:
            assert not flat[slot].any()
    for slot, i in written.items():  # same values as that token written alone
        single = fmt.allocate(1, 1, H, D, "cpu")
        fmt.write(single, torch.tensor([0]), x[i:i + 1], 0.5)
        assert torch.equal(flat[slot], fmt.read(single, torch.tensor([0]), 0.5, torch.float32)[0, 0])
    y = fmt.read(store, torch.tensor([[2, 0], [5, 5]]), 0.5, torch.float32)
    assert y.shape == (2, 2, BS, H, D)
    assert torch.equal(y[0, 0, 1], flat[2 * BS + 1]) and torch.equal(y[1, 1, 3], flat[5 * BS + 3])
    assert torch.equal(y[0, 1, 0], flat[0])


def test_read_dtype():
    for name in KV_CACHE_DTYPES:
        fmt = get_kv_format(name)
        store, _ = _filled(fmt)
        assert fmt.read(store, torch.arange(2), fmt.default_scale, torch.bfloat16).dtype == torch.bfloat16


def test_fp8_scale_extends_range():
    fmt = get_kv_format("fp8")
    x = torch.linspace(-2000, 2000, H * D).view(1, H, D)
    store = fmt.allocate(1, 1, H, D, "cpu")
    scale = fmt.scale_for_amax(2000.0)
    fmt.write(store, torch.tensor([0]), x, scale)
    y = fmt.read(store, torch.tensor([0]), scale, torch.float32)[0, 0]
    assert ((y - x[0]).abs() <= x[0].abs() * 0.0625 + 1e-6 + 2000 / 448 * 2 ** -9).all()


@pytest.mark.parametrize("name", KV_CACHE_DTYPES)
def test_write_kv_equals_two_writes(name):
    """The fused K+V write (one encode pass for nvfp4) stores the same bytes as two writes."""
    fmt = get_kv_format(name)
    k, v = torch.randn(20, H, D), torch.randn(20, H, D) * 3
    slots = torch.arange(20) + 2
    slots[3] = -1
    fused = (fmt.allocate(NB, BS, H, D, "cpu"), fmt.allocate(NB, BS, H, D, "cpu"))
    apart = (fmt.allocate(NB, BS, H, D, "cpu"), fmt.allocate(NB, BS, H, D, "cpu"))
    fmt.write_kv(*fused, slots, k, v, 0.01, 0.02)
    fmt.write(apart[0], slots, k, 0.01)
    fmt.write(apart[1], slots, v, 0.02)
    for a, b in zip(fused, apart):
        for key in a:
            assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8))


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_kv_kernels_give_the_reference_bytes(dtype):
    """kv_write (best-scale encode into slots) and kv_gather (gather + dequantize) equal the torch
    reference bit for bit, over magnitudes from tiny (E4M3 subnormal scales) to saturating."""
    torch.manual_seed(0)
    for trial, s in enumerate([1 / 448, 0.01, 1e-4, 3.0] * 3):
        x = torch.randn(37, 3, 64) * torch.rand(37, 3, 1) * 5 * 10 ** torch.randint(-4, 2, (37, 1, 1)).float()
        x[3, 1, :16] = 0
        x = x.to(dtype)
        packed, scales = quantize_blocks_best_scale(x, s)
        data, sc = torch.zeros(40, 3, 32, dtype=torch.uint8), torch.zeros(40, 3, 4, dtype=torch.float8_e4m3fn)
        slots = torch.arange(37) + 1
        slots[5] = -1
        cpu_kernels.kv_write(data, sc, slots, x, s, divisors("cpu"))
        keep = slots >= 0
        assert torch.equal(data[slots[keep]], packed[keep]), trial
        assert torch.equal(sc[slots[keep]].view(torch.uint8), scales[keep].view(torch.uint8)), trial
        assert not data[6].any()
        ids = torch.tensor([3, 0, 9, 3])
        blocks, bsc = data.view(10, 4, 3, 32), sc.view(10, 4, 3, 4)
        got = cpu_kernels.kv_gather(blocks, bsc, ids, s, dtype)
        assert torch.equal(got.view(4, 4, 3, 64), nvfp4.dequantize_blocks(blocks[ids], bsc[ids], s, dtype, fast="never"))
