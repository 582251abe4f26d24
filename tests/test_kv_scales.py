"""KV scales: every process serving a model derives the same per-layer scales (so the same block
names), whatever its thread count; a block one process writes to disk is read by another; a
checkpoint's ModelOpt k_scale/v_scale tensors are used as they are, with no calibration; malformed
ones are errors naming the tensor."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from everybyte import LLM, SamplingParams
from everybyte.engine import assembly
from everybyte.engine.model_runner import CALIBRATION_TEXT, calibrate_kv_amax
from everybyte.models.default_model import default_model_path
from everybyte.models.hf_export import export_hf
from everybyte.models.hf_loader import INDEX_FILE, config_from_hf
from everybyte.models.kv_scales import (
    KV_QUANT_ALGO,
    SCALES_FILE,
    k_scale_name,
    kv_scale_tensors,
    read_kv_scales,
    v_scale_name,
    write_kv_scales,
)
from everybyte.models.loader import load_model

ENGINE = dict(kv_cache_bytes="8MiB", max_model_len=512, dtype="float32", kv_tiers="none")
PROMPT = ("You are a coding agent working in a Python repository. You can call the tools read_file, "
          "write_file, run_tests and search. Think step by step, keep edits small, and run the tests "
          "after every change. Task: the test test_parse_dates fails with a KeyError; find out why.")


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, dtype=torch.float32)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return export_hf(None, tmp_path_factory.mktemp("kvs") / "smollm2-hf", dtype="bf16")


def _checkpoint(hf_dir: Path, out: Path) -> Path:
    """A private copy of the HF directory: JSON files copied, weights linked."""
    out.mkdir()
    for f in hf_dir.iterdir():
        if f.suffix == ".safetensors":
            (out / f.name).symlink_to(f)
        else:
            shutil.copy(f, out / f.name)
    return out


def test_calibration_runs_on_one_thread_and_restores_the_count(loaded):
    seen = []
    hook = loaded.model.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        mc = loaded.config
        ids = loaded.tokenizer.encode(CALIBRATION_TEXT)
        k, v = calibrate_kv_amax(loaded.model, [(mc.num_key_value_heads, mc.head_dim)] * mc.num_hidden_layers, ids)
        assert seen == [1] and torch.get_num_threads() == 2
        assert len(k) == len(v) == mc.num_hidden_layers and min(k + v) > 0
    finally:
        hook.remove()
        torch.set_num_threads(before)


def _run(role: str, threads: int, disk: Path) -> dict:
    script = textwrap.dedent(f"""
        import json, torch
        from everybyte import LLM, SamplingParams
        llm = LLM(None, **{dict(ENGINE, kv_tiers=f"disk:{disk}:64MiB")!r})
        out = llm.generate([{PROMPT!r}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
        if {role!r} == "writer":
            llm.reset_prefix_cache()                     # every cached block goes down to the disk tier
        llm.close()
        p = llm.pool
        print(json.dumps({{"threads": torch.get_num_threads(), "k": [s.hex() for s in p.k_scales],
                          "v": [s.hex() for s in p.v_scales], "namespace": llm.block_manager.ns.digest.hex(),
                          "cached": out.num_cached_tokens, "tokens": out.token_ids,
                          "reused": llm.stats()["memory"]["prefill_tokens"]["reused"]}}))
    """)
    # passive OpenMP waits change no number, only keep 2 threads from spinning on a busy 2-core machine
    env = dict(os.environ, EVERYBYTE_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_processes_with_1_and_2_threads_agree_and_share_disk_blocks(tmp_path):
    writer = _run("writer", 1, tmp_path / "g3")
    reader = _run("reader", 2, tmp_path / "g3")
    assert (writer["threads"], reader["threads"]) == (1, 2)
    assert reader["k"] == writer["k"] and reader["v"] == writer["v"]
    assert reader["namespace"] == writer["namespace"]
    assert writer["cached"] == 0 and reader["reused"].get("G3", 0) == reader["cached"] > 0
    assert reader["tokens"] == writer["tokens"]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "nvfp4"])
def test_checkpoint_scales_are_used_as_they_are(kv_cache_dtype, hf_dir, tmp_path, monkeypatch):
    ckpt = _checkpoint(hf_dir, tmp_path / "ckpt")
    n = config_from_hf(ckpt).num_hidden_layers
    amax = [(10.0 + i, 3.0 + i / 7) for i in range(n)]
    write_kv_scales(ckpt, amax, kv_cache_dtype)
    quant = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]
    assert quant["kv_cache_quant_algo"] == KV_QUANT_ALGO[kv_cache_dtype]
    assert "quantization_config" not in json.loads((ckpt / "config.json").read_text())   # weights not quantized

    def no_calibration(*args, **kwargs):
        raise AssertionError("a checkpoint with k_scale/v_scale must not be calibrated")
    monkeypatch.setattr(assembly, "calibrate_kv_amax", no_calibration)
    llm = LLM(str(ckpt), kv_cache_dtype=kv_cache_dtype, **ENGINE)
    t = kv_scale_tensors(amax, kv_cache_dtype)
    assert llm.pool.k_scales == [float(t[k_scale_name(i)]) for i in range(n)]
    assert llm.pool.v_scales == [float(t[v_scale_name(i)]) for i in range(n)]
    if kv_cache_dtype == "fp8":
        out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
        assert len(out.token_ids) == 2


def test_scale_tensors_follow_modelopt(hf_dir, tmp_path):
    t = kv_scale_tensors([(448.0, 2688.0)], "fp8")
    assert list(t) == ["model.layers.0.self_attn.k_proj.k_scale", "model.layers.0.self_attn.v_proj.v_scale"]
    assert all(x.dtype == torch.float32 and x.shape == () for x in t.values())
    assert [float(x) for x in t.values()] == [1.0, 6.0]
    nvfp4 = kv_scale_tensors([(2688.0, 1.0)], "nvfp4")
    assert [float(x) for x in nvfp4.values()] == [1.0, float(torch.tensor(1 / 2688))]
    for bad in ([(0.0, 1.0)], [(1.0, float("nan"))]):
        with pytest.raises(ValueError, match="amax must be finite"):
            kv_scale_tensors(bad)
    with pytest.raises(ValueError, match="no KV scales for kv_cache_dtype 'fp16'"):
        kv_scale_tensors([(1.0, 1.0)], "fp16")
    # a sharded, weight-quantized checkpoint: the scales file joins the index, both configs name the algorithm
    d = tmp_path / "sharded"
    d.mkdir()
    config = json.loads((hf_dir / "config.json").read_text()) | {"quantization_config": {"quant_method": "modelopt",
                                                                                          "quant_algo": "NVFP4"}}
    (d / "config.json").write_text(json.dumps(config))
    save_file({"x": torch.zeros(1)}, str(d / "model-00001-of-00001.safetensors"))
    (d / INDEX_FILE).write_text(json.dumps({"weight_map": {"x": "model-00001-of-00001.safetensors"}}))
    cfg = config_from_hf(hf_dir)
    amax = [(1.0 + i, 2.0) for i in range(cfg.num_hidden_layers)]
    write_kv_scales(d, amax, "nvfp4")
    assert json.loads((d / INDEX_FILE).read_text())["weight_map"][k_scale_name(3)] == SCALES_FILE
    assert json.loads((d / "config.json").read_text())["quantization_config"]["kv_cache_quant_algo"] == "NVFP4"
    assert read_kv_scales(d, cfg) == [(float(torch.tensor(k / 2688)) * 2688, float(torch.tensor(v / 2688)) * 2688)
                                      for k, v in amax]
    save_file(kv_scale_tensors(amax), str(d / "model-00001-of-00001.safetensors"))
    with pytest.raises(ValueError, match="already holds KV scales"):
        write_kv_scales(d, amax)


def _scales_dir(hf_dir: Path, tmp_path: Path, tensors: dict, quant: dict | None = None) -> Path:
    d = tmp_path / "scales"
    d.mkdir()
    shutil.copy(hf_dir / "config.json", d / "config.json")
    save_file(tensors, str(d / "model.safetensors"))
    if quant is not None:
        (d / "hf_quant_config.json").write_text(json.dumps({"quantization": quant}))
    return d


def test_other_names_and_per_head_scales(hf_dir, tmp_path):
    cfg = config_from_hf(hf_dir)
    heads = cfg.num_key_value_heads
    tensors = {f"model.layers.{i}.self_attn.{kv}_scale": torch.full((heads,), 0.5)
               for i in range(cfg.num_hidden_layers) for kv in "kv"}
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor([0.25, 2.0, 0.5])[:heads]
    got = read_kv_scales(_scales_dir(hf_dir, tmp_path, tensors), cfg)       # llm-compressor names, no algo: FP8
    assert got[0] == (2.0 * 448, 0.5 * 448) and got[1:] == [(224.0, 224.0)] * (cfg.num_hidden_layers - 1)
    assert read_kv_scales(hf_dir, cfg) is None and read_kv_scales(default_model_path(), cfg) is None   # GGUF


@pytest.mark.parametrize("bad,message", [(torch.ones(2, 2), "shape (2, 2)"), (torch.tensor(float("nan")), "finite"),
                                         (torch.tensor(-1.0), "> 0"), (torch.tensor(3), "dtype"),
                                         (None, "is missing")])
def test_malformed_scales_are_errors_naming_the_tensor(bad, message, hf_dir, tmp_path):
    cfg = config_from_hf(hf_dir)
    tensors = kv_scale_tensors([(1.0, 1.0)] * cfg.num_hidden_layers)
    name = v_scale_name(7)
    if bad is None:
        del tensors[name]
    else:
        tensors[name] = bad
    d = _scales_dir(hf_dir, tmp_path, tensors, {"kv_cache_quant_algo": "FP8"})
    with pytest.raises(ValueError, match=re.escape(name) + ".*" + re.escape(message)):
        read_kv_scales(d, cfg)


def test_unknown_algorithm_and_engine_error(hf_dir, tmp_path):
    cfg = config_from_hf(hf_dir)
    tensors = kv_scale_tensors([(1.0, 1.0)] * cfg.num_hidden_layers)
    with pytest.raises(ValueError, match="kv_cache_quant_algo 'INT8' is not supported"):
        read_kv_scales(_scales_dir(hf_dir, tmp_path, tensors, {"kv_cache_quant_algo": "INT8"}), cfg)
    ckpt = _checkpoint(hf_dir, tmp_path / "ckpt")
    tensors[k_scale_name(2)] = torch.tensor(float("inf"))
    save_file(tensors, str(ckpt / SCALES_FILE))
    with pytest.raises(ValueError, match=re.escape(k_scale_name(2))):
        LLM(str(ckpt), kv_cache_dtype="fp8", **ENGINE)
