"""The one-call decode step (models/decode_step.py, native/csrc/decode_step.c) against the per-op
path on the real model with NVFP4 weights and an NVFP4 KV pool: the same greedy tokens and the
same logprobs to the bit (both call the same C functions in the same order), at batch 1 and a
ragged batch, with exact tails and without; and where it does not apply it steps aside."""
import pytest

from everybyte import LLM, SamplingParams
from everybyte.models import decode_step, native_ops
from everybyte.models.llama import CausalLM

pytestmark = pytest.mark.skipif(native_ops.lib() is None, reason="no C compiler: per-op path only")
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,",
           "import numpy as np\n\n# a function that normalises a matrix by rows\n"]


def _generate(llm, prompts, fused: bool, monkeypatch):
    calls = []
    real = decode_step.run
    with monkeypatch.context() as m:
        m.setattr(CausalLM, "fused_decode", fused)
        m.setattr(decode_step, "run", lambda *a: calls.append(real(*a)) or calls[-1])
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0))
    llm.reset_prefix_cache()
    return outs, calls


@pytest.fixture(scope="module")
def llms():
    made = {tails: LLM(weights_dtype="nvfp4", kv_cache_dtype="nvfp4", kv_cache_bytes="16MiB", max_model_len=512,
                       kv_tiers="none", kv_exact_tail=tails) for tails in (True, False)}
    yield made
    for llm in made.values():
        llm.close()


@pytest.mark.parametrize("tails", [True, False])
@pytest.mark.parametrize("batch", [1, 4])
def test_fused_step_matches_per_op_path(llms, tails, batch, monkeypatch):
    llm = llms[tails]
    prompts = PROMPTS[:batch]
    fused, calls = _generate(llm, prompts, True, monkeypatch)
    assert calls and all(c is not None for c in calls[1:])       # every step after the prefill was fused
    ref, none = _generate(llm, prompts, False, monkeypatch)
    assert not none
    for f, r in zip(fused, ref):
        assert f.token_ids == r.token_ids
        assert [lp[t] for lp, t in zip(f.logprobs, f.token_ids)] == [lp[t] for lp, t in zip(r.logprobs, r.token_ids)]


def test_steps_aside_where_it_does_not_apply(monkeypatch):
    """fp32 weights (the GGUF's dequantized values) and fp8 KV take the per-op path."""
    for kw in ({"weights_dtype": "fp32", "kv_cache_dtype": "nvfp4"}, {"weights_dtype": "nvfp4", "kv_cache_dtype": "fp8"}):
        llm = LLM(kv_cache_bytes="16MiB", max_model_len=256, kv_tiers="none", **kw)
        _, calls = _generate(llm, PROMPTS[:2], True, monkeypatch)
        assert calls and all(c is None for c in calls)
        llm.close()
