import json

import pytest

from everybyte.kv.block_id import KVNamespace, chain_block_ids
from everybyte.kv.data.tiers import DiskTier, HostTier
from everybyte.kv.ledger import G1_CATEGORIES, ByteLedger, waste_bytes
from everybyte.kv.prefix_cache import PrefixCache

NS = KVNamespace("m", block_size=4)


class Seq:
    def __init__(self, n, table):
        self.n, self.block_table = n, table

    def __len__(self):
        return self.n


def test_g1_split_adds_up_from_prefix_cache():
    cache = PrefixCache(10)
    running = cache.allocate(3)                       # a running request of 10 tokens in 3 blocks
    for b, name in zip(running[:2], chain_block_ids(NS, list(range(8)))):
        cache.commit(b, name, "s")
    done = cache.allocate(2)
    for b, name in zip(done, chain_block_ids(NS, [7] * 8)):
        cache.commit(b, name, "p")
    cache.free(done)
    cache.park("p", 123.0)
    other = cache.allocate(1)
    cache.commit(other[0], chain_block_ids(NS, [5] * 4)[0])
    cache.free(other)
    led = ByteLedger(block_bytes=1000, weights_bytes=5000)
    waste = waste_bytes([Seq(10, running)], 4, 250)
    assert waste == 2 * 250
    g1 = led.update_g1_from_cache(cache, waste_bytes=waste, padding_bytes=7)
    assert g1 == {"weights": 5000, "running_kv": 2500, "parked_kv": 2000, "cached_kv": 1000,
                  "free": 4000, "waste": 507}
    d = led.to_dict()
    assert d["g1"]["total"] == 5000 + 10 * 1000 + 7
    assert list(d["g1"])[:len(G1_CATEGORIES)] == list(G1_CATEGORIES)
    led.sample(t=1.0)
    assert led.history[-1]["t"] == 1.0 and led.history[-1]["parked_kv"] == 2000
    with pytest.raises(ValueError):
        led.update_g1(running_blocks=1, parked_blocks=0, cached_blocks=0, free_blocks=0, waste_bytes=2000)


def test_counters_and_tiers(tmp_path):
    led = ByteLedger(block_bytes=100)
    host, disk = HostTier(1 << 20, pin_memory=False), DiskTier(tmp_path, 1 << 20)
    led.add_tier(host)
    led.add_tier(disk)
    host.put(b"a" * 16, b"x" * 100)
    host.get(b"a" * 16)
    disk.put(b"b" * 16, b"y" * 50)
    with open(disk.path(b"b" * 16), "r+b") as f:
        f.write(b"zzzz")
    assert disk.get(b"b" * 16) is None
    led.record_prefill(120, {"G1": 64, "G2": 32})
    led.record_prefill(8, {"G3": 16})
    led.record_move("G1", "write", 4096)
    led.count("evicted", 3)
    led.count("parked", 2)
    led.count("prestaged", 2, tier="G2")
    with pytest.raises(ValueError):
        led.count("teleported")
    with pytest.raises(ValueError):
        led.record_move("G2", "sideways", 1)
    d = led.to_dict()
    json.dumps(d)
    assert d["prefill_tokens"] == {"computed": 128, "reused": {"G1": 64, "G2": 32, "G3": 16},
                                   "reused_total": 112, "reuse_fraction": 112 / 240}
    assert d["tiers"]["G2"]["used_bytes"] == 100 and d["tiers"]["G2"]["capacity_bytes"] == 1 << 20
    assert d["tiers"]["G3"]["corrupt"] == 1 and d["tiers"]["G3"]["used_bytes"] == 0
    assert d["bytes_moved"]["G1"] == {"read": 0, "write": 4096}
    assert d["bytes_moved"]["G2"] == {"read": 100, "write": 100}
    assert d["blocks"]["evicted"] == 3 and d["blocks"]["parked"] == 2 and d["blocks"]["prestaged"] == 2
    assert d["blocks"]["corrupt"] == 1 and d["blocks_by_tier"]["corrupt"] == {"G3": 1}
