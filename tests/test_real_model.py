"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading the same file."""
import os

import pytest
import torch

from everybyte.formats.kv_layout import get_kv_format
from everybyte.models.attention import AttentionMetadata, LayerKVCache
from everybyte.models.default_model import default_model_path
from everybyte.models.loader import load_model

transformers = pytest.importorskip("transformers", reason="the parity reference; in the test extra")
pytestmark = pytest.mark.slow

PROMPTS = [
    [{"role": "user", "content": "Write a haiku about memory."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three prime numbers and explain why they are prime."}],
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]
NEW_TOKENS = 64


@pytest.fixture(scope="session")
def real():
    path = default_model_path()
    ours = load_model(path, dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    return ours, hf


def prompt_ids(tokenizer, prompt) -> list[int]:
    return tokenizer.encode_chat(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt)


class ContiguousKV:
    """One sequence in a contiguous block table, driving CausalLM directly."""

    def __init__(self, lm, max_tokens=256, block_size=16, kv_dtype="fp32"):
        cfg, fmt = lm.config, get_kv_format(kv_dtype)
        num_blocks = -(-max_tokens // block_size)
        self.lm, self.table, self.len = lm, torch.arange(num_blocks)[None], 0
        self.caches = [LayerKVCache(fmt, *(fmt.allocate(num_blocks, block_size, cfg.num_key_value_heads,
                                                        cfg.head_dim) for _ in "kv"),
                                    fmt.default_scale, fmt.default_scale, block_size)
                       for _ in range(cfg.num_hidden_layers)]

    @torch.inference_mode()
    def step(self, ids: list[int]) -> torch.Tensor:
        positions = torch.arange(self.len, self.len + len(ids))
        self.len += len(ids)
        meta = AttentionMetadata(positions.clone(), [len(ids)], [self.len], self.table)
        return self.lm.compute_logits(self.lm(torch.tensor(ids), positions, meta, self.caches))

    def greedy(self, ids: list[int], n: int) -> list[int]:
        out = [int(self.step(ids)[-1].argmax())]
        while len(out) < n:
            out.append(int(self.step(out[-1:])[-1].argmax()))
        return out


@pytest.fixture(scope="session")
def hf_greedy(real):
    ours, hf = real
    refs = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt_ids(ours.tokenizer, prompt)])
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
        refs.append(out[0, ids.shape[1]:].tolist())
    return refs


def test_default_model_config(real):
    ours, _ = real
    cfg = ours.config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == ("llama", 30, 576, 9, 3, 64, 49152)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == [2] and cfg.rope_theta == 100000.0
    assert cfg.model_id.endswith("@" + cfg.revision) and len(cfg.revision) == 16


def test_prefill_logits_match_transformers(real):
    ours, hf = real
    ids = prompt_ids(ours.tokenizer, PROMPTS[1]) + prompt_ids(ours.tokenizer, PROMPTS[2])
    logits = ContiguousKV(ours.model).step(ids)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert logits.shape == ref.shape
    assert (logits - ref).abs().max().item() <= 1e-3


def test_causal_lm_greedy_matches_transformers_generate(real, hf_greedy):
    ours, _ = real  # the model alone, on a contiguous block table (the engine is tested below)
    ids = prompt_ids(ours.tokenizer, PROMPTS[0])
    assert ContiguousKV(ours.model).greedy(ids, 16) == hf_greedy[0][:16]


def test_llm_generate_greedy_matches_transformers(real, hf_greedy):
    from everybyte import LLM, SamplingParams

    ours, _ = real
    llm = LLM(ours, kv_cache_dtype="fp32", kv_cache_bytes="64MiB", max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([prompt_ids(ours.tokenizer, p) for p in PROMPTS], params)
    assert [o.token_ids for o in outputs] == hf_greedy
