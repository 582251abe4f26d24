"""Sampling defaults: the fields a request leaves unset take the checkpoint's own defaults
(generation_config.json, GGUF general.sampling.*), else temperature 0.7 / top_p 0.9 / repetition
penalty 1.1; a value the request sets always wins; greedy stays plain greedy."""
import json

import torch
from test_loaders import save_hf_dir, tiny_hf, write_gguf

from everybyte.engine.sampler import Sampler, SamplingTensors
from everybyte.engine.sampling_defaults import FALLBACK, sampling_defaults
from everybyte.engine.sampling_params import NEUTRAL, SamplingParams
from everybyte.models.gguf_file import GGUFFile
from everybyte.models.gguf_loader import config_from_gguf
from everybyte.models.hf_loader import config_from_hf
from everybyte.serve.protocol import ChatCompletionRequest, CompletionRequest


def test_unset_fields_read_neutral_until_defaults_fill_them():
    p = SamplingParams(top_k=5, max_tokens=3)
    assert (p.temperature, p.top_p, p.min_p, p.repetition_penalty) == (1.0, 1.0, 0.0, 1.0)
    assert p.unset == {"temperature", "top_p", "min_p", "repetition_penalty"}
    q = p.with_defaults({"temperature": 0.6, "top_k": 40, "top_p": 0.95})
    assert (q.temperature, q.top_k, q.top_p, q.min_p, q.max_tokens) == (0.6, 5, 0.95, 0.0, 3)  # explicit top_k wins
    assert q.unset == {"min_p", "repetition_penalty"}
    assert SamplingParams(temperature=1.0).with_defaults(FALLBACK).temperature == 1.0
    greedy = SamplingParams(temperature=0).with_defaults(FALLBACK)
    assert greedy.temperature == 0 and greedy.repetition_penalty == 1.0     # no default penalty on greedy
    assert SamplingParams(temperature=0, repetition_penalty=1.3).with_defaults(FALLBACK).repetition_penalty == 1.3
    assert set(NEUTRAL) == {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"}


def test_http_requests_leave_unset_fields_unset():
    for body in (CompletionRequest(prompt="x"), ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])):
        p = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                           repetition_penalty=body.repetition_penalty)
        assert p.unset == set(NEUTRAL)
    assert CompletionRequest(prompt="x", temperature=0).temperature == 0


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5], [2.0, -2.0, 1.0, 0.5]])
    params = [SamplingParams(temperature=0, repetition_penalty=2.0), SamplingParams(temperature=0)]
    st = SamplingTensors.from_params(params, 4, [[0, 1, 1], [0, 1]])
    out = Sampler.penalize(logits, st)
    assert out[0].tolist() == [1.0, -4.0, 1.0, 0.5] and out[1].tolist() == logits[1].tolist()
    assert Sampler(0)(logits, st, [None, None]).token_ids == [0, 0]
    st = SamplingTensors.from_params([SamplingParams(temperature=0, repetition_penalty=4.0)], 4, [[0]])
    assert Sampler(0)(logits[:1], st, [None]).token_ids == [2]                # 2/4 < 1: token 2 wins
    assert SamplingTensors.from_params(params[1:], 4, [[0]]).penalties is None  # all 1: no work


def test_checkpoint_defaults_are_read(tmp_path):
    hf = tiny_hf("llama")
    d = save_hf_dir(hf, tmp_path / "hf")
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "do_sample": True,
                                                           "eos_token_id": 258}))
    assert sampling_defaults(config_from_hf(d)) == {"temperature": 0.6, "top_p": 0.95}
    g = GGUFFile(write_gguf(hf, tmp_path / "m.gguf", "llama"))
    assert sampling_defaults(config_from_gguf(g)) == FALLBACK            # no sampling metadata
    g.metadata.update({"general.sampling.temp": 0.8, "general.sampling.top_k": 20,
                       "general.sampling.penalty_repeat": 1.05})
    assert sampling_defaults(config_from_gguf(g)) == {"temperature": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def test_engine_applies_them(tmp_path):
    from test_engine import make

    from everybyte.models.loader import load_model
    llm = make(load_model(None, dtype=torch.float32))
    assert llm.sampling_defaults == FALLBACK                              # the default GGUF carries none
    seq = llm.make_sequence("Hi", SamplingParams(max_tokens=2, top_p=0.5))
    assert (seq.params.temperature, seq.params.top_p, seq.params.repetition_penalty) == (0.7, 0.5, 1.1)
    assert llm.make_sequence("Hi").params.temperature == 0.7
    assert llm.make_sequence("Hi", SamplingParams(temperature=0)).params.greedy
