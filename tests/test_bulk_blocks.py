"""Batches of blocks between the pool and the tiers (no model): the pool codec's bulk store and
load, host buffers holding a batch, disk packs read back with one call."""
import os
import random

import pytest
import torch

from everybyte.kv.block_id import KVNamespace, chain_block_ids
from everybyte.kv.data.pool import KVPool
from everybyte.kv.data.tiers import CorruptBlock, DiskTier, FormatMismatch, HostTier, decode_block
from everybyte.kv.data.tiers.disk import RING_SLOTS, STREAM_BYTES, read_pack_table
from everybyte.kv.data.tiers.pool_codec import block_tensors, pool_codec

SHAPES = [(3, 64)] * 6
NAMES = chain_block_ids(KVNamespace("m", block_size=16), list(range(16 * 40)))


def random_pool(fmt="nvfp4", seed=0) -> KVPool:
    pool = KVPool(SHAPES, fmt, "4MiB", 16)
    g = torch.Generator().manual_seed(seed)
    for st in pool.stacks:
        st.tensor.view(torch.uint8).copy_(torch.randint(0, 256, st.tensor.view(torch.uint8).shape, generator=g,
                                                        dtype=torch.uint8))
    return pool


def same_block(a: KVPool, i: int, b: KVPool, j: int) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
               for x, y in zip(block_tensors(a, i).values(), block_tensors(b, j).values()))


@pytest.mark.parametrize("fmt", ["nvfp4", "fp16"])
def test_pool_fields_are_stacked_and_layers_are_views(fmt):
    pool = KVPool(SHAPES, fmt, "4MiB", 16)
    assert len(pool.stacks) == len(pool.k[0]) and all(len(st.members) == 2 * len(SHAPES) for st in pool.stacks)
    for st in pool.stacks:
        for row, (kv, layer) in enumerate(st.members):
            t = (pool.k if kv == "k" else pool.v)[layer][st.key]
            assert t.is_contiguous() and t.data_ptr() == st.tensor[row].data_ptr()


@pytest.mark.parametrize("fmt", ["nvfp4", "fp16"])
def test_bulk_store_and_load_any_block_order(fmt):
    src, dst = random_pool(fmt, 1), random_pool(fmt, 2)
    codec, other = pool_codec(src), pool_codec(dst)
    ids = [3, 4, 5, 9, 0, 1, 20]
    batch = codec.store(ids, NAMES[:len(ids)])
    assert batch.shape == (len(ids), codec.nbytes)
    for i, row in enumerate(batch):                      # every row is a plain, checksummed block
        d = decode_block(row, verify=True, expect_format=fmt)
        assert d.name == NAMES[i] and d.tensors.keys() == block_tensors(src, ids[i]).keys()
    shifted = torch.empty(batch.numel() + 4, dtype=torch.uint8)           # rows 4-byte but not 8-byte aligned
    shifted[4:] = batch.view(-1)
    shifted = shifted[4:].view(batch.shape)
    for targets in ([10, 11, 12, 13, 14, 15, 16], random.Random(0).sample(range(40), len(ids))):
        for bufs in ([row for row in batch], [row.clone() for row in batch], list(shifted)):  # one buffer / scattered
            assert other.check_many(bufs, NAMES[:len(ids)]) == (len(ids), None)
            other.load(bufs, targets)
            assert all(same_block(src, i, dst, t) for i, t in zip(ids, targets))
            third = random_pool(fmt, 3)
            assert pool_codec(third).load_checked(bufs, NAMES[:len(ids)], targets) == (len(ids), None)
            assert all(same_block(src, i, third, t) for i, t in zip(ids, targets))


def test_check_stops_at_the_first_bad_block_and_names_mismatches():
    pool = random_pool()
    codec = pool_codec(pool)
    batch = codec.store([0, 1, 2, 3], NAMES[:4])
    bufs = [row for row in batch]
    assert codec.check_many(bufs, NAMES[:2] + [NAMES[9]] + NAMES[3:4])[0] == 2     # wrong name
    bad = batch.clone()
    bad[1, 2] ^= 0xFF                                       # magic of the second block
    good, err = codec.check_many([row for row in bad], NAMES[:4])
    assert good == 1 and isinstance(err, CorruptBlock)
    other = random_pool(seed=5)
    untouched = random_pool(seed=5)
    good, err = pool_codec(other).load_checked([row for row in bad], NAMES[:4], [10, 11, 12, 13])
    assert good == 1 and isinstance(err, CorruptBlock) and same_block(pool, 0, other, 10)
    assert all(same_block(other, b, untouched, b) for b in (11, 12, 13))          # nothing past it
    bad = batch[2].clone()
    bad[-5] ^= 1                                            # payload: only a checksum sees it
    assert codec.check_many([bad], [NAMES[2]])[0] == 1
    assert codec.check_many([bad], [NAMES[2]], verify=True)[0] == 0
    good, err = codec.check_many([batch[0], batch[1, :100]], NAMES[:2])                # short block
    assert good == 1 and isinstance(err, CorruptBlock)
    with pytest.raises(FormatMismatch, match="nvfp4, expected fp16"):
        pool_codec(random_pool("fp16")).check(batch[0])
    fewer = KVPool(SHAPES[:-1], "nvfp4", "4MiB", 16)
    with pytest.raises(FormatMismatch, match="layers"):
        pool_codec(fewer).check(batch[0])


def test_host_tier_keeps_a_batch_as_one_buffer():
    codec = pool_codec(random_pool())
    batch = codec.store(list(range(8)), NAMES[:8])
    spilled = []
    host = HostTier(20 * codec.nbytes, pin_memory=False)
    host.on_evict_many = lambda names, datas: spilled.append(list(names))
    assert host.put_many(NAMES[:8], batch) == [True] * 8
    got = host.get_many(NAMES[:8])
    assert all(g.untyped_storage().data_ptr() == batch.untyped_storage().data_ptr() for g in got)
    assert host.used_bytes == batch.numel() and len(host) == 8
    assert host.put_many(NAMES[8:18], codec.store(list(range(10)), NAMES[8:18])) == [True] * 10
    assert host.delete(NAMES[0]) and host.used_bytes == 18 * codec.nbytes       # the buffer stays whole
    host.put_many(NAMES[20:24], codec.store(list(range(4)), NAMES[20:24]))         # evicts the oldest batch
    assert spilled == [NAMES[1:8]] and not host.contains(NAMES[3]) and host.used_bytes == 14 * codec.nbytes


def test_disk_pack_is_read_back_in_one_buffer(tmp_path):
    codec = pool_codec(random_pool())
    batch = codec.store(list(range(6)), NAMES[:6])
    disk = DiskTier(tmp_path, 1 << 30)
    assert disk.put_many(NAMES[:6], batch) == [True] * 6
    packs = list(tmp_path.rglob("*.kvp"))
    assert len(packs) == 1 and len(read_pack_table(str(packs[0]))) == 6
    got = disk.get_many(NAMES[:6])
    assert len({g.untyped_storage().data_ptr() for g in got}) == 1                  # one read, one buffer
    assert all(torch.equal(g, row) for g, row in zip(got, batch))
    restarted = DiskTier(tmp_path, 1 << 30)
    assert len(restarted) == 6 and restarted.used_bytes == disk.used_bytes == os.path.getsize(packs[0])
    offset, size = read_pack_table(str(packs[0]))[NAMES[3]]
    with open(packs[0], "r+b") as f:                        # one damaged block inside the pack
        f.seek(offset + size // 2)
        byte = f.read(1)
        f.seek(offset + size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    got = restarted.get_many(NAMES[:6])
    assert [g is not None for g in got] == [True, True, True, False, True, True]
    assert restarted.stats["corrupt"] == 1 and not restarted.contains(NAMES[3]) and len(restarted) == 5
    for name in NAMES[:6]:
        restarted.delete(name)
    assert not list(tmp_path.rglob("*.kvp")) and restarted.used_bytes == 0


def big_pack(tmp_path, n=40, size=200_000):
    """A disk tier holding one pack of n random blocks (over RING_SLOTS * STREAM_BYTES: read in the
    background, through a ring when the reader lends a scratch buffer)."""
    g = torch.Generator().manual_seed(7)
    batch = torch.randint(0, 256, (n, size), dtype=torch.uint8, generator=g)
    disk = DiskTier(tmp_path, 1 << 30)
    assert disk.put_many(NAMES[:n], batch) == [True] * n
    return disk, batch


@pytest.fixture(params=["c", "python"])
def reader_kind(request, monkeypatch):
    """Each disk stream test runs with the C reader (no GIL) and with the pure-Python fallback."""
    from everybyte.kv.data.tiers import disk, reader, reader_native
    if request.param == "c" and not reader_native.available():
        pytest.skip(f"C disk reader unavailable: {reader_native.error()}")
    if request.param == "python":
        monkeypatch.setattr(disk, "new_progress", reader.Progress)
    return request.param


def checked_stream(stream, batch) -> list[int]:
    """Consume a stream checking each batch before asking for the next (the tier may then reuse
    its buffers); the indices seen."""
    seen = []
    for part in stream:
        assert all(torch.equal(buf, batch[i]) for i, buf in part)
        seen += [i for i, _ in part]
    return seen


def test_disk_stream_hands_on_a_pack_in_parts_as_it_is_read(tmp_path, reader_kind):
    disk, batch = big_pack(tmp_path)
    parts = list(disk.get_stream(NAMES[:40]))
    assert len(parts) > 2 and sorted(i for part in parts for i, _ in part) == list(range(40))
    arena = torch.empty(8 << 20, dtype=torch.uint8)
    lent = []
    scratch = lambda n: lent.append(n) or arena[:n]                       # noqa: E731
    ptrs = set()
    for part in disk.get_stream(NAMES[:40], scratch):
        assert all(torch.equal(buf, batch[i]) for i, buf in part)
        ptrs |= {buf.untyped_storage().data_ptr() for _, buf in part}
    assert ptrs == {arena.untyped_storage().data_ptr()}
    assert lent == [lent[0]] and lent[0] <= RING_SLOTS * STREAM_BYTES < 40 * 200_000   # a ring, not all 8 MB
    assert sorted(checked_stream(disk.get_stream(NAMES[:40], scratch), batch)) == list(range(40))


def test_disk_stream_closed_early_and_a_short_pack_is_a_miss_from_where_it_ends(tmp_path, reader_kind):
    disk, batch = big_pack(tmp_path)
    arena = torch.empty(8 << 20, dtype=torch.uint8)
    stream = disk.get_stream(NAMES[:40], lambda n: arena[:n])
    first = next(stream)
    assert first and all(torch.equal(buf, batch[i]) for i, buf in first)
    stream.close()                                  # the consumer stops: the reader (waiting on the ring) too
    (pack,) = tmp_path.rglob("*.kvp")
    offset, size = read_pack_table(str(pack))[NAMES[30]]
    os.truncate(pack, offset + size // 2)           # the file ends inside block 30
    got = disk.get_many(NAMES[:40])
    assert all(torch.equal(got[i], batch[i]) for i in range(30)) and got[30:] == [None] * 10
    assert disk.stats["corrupt"] >= 1


def test_read_plan_groups_frames_and_places_them_in_a_ring():
    from everybyte.kv.data.tiers.reader import plan
    frames = [(i, 3) for i in range(5)]
    pieces, size = plan(frames, 100, 6, slots=2)
    assert [([i for i, _ in g], start, n) for g, start, n, _ in pieces] == [([0, 1], 0, 6), ([2, 3], 6, 6), ([4], 12, 3)]
    assert size == 12 and [p for *_, p in pieces] == [(100, 0, 6, 0), (106, 6, 6, 0), (112, 0, 3, 6)]
    pieces, size = plan(frames, 100, 6, slots=3)          # a ring as long as the range: read it straight
    assert size == 15 and [p for *_, p in pieces] == [(100, 0, 6, 0), (106, 6, 6, 0), (112, 12, 3, 0)]
    assert plan([(0, 9), (1, 2)], 0, 6)[0][0][2] == 9      # a frame over piece_bytes is a piece alone


def test_loader_takes_a_pack_whose_blocks_lie_in_another_order(tmp_path, reader_kind):
    """The pack holds the chain backwards: the disk streams the last blocks first, through a ring
    it reuses, so the loader keeps copies of blocks it cannot load yet; every block lands right."""
    from everybyte.kv.data.block_loader import BlockLoader
    from everybyte.kv.tier_movement import TierSet
    shapes = [(3, 64)] * 60                                  # ~200 KB blocks: an 8 MB pack, read via a ring
    src, dst = KVPool(shapes, "nvfp4", "16MiB", 16), KVPool(shapes, "nvfp4", "16MiB", 16)
    g = torch.Generator().manual_seed(5)
    for st in src.stacks:
        st.tensor.view(torch.uint8).copy_(torch.randint(0, 256, st.tensor.view(torch.uint8).shape, generator=g,
                                                        dtype=torch.uint8))
    names, ids = NAMES[:40], list(range(40))
    disk = DiskTier(tmp_path, 1 << 30)
    assert disk.put_many(names[::-1], pool_codec(src).store(ids[::-1], names[::-1])) == [True] * 40
    assert pool_codec(src).nbytes * 40 > RING_SLOTS * STREAM_BYTES
    loader = BlockLoader(dst, TierSet([disk]))
    targets = [i + 1 for i in ids]
    job = loader.start(names, targets)
    job.future.result()
    loader.finished()
    assert job.loaded == ["G3"] * 40 and not job.corrupt
    assert all(same_block(src, i, dst, t) for i, t in zip(ids, targets))


def test_loader_scratch_is_one_reused_buffer_per_thread(monkeypatch):
    import threading

    from everybyte.kv.data import block_loader
    local = threading.local()
    job = block_loader._Scratch(local)
    a = job(3000)
    assert job(1000).data_ptr() == a.data_ptr() == block_loader._Scratch(local)(3000).data_ptr()
    b = job(10_000)                                      # larger: it grows, and stays grown
    assert b.numel() == 10_000 and local.arena.numel() == 10_000 and job(5000).data_ptr() == b.data_ptr()
    monkeypatch.setattr(block_loader, "SCRATCH_MAX", 20_000)
    c = job(30_000)                                      # past the cap: allocated, the buffer kept as is
    assert c.numel() == 30_000 and local.arena.numel() == 10_000


def test_disk_reader_without_a_compiler_falls_back_to_python(monkeypatch, tmp_path):
    """The C reader is its own library (native/csrc/disk_reader.c): where it cannot be built, a
    warning says why and the disk tier reads through the Python Progress, with the same bytes."""
    from everybyte.kv.data.tiers import reader, reader_native
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("EVERYBYTE_HOME", str(tmp_path))
    reader_native._loaded.cache_clear()
    try:
        with pytest.warns(UserWarning, match="C disk reader unavailable"):
            assert not reader_native.available()
        assert "no-such-cc" in reader_native.error() and type(reader.new_progress()) is reader.Progress
        disk = DiskTier(tmp_path / "g3", 1 << 30)
        batch = torch.randint(0, 256, (3, 5000), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
        assert disk.put_many(NAMES[:3], batch) == [True] * 3
        assert sorted(checked_stream(disk.get_stream(NAMES[:3]), batch)) == [0, 1, 2]
    finally:
        reader_native._loaded.cache_clear()                 # later tests build the real one


@pytest.mark.parametrize("dst_offset", [0, 8])
def test_chunk_copy_kernel_matches_torch(dst_offset):
    from everybyte.formats import cpu_kernels
    if not cpu_kernels.available():
        pytest.skip(f"C kernels unavailable: {cpu_kernels.error()}")
    g = torch.Generator().manual_seed(3)
    src = torch.randint(0, 256, (5 * 1000 + 64,), dtype=torch.uint8, generator=g)
    view = src.as_strided((3, 5, 96), (96, 1000, 1), 64)        # 3 rows of 96-byte chunks in 5 blocks
    pool = torch.zeros(3 * 12 * 96 + dst_offset, dtype=torch.uint8)
    dst = pool[dst_offset:].view(3, 12, 96)[:, 4:9]              # 32-byte aligned (streamed) or not
    assert cpu_kernels.copy_chunks(dst, view)
    assert torch.equal(dst, view) and int(pool[:dst_offset].sum()) == 0
    assert torch.count_nonzero(pool[dst_offset:].view(3, 12, 96)[:, :4]) == 0
    assert not cpu_kernels.copy_chunks(dst.float(), view.float())       # not bytes: the caller copies


def test_loading_an_empty_batch_is_a_no_op():
    """A batch whose every block came back corrupt (a Redis tier answers None for each) loads
    nothing; it used to reach torch._foreach_copy_ with no tensors and raise."""
    pool = random_pool()
    assert pool_codec(pool).load_checked([], [], []) == (0, None)
    pool_codec(pool).load([], [])
