"""The KV pool: byte budget -> blocks per format, size parsing, per-layer scales (no model)."""
import pytest

from everybyte.kv.data.pool import KVPool, bytes_per_token, kv_bytes_per_token, min_pool_bytes, parse_size

SMOL = [(3, 64)] * 30          # SmolLM2-135M: 30 layers, 3 KV heads of 64


@pytest.mark.parametrize("text,value", [("64MiB", 64 * 2**20), ("1GiB", 2**30), ("500MB", 500 * 10**6),
                                        ("4096", 4096), (4096, 4096), ("1.5 KiB", 1536), ("2g", 2 * 10**9)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "lots", "64 MiBs", "-5", "0", 0])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_bytes_per_token_per_format():
    assert kv_bytes_per_token(SMOL) == {"fp32": 46080, "fp16": 23040, "bf16": 23040, "fp8": 11520,
                                        "nvfp4": 6480}
    assert bytes_per_token([(8, 128)] * 2, "nvfp4") == 2 * 2 * 8 * (64 + 8)


def test_block_count_follows_bytes_and_format():
    pools = {f: KVPool(SMOL, f, "16MiB", block_size=16) for f in ("fp16", "fp8", "nvfp4")}
    for f, p in pools.items():
        assert p.num_blocks == 16 * 2**20 // (16 * bytes_per_token(SMOL, f))
        assert p.nbytes <= p.budget_bytes and p.nbytes == p.num_blocks * p.bytes_per_block
        assert len(p.k) == len(p.v) == 30
    assert pools["nvfp4"].capacity_tokens >= 3.5 * pools["fp16"].capacity_tokens
    assert pools["fp8"].capacity_tokens >= 2 * pools["fp16"].capacity_tokens - 16


def test_too_small_and_minimum():
    with pytest.raises(ValueError, match="holds no block"):
        KVPool(SMOL, "fp16", 1000)
    need = min_pool_bytes(SMOL, "fp16", 100, 16)
    assert need == 112 * 23040
    assert KVPool(SMOL, "fp16", need).capacity_tokens == 112


def test_scales_from_amax():
    p = KVPool(SMOL, "nvfp4", "4MiB")
    assert p.k_scales[0] == p.fmt.default_scale
    # amax * headroom is rounded up to a power of two, so every node derives the same scales
    p.set_scales_from_amax([2000.0] * 30, [6.0] * 30, headroom=1.0)
    assert p.k_scales == [2048.0 / 2688.0] * 30 and p.v_scales == [8.0 / 2688.0] * 30
    p.set_scales_from_amax([5.9999999] * 30, [6.0000001] * 30, headroom=1.0)
    assert p.k_scales == p.v_scales == [8.0 / 2688.0] * 30
    f = KVPool(SMOL, "fp8", "4MiB")
    f.set_scales_from_amax([448.0] * 30, [1.0] * 30, headroom=2.0)
    assert f.k_scales[0] == 1024 / 448 and f.v_scales[0] == 2.0 / 448


def test_power_of_two_grid_is_exact_and_checkpoint_scales_skip_it():
    from everybyte.kv.data.pool import pow2_ceil
    assert [pow2_ceil(x) for x in (32.0, 32.000000000000004, 31.999999999999996, 0.75, 2.0**-1074)] == \
        [32.0, 64.0, 32.0, 1.0, 2.0**-1074]
    p = KVPool(SMOL, "fp8", "4MiB")
    p.set_scales_from_amax([10.0] * 30, [3.5] * 30, headroom=2.0, grid=False)   # as given: no headroom, no grid
    assert p.k_scales == [10.0 / 448] * 30 and p.v_scales == [3.5 / 448] * 30
