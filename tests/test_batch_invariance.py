"""A seeded request gives the same tokens (and the same logprobs, bit for bit) whatever else is in
the batch: alone, next to three other requests admitted with it, and with others joining (their
prefill chunks sharing its decode steps). Real default model, fp32 compute, float weights."""
import pytest
import torch

from everybyte import LLM, SamplingParams
from everybyte.models import gemm
from everybyte.models.loader import load_model

PROMPT = "Tell me something about the year 2010."
OTHERS = ["def quicksort(arr):", "The history of Rome begins " * 12, "List three colors:\n1."]
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=20, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def llm():
    return LLM(load_model(None, dtype=torch.float32), kv_cache_bytes="16MiB", max_model_len=1024)


def others(n_tokens=(6, 12, 30)):
    return [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in n_tokens]


def run_staggered(llm, join_at=(2, 6, 11)):
    """The seeded request first; one other request joins at each step in join_at."""
    rid, last, k = llm.add_request(PROMPT, SEEDED), None, 0
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.request_id == rid:
                last = out
        k += 1
        if k in join_at:
            i = join_at.index(k)
            llm.add_request(OTHERS[i], others()[i])
    return last


@pytest.mark.parametrize("kv", ["nvfp4", "fp32"])
def test_seeded_request_alone_equals_batched(llm, kv):
    if kv != llm.config.kv_cache_dtype:
        llm = LLM(llm.loaded, kv_cache_dtype=kv, kv_cache_bytes="32MiB", max_model_len=512)
    alone = llm.generate(PROMPT, SEEDED)[0]
    llm.reset_prefix_cache()
    together = llm.generate([*OTHERS, PROMPT], [*others(), SEEDED])[-1]
    llm.reset_prefix_cache()
    staggered = run_staggered(llm)
    assert together.token_ids == alone.token_ids and staggered.token_ids == alone.token_ids
    assert together.logprobs == alone.logprobs and staggered.logprobs == alone.logprobs
    assert len(alone.token_ids) == SEEDED.max_tokens


@pytest.mark.skipif(not gemm.onednn_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (576, 49152)])
def test_linear_row_does_not_depend_on_the_other_rows(k, n):
    g = torch.Generator().manual_seed(k + n)
    x, w = torch.randn(300, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5
    full = gemm.linear(x, w)
    for m in (1, 2, 3, 8, 33, 128):
        for start in (0, 5):
            assert torch.equal(gemm.linear(x[start:start + m].contiguous(), w), full[start:start + m]), (m, start)
