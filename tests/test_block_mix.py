"""mix128 block names (the simulator's, kv/block_mix): known answers, the algorithm is part of the
namespace, and ordinary token streams do not collide (compiled against the Python reference:
test_block_id)."""
import random
import struct

import pytest

from everybyte.kv.block_id import KVNamespace, block_id, chain_block_ids

MODEL = ("HuggingFaceTB/SmolLM2-135M-Instruct", "main", "nvfp4", 16, "all")
TOKENS = list(range(1000, 1032))


def test_known_names_of_both_hashes():
    """Fixed answers: the default (BLAKE2b) namespace's digest and names are what they were before
    name_hash existed; mix128's are pinned so the compiled and Python paths cannot drift together."""
    ns, mix = KVNamespace(*MODEL), KVNamespace(*MODEL, name_hash="mix128")
    assert ns.digest.hex() == "90e0f1e839ae18d64592e64811588874"
    assert chain_block_ids(ns, TOKENS)[1].hex() == "52f3a2a6328da8db781c6a4e286982d3"
    assert chain_block_ids(mix, TOKENS)[1].hex() == "0113e4296901d42530b579c4c6965fe1"
    assert block_id(mix, None, TOKENS[:16]) == chain_block_ids(mix, TOKENS)[0]


def test_the_hash_is_part_of_the_namespace():
    ns, mix = KVNamespace(*MODEL), KVNamespace(*MODEL, name_hash="mix128")
    assert ns.digest != mix.digest and ns != mix
    assert mix.with_tenant("acme").name_hash == "mix128"
    assert not set(chain_block_ids(ns, TOKENS)) & set(chain_block_ids(mix, TOKENS))
    with pytest.raises(ValueError, match="name_hash must be one of blake2b, mix128"):
        KVNamespace("m", name_hash="md5")
    for bad in ([1, 2**31], [1.0, 2]):
        with pytest.raises(struct.error):
            chain_block_ids(KVNamespace("m", block_size=2, name_hash="mix128"), bad)


def test_no_collisions_and_every_bit_counts():
    """200,000 names of blocks one token apart (every position, many values) and of counters are all
    distinct; flipping one bit of one token flips about half the name's 128 bits."""
    ns = KVNamespace("m", name_hash="mix128")
    r = random.Random(3)
    base = [r.randrange(30000) for _ in range(16)]
    names, blocks = set(), set()
    for pos in range(16):
        for v in range(10000):
            toks = base[:pos] + [v] + base[pos + 1:]
            names.add(block_id(ns, None, toks))
            blocks.add(tuple(toks))
    names.update(chain_block_ids(ns, list(range(16 * 40000))))
    assert len(names) == len(blocks) + 40000            # (the base block may recur at several positions)
    flips = []
    for _ in range(500):
        toks = [r.randrange(-2**31, 2**31) for _ in range(16)]
        i, bit = r.randrange(16), r.randrange(32)
        other = toks[:i] + [struct.unpack("<i", struct.pack("<I", (toks[i] & 0xFFFFFFFF) ^ 1 << bit))[0]] + toks[i + 1:]
        a, b = block_id(ns, None, toks), block_id(ns, None, other)
        flips.append(bin(int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).count("1"))
    assert 60 < sum(flips) / len(flips) < 68 and min(flips) > 30
