"""The default KV budget ("auto"): one max_model_len request in the chosen format, at least 64 MiB,
EVERYBYTE_KV_CACHE_SPACE when set, and max_model_len lowered (with a warning) where a quarter of
the available memory cannot hold one request."""
import logging

import pytest
import torch

from everybyte import LLM, SamplingParams
from everybyte.engine import kv_budget
from everybyte.engine.kv_budget import resolve_kv_budget
from everybyte.kv.data.pool import bytes_per_token
from everybyte.models.loader import load_model

SHAPES = [(3, 64)] * 30                      # SmolLM2-135M: 30 layers x 3 KV heads x 64
MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv(kv_budget.ENV, raising=False)


@pytest.mark.parametrize("fmt,mib", [("nvfp4", 64), ("fp8", 90), ("fp16", 180), ("fp32", 360)])
def test_budget_holds_one_full_request_in_every_format(fmt, mib):
    assert resolve_kv_budget(SHAPES, fmt, 16, 8192, False, available=64 * GiB) == (mib * MiB, 8192)


def test_environment_variable_is_the_budget(monkeypatch):
    monkeypatch.setenv(kv_budget.ENV, "1GiB")
    assert resolve_kv_budget(SHAPES, "fp32", 16, 8192, False, available=1) == (GiB, 8192)


def test_little_memory_lowers_max_model_len_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger=kv_budget.__name__):
        budget, length = resolve_kv_budget(SHAPES, "fp32", 16, 8192, False, available=800 * MiB)
    assert budget == 200 * MiB and length == budget // (16 * bytes_per_token(SHAPES, "fp32")) * 16 < 8192
    assert "max_model_len=8192" in caplog.text and f"max_model_len={length}" in caplog.text
    assert kv_budget.ENV in caplog.text
    # a max_model_len the caller chose is kept: the budget follows it
    assert resolve_kv_budget(SHAPES, "fp32", 16, 8192, True, available=800 * MiB) == (360 * MiB, 8192)


def test_fp32_kv_with_the_default_budget_runs(monkeypatch):
    """LLM(kv_cache_dtype="fp32") used to fail: 64 MiB cannot hold one 8,192-token request."""
    monkeypatch.setattr(kv_budget, "available_memory_bytes", lambda: 256 * MiB)   # keeps the pool at 64 MiB
    llm = LLM(load_model(None, dtype=torch.float32), kv_cache_dtype="fp32", kv_tiers="none")
    assert llm.config.kv_cache_bytes == 64 * MiB and llm.max_model_len == 1456
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(out.token_ids) == 3
    assert llm.stats()["max_model_len"] == 1456
