"""NVFP4 weights: the fused GEMM kernel against dequantize-then-matmul (random weights, every
build target), quantization bytes (C vs torch), the real model (same greedy tokens through the
kernel and the reference; packed bytes in the ledger), `everybyte quantize` checkpoints (loaded
memory-mapped, same tokens as quantizing at load) and bad checkpoints."""
import json
import platform
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_loaders import everybyte_logits, save_hf_dir, tiny_hf

from everybyte import cli
from everybyte.formats import cpu_kernels
from everybyte.formats.nvfp4_kv import quantize_blocks_best_scale
from everybyte.formats.nvfp4_weights import WEIGHT_DIVISORS, quantize_group, quantize_weight, tensor_scale
from everybyte.models import native_ops, nvfp4_gemm
from everybyte.models.loader import load_model
from everybyte.models.nvfp4_gemm import PackedWeight, fused_linear, reference_linear
from everybyte.native import loader

needs_kernel = pytest.mark.skipif(not nvfp4_gemm.kernel_available(), reason="no C compiler: torch reference only")


def packed(rows=(96, 32, 35), k=160, seed=0) -> PackedWeight:
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(r, k, generator=g) * (i + 1) for i, r in enumerate(rows)]
    parts = [quantize_weight(w, tensor_scale([w])) for w in ws]      # each part its own tensor scale
    return PackedWeight(parts)


def check_kernel_matches_reference():
    for k in (160, 48):                     # 48: not a multiple of 32, so bf16 x takes the float32 path
        _check_kernel(packed(k=k))


def _check_kernel(w):
    dense = w.dequantize(torch.float32)
    for m in (1, 2, 3, 4, 5, 9, 16, 33):
        x = torch.randn(m, w.in_features)
        bias = torch.randn(w.out_features)
        want = x.double() @ dense.double().T + bias.double()
        got = fused_linear(x, w, bias)
        tol = 1e-5 * (x.abs().double() @ dense.abs().double().T).max().item()   # fp32 summation order
        assert (got.double() - want).abs().max().item() <= tol
        ref = reference_linear(x, w, bias)
        assert (ref.double() - want).abs().max().item() <= tol
        xb = x.bfloat16()
        got_bf16 = fused_linear(xb, w, bias.bfloat16())
        want_bf16 = (xb.double() @ dense.double().T + bias.bfloat16().double())
        assert got_bf16.dtype is torch.bfloat16
        assert ((got_bf16.double() - want_bf16).abs() <= 2 ** -8 * want_bf16.abs() + tol).all()


@needs_kernel
def test_kernel_matches_dequantize_then_matmul():
    check_kernel_matches_reference()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 target flags")
@pytest.mark.parametrize("march", ["x86-64-v2", "x86-64-v3"])
def test_portable_and_avx2_builds_match(monkeypatch, tmp_path, march):
    """The plain-C (v2) and AVX2 (v3) paths of the kernel, whatever this CPU would pick."""
    if march == "x86-64-v3" and "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("CPU without AVX2")
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    flags = [f for f in loader.FLAGS if not f.startswith("-march")] + [f"-march={march}"]
    monkeypatch.setenv("EVERYBYTE_HOME", str(tmp_path))
    monkeypatch.setattr(native_ops, "_lib", native_ops.build(flags))
    check_kernel_matches_reference()


def test_reference_panels_in_pieces(monkeypatch):
    """A weight larger than one panel is multiplied a panel of rows at a time, scales per part."""
    w = packed(rows=(40, 24), k=64)
    x = torch.randn(20, 64)
    whole = reference_linear(x, w)
    monkeypatch.setattr(nvfp4_gemm, "PANEL_BYTES", 64 * 4 * 7)          # 7 rows a panel, crossing the part boundary
    assert torch.allclose(reference_linear(x, w), whole, atol=1e-5)
    assert torch.allclose(x @ w.dequantize(torch.float32).T, whole, atol=1e-4)


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")
def test_weight_quantization_c_and_torch_bytes_agree():
    w = torch.randn(300, 96) * torch.logspace(-3, 1, 96)
    s = tensor_scale([w])
    part = quantize_weight(w, s)
    data, scales = quantize_blocks_best_scale(w, s, WEIGHT_DIVISORS)
    assert torch.equal(part.data, data) and torch.equal(part.scales.view(torch.uint8), scales.view(torch.uint8))


def test_fused_group_shares_one_tensor_scale():
    a, b = torch.randn(32, 64), 10 * torch.randn(16, 64)
    pa, pb = quantize_group([("a", a), ("b", b)])
    assert pa.global_scale == pb.global_scale == pytest.approx(float(b.abs().max()) / 2688)


@pytest.fixture(scope="module")
def nvfp4_llm():
    from everybyte import LLM
    return LLM(weights_dtype="nvfp4", dtype="fp32", kv_cache_dtype="fp16", kv_cache_bytes="16MiB",
               max_model_len=512, kv_tiers="none")


@needs_kernel
def test_real_model_fused_tokens_equal_reference(nvfp4_llm, monkeypatch):
    from everybyte import SamplingParams
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Name three primes:"]
    fused = [o.token_ids for o in nvfp4_llm.generate(prompts, p)]
    nvfp4_llm.reset_prefix_cache()
    monkeypatch.setattr(nvfp4_gemm, "GEMV_MAX_ROWS", 0)                  # every call dequantizes
    assert [o.token_ids for o in nvfp4_llm.generate(prompts, p)] == fused


def test_real_model_weights_are_packed(nvfp4_llm):
    mem = nvfp4_llm.stats()["memory"]
    weights = mem["g1"]["weights"] if "g1" in mem else mem["weights"]
    fp32 = sum(p.numel() for p in load_model(None, weights_dtype="fp32").model.parameters()) * 4
    assert weights == nvfp4_llm.weights_bytes and weights <= 0.16 * fp32
    assert not any(p.dtype == torch.float32 and p.dim() == 2 for p in nvfp4_llm.loaded.model.parameters())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("quant") / "smollm2-nvfp4"
    assert cli.main(["quantize", "--to", "nvfp4", str(out)]) == 0
    return out


def test_checkpoint_files_follow_modelopt(checkpoint):
    cfg = json.loads((checkpoint / "config.json").read_text())
    assert cfg["quantization_config"]["quant_algo"] == "NVFP4" and cfg["quantization_config"]["group_size"] == 16
    hq = json.loads((checkpoint / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "NVFP4" and hq["kv_cache_quant_algo"] == "NVFP4"
    assert (checkpoint / "tokenizer.json").is_file()
    assert "chat_template" in json.loads((checkpoint / "tokenizer_config.json").read_text())
    t = load_file(checkpoint / "model.safetensors")
    name = "model.layers.3.self_attn.q_proj"
    assert t[f"{name}.weight"].dtype == torch.uint8 and tuple(t[f"{name}.weight"].shape) == (576, 288)
    assert t[f"{name}.weight_scale"].dtype == torch.float8_e4m3fn and tuple(t[f"{name}.weight_scale"].shape) == (576, 36)
    assert t[f"{name}.weight_scale_2"].dtype == torch.float32 and t[f"{name}.weight_scale_2"].dim() == 0
    assert t[f"{name}.input_scale"].dtype == torch.float32 and t[f"{name}.input_scale"].item() > 0
    for other in ("k_proj", "v_proj"):        # q/k/v share a tensor scale (vLLM fuses them)
        assert t[f"model.layers.3.self_attn.{other}.weight_scale_2"].item() == t[f"{name}.weight_scale_2"].item()
    assert t["model.layers.3.input_layernorm.weight"].dtype == torch.bfloat16
    k_scale = t["model.layers.3.self_attn.k_proj.k_scale"]
    assert k_scale.dtype == torch.float32 and k_scale.dim() == 0 and k_scale.item() > 0


def _maps_file(ptr: int, file) -> bool:
    for line in open("/proc/self/maps"):
        span, *rest = line.split()
        lo, hi = (int(v, 16) for v in span.split("-"))
        if lo <= ptr < hi:
            return rest[-1] == str(file)
    return False


def test_checkpoint_loads_packed_and_memory_mapped(checkpoint):
    from everybyte import LLM, SamplingParams
    loaded = load_model(checkpoint, dtype="fp32")
    assert loaded.weights_format == "nvfp4" and loaded.quant.quant_algo == "NVFP4"
    part = loaded.model.model.layers[5].mlp.down_proj.packed.parts[0]
    assert _maps_file(part.data.data_ptr(), (checkpoint / "model.safetensors").resolve())
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(dtype="fp32", kv_cache_dtype="fp16", kv_cache_bytes="16MiB", max_model_len=256, kv_tiers="none")
    llm = LLM(loaded, **{**kw, "kv_cache_dtype": "nvfp4"})         # the checkpoint's own KV scales
    k_scale = load_file(checkpoint / "model.safetensors")["model.layers.2.self_attn.k_proj.k_scale"].item()
    assert llm.pool.k_scales[2] == pytest.approx(k_scale)
    packed_tokens = LLM(loaded, **kw).generate(["Once upon a time"], p)[0].token_ids
    float_tokens = LLM(checkpoint, weights_dtype="fp32", **kw).generate(["Once upon a time"], p)[0].token_ids
    assert packed_tokens == float_tokens


def test_quantize_needs_force_for_a_non_empty_dir(tmp_path, capsys):
    (tmp_path / "x").write_text("keep")
    assert cli.main(["quantize", "--to", "nvfp4", str(tmp_path)]) == 2
    assert "--force" in capsys.readouterr().err and (tmp_path / "x").read_text() == "keep"
    assert cli.main(["quantize", "--to", "int3", str(tmp_path / "y")]) == 2


def _tiny_checkpoint(tmp_path, arch="qwen2"):
    """A tiny model quantized with everybyte's writer: returns (dir, tensors)."""
    hf_dir = save_hf_dir(tiny_hf(arch), tmp_path / "hf")
    out = tmp_path / "q"
    assert cli.main(["quantize", str(hf_dir), "--to", "nvfp4", str(out), "--dtype", "fp32"]) == 0
    return out, load_file(out / "model.safetensors")


def test_tiny_qwen2_checkpoint_logits_close_to_float(tmp_path):
    """q/k/v bias and tied embeddings through the packed path: logits near the float model's."""
    out, _ = _tiny_checkpoint(tmp_path)
    ids = list(range(3, 40))
    packed_logits = everybyte_logits(load_model(out), ids)
    float_logits = everybyte_logits(load_model(tmp_path / "hf"), ids)
    assert torch.nn.functional.cosine_similarity(packed_logits, float_logits, dim=-1).min() > 0.95
    assert torch.allclose(packed_logits, everybyte_logits(load_model(out, weights_dtype="fp32"), ids), atol=1e-3)


def _rewrite(out, tensors, **changes):
    for k, v in changes.items():
        if v is None:
            tensors.pop(k)
        else:
            tensors[k] = v
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("case, message", [
    ("missing_scale", "weight_scale: missing"),
    ("bad_scale_shape", "weight_scale: dtype"),
    ("bad_scale_2", "not a finite non-negative scale"),
    ("algo", "quantization 'FP8' is not supported; supported: NVFP4"),
    ("truncated", "corrupt or truncated safetensors"),
])
def test_bad_checkpoints_fail_at_load(tmp_path, case, message):
    out, t = _tiny_checkpoint(tmp_path)
    name = "model.layers.0.mlp.down_proj"
    if case == "missing_scale":
        _rewrite(out, t, **{f"{name}.weight_scale": None})
    elif case == "bad_scale_shape":
        _rewrite(out, t, **{f"{name}.weight_scale": t[f"{name}.weight_scale"][:, :1].contiguous()})
    elif case == "bad_scale_2":
        _rewrite(out, t, **{f"{name}.weight_scale_2": torch.tensor(float("nan"))})
    elif case == "algo":
        q = json.loads((out / "hf_quant_config.json").read_text())
        q["quantization"]["quant_algo"] = "FP8"
        (out / "hf_quant_config.json").write_text(json.dumps(q))
    else:
        data = (out / "model.safetensors").read_bytes()
        (out / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model(out)


def test_unquantizable_weights_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"w1: shape \(4, 24\): in-dimension 24 is not a multiple of 16"):
        quantize_group([("w1", torch.randn(4, 24))])
    w = torch.randn(8, 32)
    w[3, 17] = float("inf")
    with pytest.raises(ValueError, match=r"w2: non-finite value inf at index \[3, 17\]"):
        quantize_group([("w2", w)])


def test_packed_weights_off_cpu_are_a_clear_error():
    with pytest.raises(ValueError, match="NVFP4 weights run on CPU only"):
        load_model(None, weights_dtype="nvfp4", device="meta")


def test_gptq_lowers_the_output_error_on_its_calibration_inputs():
    from everybyte.formats.nvfp4_gptq import gptq_group
    g = torch.Generator().manual_seed(3)
    z = torch.randn(512, 8, generator=g)                                    # correlated input channels, as
    x = z @ torch.randn(8, 64, generator=g) + 0.1 * torch.randn(512, 64, generator=g)   # activations are
    w = torch.randn(48, 64, generator=g)
    h = x.double().T @ x.double()
    out_err = lambda part: (x @ part.dequantize().T - x @ w.T).square().sum().item()
    rtn, = quantize_group([("w", w)])
    gptq, = gptq_group([("w", w)], h)
    assert gptq.global_scale == rtn.global_scale
    assert out_err(gptq) < 0.5 * out_err(rtn)                              # measured: 0.10x


def test_quantize_gptq_checkpoint_loads(tmp_path):
    hf_dir = save_hf_dir(tiny_hf("qwen2"), tmp_path / "hf")
    out = tmp_path / "q"
    assert cli.main(["quantize", str(hf_dir), "--to", "nvfp4", str(out), "--dtype", "fp32", "--method", "gptq"]) == 0
    ids = list(range(3, 40))
    packed_logits = everybyte_logits(load_model(out), ids)
    float_logits = everybyte_logits(load_model(hf_dir), ids)
    assert load_model(out).weights_format == "nvfp4"
    assert torch.nn.functional.cosine_similarity(packed_logits, float_logits, dim=-1).min() > 0.95
