"""`everybyte convert MODEL --to hf DIR`: the default GGUF written as a Hugging Face directory gives the
same logits through everybyte's HF loader and through transformers, and the same tokens and chat
prompts through transformers' AutoTokenizer; tiny GGUFs of every architecture (llama3 rope, q/k bias,
q/k norm) and sharded output; bad input."""
import json

import pytest
import torch
from test_loaders import ARCHS, IDS, everybyte_logits, hf_logits, tiny_hf, write_gguf
from test_tokenizer import CHATS, TEXTS

from everybyte import cli
from everybyte.models.hf_export import export_hf
from everybyte.models.loader import load_model

transformers = pytest.importorskip("transformers", reason="the parity reference; in the test extra")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("convert") / "smollm2-hf"
    assert cli.main(["convert", "--to", "hf", str(out), "--dtype", "fp32"]) == 0
    return out


@pytest.fixture(scope="module")
def gguf_model():
    return load_model(None)


@pytest.fixture(scope="module")
def prompt(gguf_model):
    return gguf_model.tokenizer.encode_chat([{"role": "user", "content": "Name three prime numbers and a color."}])


def test_files_and_config(converted):
    names = {p.name for p in converted.iterdir()}
    assert names >= {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                     "model.safetensors"}
    c = json.loads((converted / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLM"] and c["torch_dtype"] == "float32"
    assert c["tie_word_embeddings"] is True and c["rope_theta"] == 100000.0 and c["eos_token_id"] == 2
    tc = json.loads((converted / "tokenizer_config.json").read_text())
    assert (tc["bos_token"], tc["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert "<|im_start|>" in tc["chat_template"]
    from safetensors import safe_open
    with safe_open(converted / "model.safetensors", framework="pt") as st:
        keys = set(st.keys())
        assert st.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.float32
    assert "model.layers.29.mlp.down_proj.weight" in keys and "lm_head.weight" not in keys


def test_everybyte_hf_loader_matches_gguf(converted, gguf_model, prompt):
    hf_dir = load_model(converted)
    assert hf_dir.config.eos_token_ids == gguf_model.config.eos_token_ids
    diff = (everybyte_logits(hf_dir, prompt) - everybyte_logits(gguf_model, prompt)).abs().max().item()
    assert diff <= 1e-3


def test_transformers_logits_match_gguf(converted, gguf_model, prompt):
    """transformers' Llama applies rope in HF's q/k layout: equal logits mean the export undid llama.cpp's
    permutation."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    assert (hf_logits(hf, prompt) - everybyte_logits(gguf_model, prompt)).abs().max().item() <= 1e-3


def test_transformers_tokenizer_matches(converted, gguf_model):
    ours, ref = gguf_model.tokenizer, transformers.AutoTokenizer.from_pretrained(converted)
    for text in TEXTS:
        for special in (True, False):
            assert ref.encode(text, add_special_tokens=special) == ours.encode(text, add_special_tokens=special)
        assert ref.decode(ours.encode(text)) == ours.decode(ours.encode(text), skip_special_tokens=False)
    for chat in CHATS:
        for gen in (True, False):
            text = ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert text == ours.apply_chat_template(chat, add_generation_prompt=gen)
    assert (ref.bos_token_id, ref.eos_token_id) == (ours.bos_token_id, ours.eos_token_ids[0])


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tiny_gguf_of_each_architecture(arch, tmp_path):
    hf = tiny_hf(arch)
    out = export_hf(write_gguf(hf, tmp_path / f"{arch}.gguf", arch), tmp_path / "hf", dtype="fp32",
                    shard_bytes=1 << 16)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert back.config.architectures == [type(hf).__name__]
    assert (hf_logits(back, IDS) - hf_logits(hf, IDS)).abs().max().item() <= 1e-4
    assert (everybyte_logits(load_model(out), IDS) - hf_logits(hf, IDS)).abs().max().item() <= 1e-4


def test_bf16_default_dtype(tmp_path):
    hf = tiny_hf("qwen2")
    out = export_hf(write_gguf(hf, tmp_path / "q.gguf", "qwen2"), tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_model(out).config.attention_bias


def test_bad_input(tmp_path, capsys):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    assert cli.main(["convert", "--to", "hf", str(full)]) == 2
    assert "not empty" in capsys.readouterr().err and (full / "keep.txt").is_file()
    assert cli.main(["convert", "--to", "onnx", str(tmp_path / "o")]) == 2
    assert "unknown --to format 'onnx'; choose from hf" in capsys.readouterr().err
    assert cli.main(["convert", str(tmp_path / "missing.gguf"), "--to", "hf", str(tmp_path / "m")]) == 2
    assert "not found" in capsys.readouterr().err and not (tmp_path / "m").exists()
    with pytest.raises(SystemExit):
        cli.main(["convert", "--to", "hf", str(tmp_path / "d"), "--dtype", "int8"])


def test_force_replaces_a_non_empty_dir(tmp_path):
    hf = tiny_hf("qwen3")
    gguf = write_gguf(hf, tmp_path / "q3.gguf", "qwen3")
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("x")
    assert cli.main(["convert", str(gguf), "--to", "hf", str(out), "--force", "--dtype", "fp32"]) == 0
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]      # no temp dir left behind
