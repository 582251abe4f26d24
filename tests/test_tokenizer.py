"""The tokenizer built from the default model's GGUF against transformers' tokenizer from the same file,
the HF-directory path, and the chat-template sandbox."""
import os

import jinja2
import pytest
from tokenizers import pre_tokenizers

from everybyte.models.default_model import default_model_path
from everybyte.models.gguf_file import GGUFFile
from everybyte.models.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers", reason="the parity reference; in the test extra")

TEXTS = [
    "Hello, world!",
    "def f(x):\n    return x ** 2  # square\n\n\tif a != b:\n\t\tpass\n",
    "naïve café — 日本語のテキスト, Ünïcödé, emoji 🤖🚀 and \u00a0nbsp\u3000ideographic space",
    "   leading,    runs   of   spaces,\n\n\n\ttabs\t\tand trailing   ",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><repo_name>x<file_sep>",
    "numbers 1234567 3.14159 2024-01-01 and 0x1F",
    "don't we'll I'M you're",
    "",
    " ",
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again, in 日本語?"}],
]


@pytest.fixture(scope="module")
def pair():
    path = default_model_path()
    ours = Tokenizer.from_gguf_metadata(GGUFFile(path).metadata)
    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return ours, ref


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(pair, text):
    ours, ref = pair
    for special in (True, False):
        assert ours.encode(text, add_special_tokens=special) == ref.encode(text, add_special_tokens=special)
    ids = ref.encode(text)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_chat_template_matches_transformers(pair):
    ours, ref = pair
    for chat in CHATS:
        for gen in (True, False):
            text = ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == text
            assert ours.encode_chat(chat, gen) == ref.encode(text, add_special_tokens=False)


def test_special_ids(pair):
    ours, ref = pair
    assert ours.vocab_size == len(ref) == 49152
    assert ours.eos_token_ids == [ref.eos_token_id] == [2] and ours.bos_token_id == 1
    assert ours.special_tokens["eos_token"] == "<|im_end|>"


def test_hf_directory_tokenizer(pair, tmp_path):
    ours, ref = pair
    ref.save_pretrained(tmp_path)  # the template goes to chat_template.jinja or tokenizer_config.json
    from_dir = Tokenizer.from_hf_dir(tmp_path)
    assert from_dir.eos_token_ids == [2] and from_dir.bos_token_id == 1
    for text in TEXTS:
        assert from_dir.encode(text) == ours.encode(text)
        assert from_dir.decode(ours.encode(text), False) == ours.decode(ours.encode(text), False)
    assert from_dir.apply_chat_template(CHATS[1]) == ours.apply_chat_template(CHATS[1])
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path / "missing")


def with_template(tokenizer, template):
    return Tokenizer(tokenizer.backend, chat_template=template, special_tokens=tokenizer.special_tokens)


def test_template_globals_and_sandbox(pair):
    ours, _ = pair
    msgs = [{"role": "user", "content": "x", "tool_calls": None}]
    t = with_template(ours, "{% for m in messages %}{% generation %}{{ m | tojson }}{% endgeneration %}"
                            "{% if loop.last %}{% break %}{% endif %}{% endfor %}{{ bos_token }}")
    assert t.apply_chat_template(msgs) == '{"role": "user", "content": "x"}<|im_start|>'
    t = with_template(ours, "{{ raise_exception('no system role') }}")
    with pytest.raises(jinja2.TemplateError, match="no system role"):
        t.apply_chat_template(msgs)
    t = with_template(ours, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        t.apply_chat_template(msgs)
    assert with_template(ours, "{{ strftime_now('%Y') | length }}{{ enable_thinking }}").apply_chat_template(
        msgs, enable_thinking=False) == "4False"
    with pytest.raises(ValueError, match="no chat template"):
        with_template(ours, None).apply_chat_template(msgs)


def test_gguf_pre_tokenizers_split_digits_like_llama_cpp():
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": []}
    splits = {}
    for pre in ("smollm", "qwen2", "llama-bpe", "gpt2"):
        backend = Tokenizer.from_gguf_metadata({**md, "tokenizer.ggml.pre": pre}).backend
        splits[pre] = [p for p, _ in backend.pre_tokenizer.pre_tokenize_str("ab 12345")]
    assert splits["smollm"] == ["ab", "Ġ", "1", "2", "3", "4", "5"]
    assert splits["qwen2"] == ["ab", "Ġ", "1", "2", "3", "4", "5"]
    assert splits["llama-bpe"] == ["ab", "Ġ", "123", "45"]
    assert splits["gpt2"] == ["ab", "Ġ12345"]
    with pytest.raises(ValueError, match="'llama'.*gpt2"):
        Tokenizer.from_gguf_metadata({**md, "tokenizer.ggml.model": "llama"})
