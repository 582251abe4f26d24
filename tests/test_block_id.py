import subprocess
import sys

import pytest

from everybyte.kv.block_id import NAME_BYTES, KVNamespace, block_id, chain_block_ids, name_from_hex, name_hex

NS = KVNamespace("HuggingFaceTB/SmolLM2-135M-Instruct", "main", "nvfp4", 16, "all")
TOKENS = list(range(1000, 1000 + 16 * 5 + 7))


def test_full_blocks_only_and_chained():
    names = chain_block_ids(NS, TOKENS)
    assert len(names) == 5 and all(len(n) == NAME_BYTES for n in names)
    assert len(set(names)) == 5
    assert chain_block_ids(NS, TOKENS[:15]) == []
    assert chain_block_ids(NS, TOKENS[:16 * 3]) == names[:3]
    assert names[0] == block_id(NS, None, TOKENS[:16])
    assert names[1] == block_id(NS, names[0], TOKENS[16:32])
    with pytest.raises(ValueError):
        block_id(NS, None, TOKENS[:15])


def test_incremental_equals_full():
    names = chain_block_ids(NS, TOKENS)
    assert chain_block_ids(NS, TOKENS, parent=names[1], start_block=2) == names[2:]
    with pytest.raises(ValueError):
        chain_block_ids(NS, TOKENS, start_block=2)
    with pytest.raises(ValueError):
        chain_block_ids(NS, TOKENS, block_size=32)


def test_name_depends_on_parent_and_every_namespace_field():
    base = chain_block_ids(NS, TOKENS)[1]
    # same tokens in block 1 but a different first block -> different name
    other = TOKENS[:]
    other[0] += 1
    assert chain_block_ids(NS, other)[1] != base
    variants = [KVNamespace("other-model", "main", "nvfp4", 16), KVNamespace(NS.model_id, "v2", "nvfp4", 16),
                KVNamespace(NS.model_id, "main", "fp16", 16), KVNamespace(NS.model_id, "main", "nvfp4", 16, "pp0/2"),
                KVNamespace(NS.model_id, "main", "nvfp4", 16, kv_fingerprint="abc"), NS.with_tenant("acme")]
    assert len({chain_block_ids(v, TOKENS)[1] for v in variants} | {base}) == len(variants) + 1
    assert chain_block_ids(KVNamespace(NS.model_id, "main", "nvfp4", 8), TOKENS)[0] != chain_block_ids(NS, TOKENS)[0]


def test_tenant_salts_never_collide():
    salts = [None, "", "a", "b", b"a\x00", "tenant-1", "tenant-2"] + [f"t{i}" for i in range(200)]
    firsts = {chain_block_ids(NS.with_tenant(s), TOKENS[:16])[0] for s in salts}
    # "" and None differ; str and bytes of the same content are the same tenant
    assert len(firsts) == len(salts)
    assert chain_block_ids(NS.with_tenant("a"), TOKENS) == chain_block_ids(NS.with_tenant(b"a"), TOKENS)


def test_token_packing_is_unambiguous():
    ns = KVNamespace("m", block_size=2)
    assert block_id(ns, None, [1, 2]) != block_id(ns, None, [2, 1])
    assert block_id(ns, None, [0, 2**31 - 1]) != block_id(ns, None, [2**31 - 1, 0])
    assert block_id(ns, None, [0, -1]) != block_id(ns, None, [-1, 0])
    assert block_id(ns, None, [1, 256]) != block_id(ns, None, [256, 1])


def test_same_ids_in_another_process():
    code = ("from everybyte.kv.block_id import KVNamespace, chain_block_ids\n"
            "ns = KVNamespace('HuggingFaceTB/SmolLM2-135M-Instruct', 'main', 'nvfp4', 16, 'all', 'acme')\n"
            f"print(','.join(n.hex() for n in chain_block_ids(ns, {TOKENS!r})))\n")
    env_variants = [{"PYTHONHASHSEED": "1"}, {"PYTHONHASHSEED": "12345"}]
    expected = ",".join(n.hex() for n in chain_block_ids(NS.with_tenant("acme"), TOKENS))
    import os
    for extra in env_variants:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, **extra})
        assert out.stdout.strip() == expected


def test_for_pool_fingerprint_tracks_scales():
    class FakePool:
        kv_cache_dtype, block_size = "nvfp4", 16
        layer_shapes = [(3, 64)] * 2
        k_scales, v_scales = [1.0, 1.0], [1.0, 1.0]
    p = FakePool()
    a = KVNamespace.for_pool(p, "m")
    p.k_scales = [1.0, 0.5]
    b = KVNamespace.for_pool(p, "m")
    assert a.kv_fingerprint != b.kv_fingerprint and a.digest != b.digest
    assert a.kv_format == "nvfp4" and a.block_size == 16


def test_hex_round_trip():
    n = chain_block_ids(NS, TOKENS)[0]
    assert name_from_hex(name_hex(n)) == n
    with pytest.raises(ValueError):
        name_from_hex("abcd")


@pytest.mark.parametrize("name_hash", ["blake2b", "mix128"])
def testcompiled_names_equal_hashlib(name_hash):
    """The compiled chain against the hashlib reference (kv/block_mix's for mix128): odd block
    sizes, salts, parents, extreme tokens."""
    import random

    from everybyte.kv import block_id as B
    if B.compiled_names() is None:
        pytest.skip("the compiled block names do not build here")
    r = random.Random(7)
    for trial in range(300):
        bs = r.choice([1, 2, 3, 7, 16, 17, 32, 64])
        ns = KVNamespace(f"m{trial}", block_size=bs, tenant_salt=r.choice([None, "", "t", "x" * 200]),
                         name_hash=name_hash)
        toks = [r.choice([0, 1, -1, 2**31 - 1, -2**31, r.randrange(-2**31, 2**31), r.randrange(50000)])
                for _ in range(r.randrange(0, 40 * bs))]
        start = r.randrange(0, 4)
        parent = None if start == 0 else r.randbytes(NAME_BYTES)
        end = len(toks) // bs
        want = B._chain_hashlib(ns, toks, bs, parent or B.ROOT_PARENT, start, end) if end > start else []
        assert chain_block_ids(ns, toks, parent=parent, start_block=start) == want, trial


def testcompiled_names_bad_tokens_raise_as_hashlib_does():
    import struct

    from everybyte.kv import block_id as B
    ns = KVNamespace("m", block_size=2)
    for bad in ([1, 2**31], [1, -2**31 - 1], [1, 2**63], [1.0, 2], ["a", 1]):
        with pytest.raises(struct.error):
            chain_block_ids(ns, bad)
    if B.compiled_names() is not None:
        with pytest.raises(ValueError, match="bad parent"):
            B.compiled_names().chain(b"p", b"short", [1, 2], 0, 2, 2, b"everybyte.kv")
        with pytest.raises(ValueError, match="past the tokens"):
            B.compiled_names().chain(b"p", bytes(NAME_BYTES), [1, 2], 0, 4, 2, b"everybyte.kv")


def test_block_names_fall_back_to_hashlib(monkeypatch):
    from everybyte.kv import block_id as B
    want = chain_block_ids(NS, TOKENS)
    monkeypatch.setenv("EVERYBYTE_NATIVE_NAMES", "0")
    B.compiled_names.cache_clear()
    try:
        assert B.compiled_names() is None
        assert chain_block_ids(NS, TOKENS) == want
        assert want[0].hex() == block_id(NS, None, TOKENS[:16]).hex()
    finally:
        B.compiled_names.cache_clear()
