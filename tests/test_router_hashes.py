"""The router names a prompt's blocks exactly as a worker does: its torch-free tokenizer (the
`gguf` reader's metadata), serve's chat path, and the namespace a worker states in /v1/kv/info
(the base namespace's init fields), salted by cache_salt, give the same block hashes the real
engine's prefix cache publishes as BlockStored events for that prompt."""
from dataclasses import fields

import pytest

from everybyte.cluster.request_blocks import RequestBlocks, block_names, load_tokenizer, namespace_from_info
from everybyte.kv.events import BlockStored


@pytest.fixture(scope="module")
def llm():
    from everybyte import LLM
    llm = LLM(kv_cache_bytes="16MiB", max_model_len=512, kv_tiers="none")
    yield llm
    llm.close()


def info_namespace(llm) -> dict:
    ns = llm.block_manager.ns.with_tenant(None)          # what /v1/kv/info states (cluster contract §1)
    return {f.name: getattr(ns, f.name) for f in fields(ns) if f.init}


def published(llm, run) -> list[bytes]:
    log = llm.block_manager.kv_events()
    run()
    return [h for e in log.drain().events if isinstance(e, BlockStored) for h in e.block_hashes]


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_router_block_names_equal_the_workers(llm, salt):
    from everybyte import SamplingParams
    blocks = RequestBlocks(load_tokenizer(None))
    ns = namespace_from_info(info_namespace(llm))
    params = SamplingParams(temperature=0, max_tokens=2)
    messages = [{"role": "system", "content": "You are terse. " * 8},
                {"role": "user", "content": f"List three colours ({salt})."}]
    ids = blocks.prompt_tokens("/v1/chat/completions", {"messages": messages})
    assert ids == llm.chat_prompt(messages)[1]
    names = block_names(ns, ids, salt)
    assert len(names) >= 3
    got = published(llm, lambda: llm.chat(messages, params, cache_salt=salt))
    assert got[:len(names)] == names

    text = f"The quick brown fox ({salt}) " * 12
    ids = blocks.prompt_tokens("/v1/completions", {"prompt": text})
    assert ids == llm.tokenizer.encode(text)
    names = block_names(ns, ids, salt)
    got = published(llm, lambda: llm.generate([text], params, cache_salt=salt))
    assert got[:len(names)] == names
    if salt:
        assert names != block_names(ns, ids, None)


def test_unreadable_bodies_give_no_tokens():
    blocks = RequestBlocks(load_tokenizer(None))
    assert blocks.prompt_tokens("/v1/chat/completions", {"messages": []}) is None
    assert blocks.prompt_tokens("/v1/completions", {"prompt": {"x": 1}}) is None
    assert blocks.prompt_tokens("/v1/completions", {"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert blocks.prompt_tokens("/v1/completions", {"prompt": ["ab", "cd"]}) == blocks.tokenizer.encode("ab")


def test_plan_salts_by_tenant_and_keeps_to_one_namespace():
    from everybyte.cluster.policy import Policy
    from everybyte.cluster.router import _tenant
    from everybyte.cluster.routing import NoWorker, Routing
    from everybyte.kv.block_id import KVNamespace
    from everybyte.serve.guard import tenant_of

    routing = Routing(["http://a", "http://b"], RequestBlocks(load_tokenizer(None)), Policy("round-robin"))
    for url, digest, fmt in (("http://a", "d1", "nvfp4"), ("http://b", "d2", "fp8")):
        w = routing.workers.workers[url]
        w.healthy, w.info, w.namespace = True, {"namespace_digest": digest}, KVNamespace("m", kv_format=fmt)
    body = {"prompt": "Seventeen words of a prompt that fill at least one block of sixteen tokens. " * 2,
            "cache_salt": "s"}
    tenant = _tenant("Bearer key-1")
    assert tenant == tenant_of("key-1") and _tenant("Basic x") is None and _tenant(None) is None
    plan = routing.plan("/v1/completions", body, None, tenant=tenant, digest="d2")
    assert plan.worker.url == "http://b"
    tokens = routing.blocks.tokenizer.encode(body["prompt"])
    assert plan.names == block_names(KVNamespace("m", kv_format="fp8"), tokens, f"{tenant}/s")
    with pytest.raises(NoWorker):
        routing.plan("/v1/completions", body, None, digest="d3")
