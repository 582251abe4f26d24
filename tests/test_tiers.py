import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from everybyte.kv.block_id import KVNamespace, chain_block_ids
from everybyte.kv.data.pool import KVPool
from everybyte.kv.data.tier_config import build_tiers, load_beats_recompute, measure_load_bandwidth, parse_kv_tiers
from everybyte.kv.data.tiers import (
    CorruptBlock,
    DiskTier,
    FormatMismatch,
    HostTier,
    SharedDirTier,
    decode_block,
    encode_block,
    encode_pool_block,
    load_pool_block,
)
from everybyte.kv.data.tiers.codec import peek_header
from everybyte.kv.data.tiers.pool_codec import block_tensors
from everybyte.kv.tiers.frame import FRAME

LAYERS = 30
NAMES = chain_block_ids(KVNamespace("m", block_size=4), list(range(4 * 64)))


def nvfp4_block(seed: int) -> dict[str, torch.Tensor]:
    """One block of a 30-layer nvfp4 KV cache: packed nibbles + E4M3 scales for K and V."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for kv in "kv":
        for layer in range(LAYERS):
            out[f"{kv}.{layer}.data"] = torch.randint(0, 256, (16, 3, 32), generator=g, dtype=torch.uint8)
            out[f"{kv}.{layer}.scales"] = torch.randint(0, 256, (16, 3, 4), generator=g,
                                                        dtype=torch.uint8).view(torch.float8_e4m3fn)
    return out


def fp16_block(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"{kv}.{layer}.data": torch.randint(0, 2**16, (16, 3, 64), generator=g, dtype=torch.int32)
            .to(torch.int16).view(torch.float16) for kv in "kv" for layer in range(4)}


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and
                                        torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def encoded(seed=0, make=nvfp4_block):
    return encode_block(make(seed), "nvfp4", {"k.0": 0.5}, name=NAMES[seed])


# ---- codec ---------------------------------------------------------------------------------
def test_codec_round_trip_bit_exact():
    for make, fmt in ((nvfp4_block, "nvfp4"), (fp16_block, "fp16")):
        block = make(1)
        buf = encode_block(block, fmt, {"k.0": 0.1666, "v.0": 1.0}, name=NAMES[1], meta={"layer_shard": "all"})
        assert buf.dtype == torch.uint8 and buf.dim() == 1
        for form in (buf, bytes(buf.numpy()), memoryview(bytearray(buf.numpy()))):
            d = decode_block(form)
            assert d.format == fmt and d.name == NAMES[1] and d.scales == {"k.0": 0.1666, "v.0": 1.0}
            assert d.meta == {"layer_shard": "all"} and same_bits(block, d.tensors)
        assert peek_header(buf)["format"] == fmt


def test_codec_detects_corruption_truncation_and_mismatch():
    buf = encoded(2)
    bad = buf.clone()
    bad[-100] ^= 1
    with pytest.raises(CorruptBlock, match="checksum"):
        decode_block(bad)
    decode_block(bad, verify=False)      # trusted tiers may skip the checksum
    with pytest.raises(CorruptBlock):
        decode_block(buf[:-1].clone())
    with pytest.raises(CorruptBlock):
        decode_block(b"EBKV")
    with pytest.raises(CorruptBlock, match="magic"):
        decode_block(b"XXXX" + bytes(buf.numpy())[4:])
    with pytest.raises(FormatMismatch):
        decode_block(buf, expect_format="fp8")


def test_pool_block_round_trip_and_fit_checks():
    shapes = [(3, 64)] * LAYERS
    src = KVPool(shapes, "nvfp4", "1MiB", 16)
    dst = KVPool(shapes, "nvfp4", "1MiB", 16)
    for t in block_tensors(src, 3).values():
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
    buf = encode_pool_block(src, 3, name=NAMES[3])
    load_pool_block(dst, 7, buf)
    assert same_bits(block_tensors(src, 3), block_tensors(dst, 7))
    assert not any(t.view(torch.uint8).any() for t in block_tensors(dst, 6).values())
    with pytest.raises(FormatMismatch):
        load_pool_block(KVPool(shapes, "fp8", "1MiB", 16), 0, buf)
    with pytest.raises(FormatMismatch):
        load_pool_block(KVPool(shapes[:-1], "nvfp4", "1MiB", 16), 0, buf)
    dst.k_scales = [0.5] * LAYERS
    with pytest.raises(FormatMismatch, match="scales"):
        load_pool_block(dst, 0, buf)


# ---- host ----------------------------------------------------------------------------------
def test_host_tier_round_trip_lru_and_capacity():
    one = encoded(0).numel()
    spilled = []
    t = HostTier(3 * one, pin_memory=False, on_evict=lambda n, d: spilled.append((n, d)))
    for i in range(3):
        assert t.put(NAMES[i], encoded(i))
    assert same_bits(decode_block(t.get(NAMES[0])).tensors, nvfp4_block(0))    # 0 is now most recent
    assert t.put(NAMES[3], bytes(encoded(3).numpy()))                            # bytes work too
    assert not t.contains(NAMES[1]) and t.contains(NAMES[0]) and len(t) == 3
    assert spilled[0][0] == NAMES[1] and same_bits(decode_block(spilled[0][1]).tensors, nvfp4_block(1))
    assert t.used_bytes == 3 * one and t.stats["evictions"] == 1
    assert not t.put(NAMES[9], torch.zeros(4 * one, dtype=torch.uint8)) and t.stats["rejected"] == 1
    assert t.get(NAMES[1]) is None and t.stats["misses"] == 1
    assert t.delete(NAMES[0]) and not t.delete(NAMES[0]) and t.used_bytes == 2 * one
    assert t.put_async(NAMES[5], encoded(5)).result() and t.get_async(NAMES[5]).result() is not None


# ---- disk and shared dir -------------------------------------------------------------------
def test_disk_tier_round_trip_persistence_and_eviction(tmp_path):
    one = encoded(0).numel() + FRAME.size
    t = DiskTier(tmp_path, 3 * one + 100)
    futs = [t.put_async(NAMES[i], encoded(i)) for i in range(3)]
    assert all(f.result() for f in futs)
    assert same_bits(decode_block(t.get(NAMES[1])).tensors, nvfp4_block(1))
    assert not any(".tmp-" in f for _, _, fs in os.walk(tmp_path) for f in fs)
    t2 = DiskTier(tmp_path, 3 * one + 100)                        # a restart finds the blocks
    assert len(t2) == 3 and t2.used_bytes == t.used_bytes
    assert same_bits(decode_block(t2.get_async(NAMES[2]).result()).tensors, nvfp4_block(2))
    evicted = []
    t2.on_evict = lambda n, d: evicted.append(n)
    t2.get(NAMES[0])
    assert t2.put(NAMES[3], encoded(3))                         # evicts the LRU block (1)
    assert evicted == [NAMES[1]] and not os.path.exists(t2.path(NAMES[1])) and len(t2) == 3
    assert t2.longest_prefix(NAMES[:4]) == 1
    assert not t2.put(NAMES[4], torch.zeros(4 * one, dtype=torch.uint8))


def test_host_spills_to_disk_and_concurrent_io(tmp_path):
    one = encoded(0).numel()
    disk = DiskTier(tmp_path, 1 << 30)
    host = HostTier(2 * one, pin_memory=False, on_evict=lambda n, d: disk.put(n, d))
    for i in range(6):
        host.put(NAMES[i], encoded(i))
    assert [host.contains(n) for n in NAMES[:6]] == [False] * 4 + [True] * 2
    assert [disk.contains(n) for n in NAMES[:6]] == [True] * 4 + [False] * 2
    futs = [disk.get_async(NAMES[i % 4]) for i in range(16)] + [disk.put_async(NAMES[i], encoded(i))
                                                                 for i in range(6, 10)]
    assert all(f.result() is not None for f in futs)
    for i in range(10):
        got = host.get(NAMES[i]) if host.contains(NAMES[i]) else disk.get(NAMES[i])
        assert same_bits(decode_block(got).tensors, nvfp4_block(i))


def test_disk_corrupt_and_truncated_files_are_counted_misses(tmp_path, caplog):
    t = DiskTier(tmp_path, 1 << 30)
    for i in range(3):
        t.put(NAMES[i], encoded(i))
    p = t.path(NAMES[0])
    with open(p, "r+b") as f:
        f.seek(5000)
        b = f.read(1)
        f.seek(5000)
        f.write(bytes([b[0] ^ 0xFF]))
    with open(t.path(NAMES[1]), "r+b") as f:
        f.truncate(1000)
    assert t.get(NAMES[0]) is None and t.get(NAMES[1]) is None
    assert t.stats["corrupt"] == 2 and t.stats["misses"] == 2
    assert not os.path.exists(p) and not t.contains(NAMES[0]) and len(t) == 1
    assert sum("corrupt block" in r.message for r in caplog.records) == 1      # logged once
    assert t.get(NAMES[2]) is not None
    os.unlink(t.path(NAMES[2]))                                     # vanished under us: plain miss
    assert t.get(NAMES[2]) is None and t.stats["corrupt"] == 2


def test_disk_cleans_stale_temp_files(tmp_path):
    t = DiskTier(tmp_path, 1 << 30)
    t.put(NAMES[0], encoded(0))
    tmp = os.path.join(os.path.dirname(t.path(NAMES[0])), ".tmp-crashed-mid-write")
    with open(tmp, "wb") as f:
        f.write(b"half a block")
    t2 = DiskTier(tmp_path, 1 << 30)
    assert not os.path.exists(tmp) and len(t2) == 1


def test_shared_dir_two_nodes_see_each_other(tmp_path):
    a = SharedDirTier(tmp_path, 1 << 30, rescan_s=0.0)
    b = SharedDirTier(tmp_path, 1 << 30, rescan_s=0.0, level="G4")
    assert a.put(NAMES[0], encoded(0))
    assert b.contains(NAMES[0]) and same_bits(decode_block(b.get(NAMES[0])).tensors, nvfp4_block(0))
    assert b.used_bytes == a.used_bytes > 0
    assert b.delete(NAMES[0]) and a.get(NAMES[0]) is None and not a.contains(NAMES[0])


def test_shared_dir_capacity(tmp_path):
    one = encoded(0).numel() + FRAME.size
    a = SharedDirTier(tmp_path, 2 * one, rescan_s=0.0)
    b = SharedDirTier(tmp_path, 2 * one, rescan_s=0.0)
    a.put(NAMES[0], encoded(0))
    time.sleep(0.01)
    b.put(NAMES[1], encoded(1))
    time.sleep(0.01)
    assert a.put(NAMES[2], encoded(2))           # sees b's block through the rescan, evicts the oldest
    assert not b.contains(NAMES[0]) and b.contains(NAMES[1]) and a.used_bytes <= 2 * one


# ---- redis ---------------------------------------------------------------------------------
def test_redis_round_trip_two_clients_and_capacity(redis_server):
    from everybyte.kv.data.tiers import RedisTier
    one = encoded(0).numel() + FRAME.size
    a = RedisTier(redis_server.url, 3 * one, prefix="t1:")
    b = RedisTier(redis_server.url, 3 * one, prefix="t1:")       # another process of the pod
    other = RedisTier(redis_server.url, 3 * one, prefix="t2:")   # another deployment
    assert a.put_async(NAMES[0], encoded(0)).result() and a.put(NAMES[1], encoded(1))
    assert b.contains(NAMES[0]) and not other.contains(NAMES[0])
    assert same_bits(decode_block(b.get(NAMES[1])).tensors, nvfp4_block(1))
    assert b.longest_prefix(NAMES[:3]) == 2 and b.contains_many(NAMES[:3]) == [True, True, False]
    b.get(NAMES[0])
    assert b.put(NAMES[2], encoded(2)) and b.put(NAMES[3], encoded(3))   # evicts 1, the LRU one
    assert a.longest_prefix(NAMES[:4]) == 1 and a.contains(NAMES[3]) and len(a) == 3
    assert a.used_bytes == 3 * one and b.stats["evictions"] == 1
    assert b.put(NAMES[3], encoded(3)) and a.used_bytes == 3 * one      # same name again: no-op
    assert a.delete(NAMES[3]) and a.used_bytes == 2 * one and not b.contains(NAMES[3])
    assert not a.put(NAMES[9], torch.zeros(4 * one, dtype=torch.uint8))
    a.r.set(a.key(NAMES[0]), b"garbage")                                 # corrupt value: a miss
    assert a.get(NAMES[0]) is None and a.stats["corrupt"] == 1 and not b.contains(NAMES[0])
    assert a.used_bytes == one
    a.clear()
    assert len(a) == 0 and a.used_bytes == 0


def test_redis_block_from_another_process(redis_server, tmp_path):
    from everybyte.kv.data.tiers import RedisTier
    path = tmp_path / "block.bin"
    path.write_bytes(bytes(encoded(4).numpy()))
    code = ("import sys; from everybyte.kv.data.tiers import RedisTier\n"
            "t = RedisTier(sys.argv[1], 1 << 30, prefix='pod:')\n"
            "assert t.put(bytes.fromhex(sys.argv[2]), open(sys.argv[3], 'rb').read())\n")
    subprocess.run([sys.executable, "-c", code, redis_server.url, NAMES[4].hex(), str(path)], check=True)
    t = RedisTier(redis_server.url, 1 << 30, prefix="pod:")
    assert same_bits(decode_block(t.get(NAMES[4])).tensors, nvfp4_block(4))


def test_redis_ttl(redis_server):
    from everybyte.kv.data.tiers import RedisTier
    t = RedisTier(redis_server.url, 1 << 30, prefix="ttl:", ttl_s=1)
    t.put(NAMES[0], encoded(0))
    assert t.r.ttl(t.key(NAMES[0])) in (1, 0, -2)          # set (-1: no TTL); -2: already expired
    time.sleep(1.2)
    assert t.get(NAMES[0]) is None
    assert t.put(NAMES[1], encoded(1)) and len(t) == 2      # expired entry reconciled at the LRU end later


def test_redis_down_is_a_miss_then_reconnects(redis_server, caplog):
    from everybyte.kv.data.tiers import RedisTier
    t = RedisTier(redis_server.url, 1 << 30, prefix="down:", retry_s=0.2, timeout_s=30)   # a stopped server refuses at once
    assert t.put(NAMES[0], encoded(0))
    redis_server.stop()                                      # the server dies mid-run
    assert t.get(NAMES[0]) is None
    assert t.put(NAMES[1], encoded(1)) is False
    assert t.contains(NAMES[0]) is False and t.longest_prefix(NAMES[:2]) == 0 and not t.delete(NAMES[0])
    assert t.used_bytes >= 0 and not t.available
    assert t.stats["errors"] >= 1
    assert sum("unavailable" in r.message for r in caplog.records) == 1
    redis_server.start()                                     # back, empty (no persistence)
    time.sleep(0.25)
    assert t.put(NAMES[1], encoded(1)) and t.available
    assert same_bits(decode_block(t.get(NAMES[1])).tensors, nvfp4_block(1))


# ---- config and bandwidth ------------------------------------------------------------------
def test_parse_kv_tiers():
    specs = parse_kv_tiers("shared:/mnt/x:100GiB,redis://127.0.0.1:6379/1?ttl=600&prefix=eb:8GiB,"
                           "disk:/tmp/kv:20GiB,host:2GiB,cold:/mnt/c:1TiB")
    assert [s.kind for s in specs] == ["host", "disk", "shared", "redis", "cold"]   # same level: as given
    assert [s.level for s in specs] == ["G2", "G3", "G3.5", "G3.5", "G4"]
    assert specs[0].capacity_bytes == 2 * 2**30 and specs[1].path == "/tmp/kv"
    specs[2], specs[3] = specs[3], specs[2]
    assert specs[2].url == "redis://127.0.0.1:6379/1" and specs[2].options == {"ttl_s": 600, "prefix": "eb"}
    assert specs[2].capacity_bytes == 8 * 2**30 and specs[4].capacity_bytes == 2**40
    assert parse_kv_tiers("host:500MB")[0].capacity_bytes == 500 * 10**6
    assert [s.kind for s in parse_kv_tiers(None)] == ["host"] and parse_kv_tiers("none") == []
    for bad in ("host", "host:2", "host:2XB", "disk:20GiB", "tape:/x:1GiB", "host:1GiB,host:2GiB",
                "redis://127.0.0.1:6379", "host:1GiB,,disk:/x:1GiB", "redis://h:1?ttl=x:1GiB", "host:0GiB"):
        with pytest.raises(ValueError):
            parse_kv_tiers(bad)


def test_build_tiers_and_bandwidth_probe(tmp_path):
    host, disk = build_tiers(f"host:64MiB,disk:{tmp_path}:64MiB", pin_memory=False)
    assert isinstance(host, HostTier) and isinstance(disk, DiskTier) and disk.level == "G3"
    for t in (host, disk):
        before = t.stats.to_dict()
        bw = measure_load_bandwidth(t, block_bytes=256 << 10, num_blocks=4)
        assert bw > 0 and len(t) == 0 and t.used_bytes == 0 and t.stats.to_dict() == before
    assert load_beats_recompute(1e9, 1000, 1e3) and not load_beats_recompute(1e3, 1000, 1e3)
    assert not load_beats_recompute(0.0, 1000, 1e3)


def test_tier_bookkeeping_imports_without_torch():
    """kv/tiers holds only the TierBackend interface: tier movement bookkeeping, the tier base and
    the memory manager over them load with torch blocked, and none of the backends comes along."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "import everybyte.kv.tier_movement, everybyte.kv.tiers.base, everybyte.kv.tiers\n"
            "import everybyte.kv.memory_manager, everybyte.kv.data.tiers\n"
            "assert not [m for m in sys.modules if m.startswith('everybyte.kv.data.tiers.')]")
    subprocess.run([sys.executable, "-c", code], check=True)
    root = Path(__file__).parents[1]
    control = sorted(p.relative_to(root).with_suffix("").as_posix().replace("/", ".")
                     for p in (root / "everybyte/kv").rglob("*.py") if "data" not in p.parts and p.stem != "__init__")
    assert "everybyte.kv.tiers.base" in control and "everybyte.kv.memory_manager" in control
    code = f"import sys; sys.modules['torch'] = None; import {', '.join(control)}"    # every kv/ module but kv/data
    subprocess.run([sys.executable, "-c", code], check=True)
