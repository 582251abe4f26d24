"""KV events (kv/events): the prefix cache reports each block it names, forgets and clears, in
vLLM's schema, and a real engine's events carry the namespace digest its stats state."""
import subprocess
import sys
from pathlib import Path

import pytest

from everybyte.kv.block_id import KVNamespace, chain_block_ids
from everybyte.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventLog, coalesce
from everybyte.kv.prefix_cache import PrefixCache

NS = KVNamespace("m", block_size=4)


def test_stored_removed_cleared():
    log = EventLog(NS.digest)
    cache = PrefixCache(3, on_event=log, block_size=4)
    a, b = chain_block_ids(NS, [1] * 8), chain_block_ids(NS, [2] * 8)
    blocks = cache.allocate(2)
    for blk, name in zip(blocks, a):
        cache.commit(blk, name)
    assert cache.commit(cache.allocate(1)[0], a[0]) == blocks[0]          # a duplicate name: no event
    batch = log.drain()
    assert batch.namespace == NS.digest
    assert batch.events == [BlockStored([a[0]], 4), BlockStored([a[1]], 4)]
    cache.free(blocks)
    cache.free([2])
    new = cache.allocate(2)                     # one empty block, then one evicted: a[0] (LRU) goes
    cache.commit(new[0], b[0])
    events = log.drain().events
    assert BlockRemoved([a[1]]) in events or BlockRemoved([a[0]]) in events
    assert BlockStored([b[0]], 4) in events
    cache.free(new)
    cache.clear()
    assert log.drain().events == [AllBlocksCleared()]
    assert log.drain().events == []


CONTROL_PLANE = ["everybyte.kv.block_id", "everybyte.kv.prefix_cache", "everybyte.kv.prefix_sessions",
                 "everybyte.kv.prefix_core",
                 "everybyte.kv.eviction", "everybyte.kv.parked_runs", "everybyte.kv.sessions", "everybyte.kv.ledger", "everybyte.kv.events",
                 "everybyte.kv.event_run",
                 "everybyte.kv.clock", "everybyte.kv.mover", "everybyte.kv.connector", "everybyte.kv.block_manager",
                 "everybyte.kv.seq_state", "everybyte.kv.session_ops", "everybyte.kv.memory_manager",
                 "everybyte.kv.tier_movement", "everybyte.engine.scheduler", "everybyte.engine.core", "everybyte.formats.sizes", "everybyte.models.expert_ledger",
                 "everybyte.sim.hardware", "everybyte.sim.cost_model", "everybyte.sim.models",
                 "everybyte.sim.calibration", "everybyte.sim.link_lanes",
                 "everybyte.engine.sequence", "everybyte.engine.decode_run", "everybyte.kv.name_memo",
                 "everybyte.sim.executor", "everybyte.sim.runner", "everybyte.sim.worker",
                 "everybyte.native.compiled"]
# = pyproject [tool.mypy] files: the strictly typed, torch-free modules


def test_control_plane_imports_without_torch():
    code = f"import sys; sys.modules['torch'] = None; import {', '.join(CONTROL_PLANE)}"
    subprocess.run([sys.executable, "-c", code], check=True)
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in Python 3.11+")
    with open(Path(__file__).parents[1] / "pyproject.toml", "rb") as f:
        files = tomllib.load(f)["tool"]["mypy"]["files"]
    assert [m.replace(".", "/") + ".py" for m in CONTROL_PLANE] == files


def test_engine_events_carry_its_namespace():
    from everybyte import LLM, SamplingParams
    llm = LLM(kv_cache_bytes="16MiB", max_model_len=256, kv_tiers="none")
    log = llm.block_manager.kv_events()
    llm.generate(["word " * 40], SamplingParams(temperature=0, max_tokens=4))
    batch = log.drain()
    stored = [h for e in batch.events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert len(stored) >= 2 and all(len(h) == 16 for h in stored)
    assert batch.namespace.hex() == llm.stats()["memory"]["kv_namespace"]
    llm.reset_prefix_cache()
    assert any(isinstance(e, (AllBlocksCleared, BlockRemoved)) for e in log.drain().events)
    llm.close()


def per_block(events, bs):
    """(name, parent, tokens) of each block the G1 BlockStored events name, in order: a coalesced
    event's block k has the one before it as parent and its slice of the event's tokens."""
    out = []
    for e in events:
        if isinstance(e, BlockStored) and e.medium == "G1":
            parent = e.parent_block_hash
            for k, h in enumerate(e.block_hashes):
                out.append((h, parent, e.token_ids[k * bs:(k + 1) * bs]))
                parent = h
    return out


def test_engine_events_carry_tokens_parents_and_tier_moves():
    """G1 BlockStored events chain (parent = the previous block's name) and carry the blocks'
    tokens, a prompt's blocks in one event; a block written down to G2 is a BlockRemoved(G1) plus
    a BlockStored(G2); loading it back is a BlockStored(G1) again, with its tokens."""
    from everybyte import LLM, SamplingParams
    llm = LLM(kv_cache_bytes="16MiB", max_model_len=256, kv_tiers="host:64MiB")
    log = llm.block_manager.kv_events()
    prompt = llm.tokenizer.encode("alpha beta gamma delta " * 12)
    bs = llm.block_manager.block_size
    greedy = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([prompt], greedy)
    events = log.drain().events
    assert all(e.medium == "G1" for e in events if isinstance(e, BlockStored))
    n = len(prompt) // bs
    assert len(events[0].block_hashes) == n                        # the prefill's run: one event
    stored = per_block(events, bs)
    assert [t for _, _, t in stored[:n]] == [prompt[i * bs:(i + 1) * bs] for i in range(n)]
    names = [h for h, _, _ in stored]
    assert stored[0][1] is None
    assert [p for _, p, _ in stored[1:]] == names[:-1]
    llm.reset_prefix_cache()
    llm.generate(["x"], SamplingParams(max_tokens=1))            # collects the write-down
    events = log.drain().events
    removed = {h for e in events if isinstance(e, BlockRemoved) and e.medium == "G1" for h in e.block_hashes}
    down = {h for e in events if isinstance(e, BlockStored) and e.medium == "G2" for h in e.block_hashes}
    assert set(names[:n]) <= removed and set(names[:n]) <= down
    out = llm.generate([prompt], greedy)[0]
    assert out.num_cached_tokens >= bs
    back = per_block(log.drain().events, bs)
    first = next(b for b in back if b[0] == names[0])
    assert first[2] == prompt[:bs]
    llm.close()


def test_tier_events_report_each_medium(redis_server):
    """TierSet reports what enters and leaves each tier: G1 evictions stored in G2, what G2 evicts,
    write-through to the pod-shared G3.5, what Redis evicts to fit, and deletions."""
    from everybyte.kv.data.tiers.host import HostTier
    from everybyte.kv.data.tiers.redis_store import RedisTier
    from everybyte.kv.tier_movement import TierSet
    one = 256
    names = chain_block_ids(NS, list(range(16)))
    datas = [bytes([i]) * one for i in range(4)]
    host = HostTier(2 * one, pin_memory=False)
    pod = RedisTier(redis_server.url, 2 * (one + 24), prefix="events:")      # 24: the frame header
    tiers = TierSet([host, pod])
    log = EventLog(NS.digest)
    tiers.on_event, tiers.block_size = log, 4
    tiers.put_down(names[:3], datas[:3])             # the third evicts the first from G2
    tiers.write_through_blocks(names[:3], datas[:3])
    tiers.flush()
    events = log.drain().events
    # a put that evicts a block of its own batch: stored first, then removed, so the last word is right
    assert [e for e in events if e.medium == "G2"] == [BlockStored(names[:3], 4, medium="G2"),
                                                      BlockRemoved([names[0]], "G2")]
    assert [e for e in events if e.medium == "G3.5"] == [BlockStored(names[:3], 4, medium="G3.5"),
                                                        BlockRemoved([names[0]], "G3.5")]   # Redis made room
    tiers.delete_everywhere([names[1]])
    assert log.drain().events == [BlockRemoved([names[1]], "G2"), BlockRemoved([names[1]], "G3.5")]
    pod.close()


def test_coalesce_merges_chains_and_removals_in_order():
    a, b = chain_block_ids(NS, list(range(12))), chain_block_ids(NS, [9] * 8)
    events = [BlockStored([a[0]], 4, None, token_ids=[0, 1, 2, 3]),
              BlockStored([a[1]], 4, a[0], token_ids=[4, 5, 6, 7]),
              BlockStored([b[0]], 4, None, token_ids=[9] * 4),                # another chain: kept apart
              BlockStored([a[2]], 4, a[1], token_ids=[8, 9, 10, 11]),         # not after its parent here
              BlockRemoved([a[0]]), BlockRemoved([a[1]]), BlockRemoved([b[0]], "G2"),
              BlockStored([a[0], a[1]], 4, medium="G2"), BlockStored([a[2]], 4, a[1], medium="G2")]
    assert coalesce(events) == [
        BlockStored(a[:2], 4, None, token_ids=list(range(8))), BlockStored([b[0]], 4, None, token_ids=[9] * 4),
        BlockStored([a[2]], 4, a[1], token_ids=[8, 9, 10, 11]), BlockRemoved(a[:2]), BlockRemoved([b[0]], "G2"),
        BlockStored(a[:3], 4, medium="G2")]
    assert coalesce([]) == [] and coalesce([AllBlocksCleared(), AllBlocksCleared()]) == [AllBlocksCleared()] * 2
