"""KV events (kv/events): the prefix cache reports each block it names, forgets and clears, in
vLLM's schema, and a real engine's events carry the namespace digest its stats state."""
import subprocess
import sys
from pathlib import Path

import pytest

from everybyte.kv.block_id import KVNamespace, chain_block_ids
from everybyte.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventLog
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
                 "everybyte.kv.eviction",
                 "everybyte.kv.sessions", "everybyte.kv.ledger", "everybyte.kv.events", "everybyte.kv.clock",
                 "everybyte.kv.mover", "everybyte.kv.block_manager", "everybyte.kv.seq_state",
                 "everybyte.kv.session_ops", "everybyte.kv.memory_manager", "everybyte.engine.scheduler",
                 "everybyte.engine.core"]   # pyproject [tool.mypy] files


def test_control_plane_imports_without_torch():
    code = f"import sys; sys.modules['torch'] = None; import {', '.join(CONTROL_PLANE)}"
    subprocess.run([sys.executable, "-c", code], check=True)
    tomllib = pytest.importorskip("tomllib")                  # Python 3.11+
    with open(Path(__file__).parents[1] / "pyproject.toml", "rb") as f:
        files = tomllib.load(f)["tool"]["mypy"]["files"]
    assert [m.replace(".", "/") + ".py" for m in CONTROL_PLANE] == files


def test_engine_events_carry_its_namespace():
    from everybyte import LLM, SamplingParams
    llm = LLM(kv_cache_bytes="16MiB", max_model_len=256, kv_tiers="none")
    log = llm.block_manager.kv_events()
    llm.generate(["word " * 40], SamplingParams(temperature=0, max_tokens=4))
    batch = log.drain()
    stored = [e for e in batch.events if isinstance(e, BlockStored)]
    assert len(stored) >= 2 and all(len(h) == 16 for e in stored for h in e.block_hashes)
    assert batch.namespace.hex() == llm.stats()["memory"]["kv_namespace"]
    llm.reset_prefix_cache()
    assert any(isinstance(e, (AllBlocksCleared, BlockRemoved)) for e in log.drain().events)
    llm.close()
