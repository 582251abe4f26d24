"""The engine end to end on the real default model (fp32 compute, CPU, small pools, few tokens)."""
import pytest
import torch

from everybyte import LLM, SamplingParams
from everybyte.models.loader import load_model

G = dict(temperature=0)
PROMPTS = ["The capital of France is", "def add(a, b):", "1, 2, 3, 4,", "Once upon a time, in a land far",
           "Hello", "import numpy as np\nx = np.", "The quick brown fox jumps over the lazy dog. The",
           "Q: What color is the sky?\nA:"]


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, dtype=torch.float32)


def make(loaded, **kw):
    kw = {"kv_cache_dtype": "fp32", "kv_cache_bytes": "8MiB", "max_model_len": 128, **kw}
    return LLM(loaded, **kw)


@pytest.fixture(scope="module")
def llm(loaded):
    return make(loaded)


def tokens(outs):
    return [o.token_ids for o in outs]


P6 = SamplingParams(max_tokens=6, ignore_eos=True, **G)


@pytest.fixture(scope="module")
def batch(llm):
    return llm.generate(PROMPTS, P6)


def test_batch_equals_alone(llm, batch):
    alone = [llm.generate(x, P6)[0] for x in PROMPTS]
    assert tokens(batch) == tokens(alone)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 6 for o in batch)
    assert batch[0].text.strip().startswith("Paris")
    assert [o.prompt for o in batch] == PROMPTS
    assert batch[0].prompt_token_ids == llm.tokenizer.encode(PROMPTS[0])


def test_chunked_prefill_equals_unchunked(loaded, batch):
    chunked = make(loaded, max_num_batched_tokens=5)
    assert tokens(chunked.generate(PROMPTS[4:], P6)) == tokens(batch[4:])


def test_preemption_equals_no_preemption(loaded, batch):
    tiny = make(loaded, kv_cache_bytes=3 * 16 * 46080, max_model_len=32, block_size=8)  # 6 blocks of 8
    outs = tiny.generate(PROMPTS[:4], P6)
    assert tiny.scheduler.num_preemptions > 0
    assert tokens(outs) == tokens(batch[:4])
    assert tiny.block_manager.num_free_blocks == tiny.block_manager.num_blocks


def test_seeds_reproducible(llm):
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=5, ignore_eos=True)
    a = llm.generate(PROMPTS[0], p)[0].token_ids
    mixed = llm.generate(PROMPTS[:3], [p, SamplingParams(temperature=1.0, max_tokens=5), SamplingParams(**G)])
    assert mixed[0].token_ids == a
    others = llm.generate([PROMPTS[0]] * 3, [SamplingParams(temperature=1.0, top_p=0.95, seed=s, max_tokens=5, ignore_eos=True)
                                              for s in (1, 2, 1234)])
    assert others[2].token_ids == a
    assert len({tuple(o.token_ids) for o in others}) > 1


def test_stop_strings_and_stop_tokens(llm):
    base = llm.generate(PROMPTS[3], SamplingParams(max_tokens=16, ignore_eos=True, **G))[0]
    stop = base.text[len(base.text) // 2:][:3]
    assert stop.strip()
    out = llm.generate(PROMPTS[3], SamplingParams(max_tokens=16, ignore_eos=True, stop=[stop], **G))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[:base.text.index(stop)]
    tok = base.token_ids[3]
    out = llm.generate(PROMPTS[3], SamplingParams(max_tokens=16, stop_token_ids=[tok], **G))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == tok and out.stop_reason == tok
    assert len(out.token_ids) == base.token_ids.index(tok) + 1


def test_eos_stops_unless_ignored(llm):
    chat = [{"role": "user", "content": "Say hi."}]
    out = llm.chat(chat, SamplingParams(max_tokens=60, **G))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.eos_token_ids and out.text
    assert "<|im_end|>" not in out.text
    out = llm.chat([chat], SamplingParams(max_tokens=len(out.token_ids) + 2, ignore_eos=True, **G))
    assert len(out) == 1 and out[0].finish_reason == "length"


def test_logprobs_and_metrics(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, logprobs=3, **G))[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and len(lp) == 3 and max(lp.values()) == lp[tok] <= 0
    m = out.metrics
    assert m.ttft > 0 and len(m.token_times) == len(out.token_ids) and m.first_token_time == m.token_times[0]
    assert m.finished_time >= m.token_times[-1] and all(t >= 0 for t in m.inter_token_latencies)


def test_step_api_stream_and_abort(llm):
    rid = llm.add_request(PROMPTS[1], SamplingParams(max_tokens=3, **G), request_id="a")
    other = llm.add_request(PROMPTS[2], SamplingParams(max_tokens=50, ignore_eos=True, **G))
    assert rid == "a"
    with pytest.raises(ValueError, match="already in use"):
        llm.add_request(PROMPTS[1], request_id="a")
    done = {}
    while "a" not in done:
        done.update({o.request_id: o for o in llm.step() if o.finished})
    assert llm.stats()["num_running"] == 1
    assert llm.abort(other).finish_reason == "abort"
    assert not llm.has_unfinished_requests() and llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    chunks = list(llm.stream(PROMPTS[0], SamplingParams(max_tokens=6, **G)))
    assert chunks[-1].finished and all(chunks[i + 1].text.startswith(chunks[i].text) for i in range(len(chunks) - 1))
    assert chunks[-1].text == llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, **G))[0].text


def test_bad_inputs(loaded, llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match=r"200 tokens.*max_model_len 128"):
        llm.generate([[5] * 200])
    with pytest.raises(ValueError, match=r"49152.*outside the vocabulary \[0, 49152\)"):
        llm.generate([[1, 2, 49152]])
    with pytest.raises(ValueError, match="-3.*outside"):
        llm.generate([[1, -3]])
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-1)
    p = SamplingParams()
    p.top_p = 0
    with pytest.raises(ValueError, match="top_p"):
        llm.generate("hi", p)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["hi"], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match=r"needs at least 5898240 bytes"):
        make(loaded, kv_cache_bytes="1MiB")        # 128 tokens * 46080 B
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make(loaded, kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="cannot parse size"):
        make(loaded, kv_cache_bytes="lots")
    assert not llm.has_unfinished_requests()
    assert llm.generate([]) == []


def test_request_bigger_than_pool_rejected(llm):
    from everybyte.engine.sequence import Sequence
    seq = Sequence([1] * 10, SamplingParams(max_tokens=10))
    llm.scheduler.max_model_len = 10 ** 6                         # pretend a longer context
    try:
        with pytest.raises(ValueError, match="more than the whole pool"):
            llm.scheduler.add(Sequence([1] * 10, SamplingParams(max_tokens=llm.pool.capacity_tokens)))
    finally:
        llm.scheduler.max_model_len = llm.max_model_len
    llm.scheduler.check(seq)


def test_nvfp4_pool_holds_3_5x_fp16(loaded):
    fp16 = make(loaded, kv_cache_dtype="fp16", kv_cache_bytes="8MiB")
    nv = make(loaded, kv_cache_dtype="nvfp4", kv_cache_bytes="8MiB")
    assert nv.pool.capacity_tokens >= 3.5 * fp16.pool.capacity_tokens
    assert nv.pool.nbytes <= 8 * 2**20 and fp16.pool.nbytes <= 8 * 2**20
    bpt = nv.kv_bytes_per_token()
    assert bpt["fp16"] == 30 * 2 * 3 * 64 * 2 and bpt["fp16"] / bpt["nvfp4"] >= 3.5


@pytest.mark.parametrize("kv", ["fp8", "nvfp4"])
def test_quantized_kv_generates_with_deterministic_scales(loaded, llm, kv):
    a, b = make(loaded, kv_cache_dtype=kv), make(loaded, kv_cache_dtype=kv)
    assert a.pool.k_scales == b.pool.k_scales and a.pool.v_scales == b.pool.v_scales
    assert all(s > 0 for s in a.pool.k_scales + a.pool.v_scales)
    p = SamplingParams(max_tokens=4, ignore_eos=True, **G)
    out = a.generate(PROMPTS[0], p)[0]
    assert out.text.strip().startswith("Paris")
