"""Tokenizer: a `tokenizers` backend built from tokenizer.json (HF directory) or from GGUF metadata
(byte-level BPE, split like llama.cpp), plus the model's jinja chat template."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
           "falcon3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4


class Tokenizer:
    def __init__(self, backend: Backend, *, bos_token_id: int | None = None, eos_token_ids=(),
                 chat_template: str | None = None, special_tokens: dict[str, str] | None = None):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})  # bos_token/eos_token/... strings for templates
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text, rendered like transformers' apply_chat_template(tokenize=False); encode it
        with add_special_tokens=False (or use encode_chat)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass a plain prompt instead")
        messages = [_normalize_message(m) for m in messages]
        context = {**self.special_tokens, "tools": None, "documents": None, **kwargs}
        return _compile(self.chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                   **context)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)

    @classmethod
    def from_hf_dir(cls, path: str | Path, eos_token_ids=()) -> "Tokenizer":
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ValueError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
        try:
            backend = Backend.from_file(str(file))
        except Exception as e:
            raise ValueError(f"{file}: cannot read tokenizer: {e}") from e
        tc = _read_json(path / "tokenizer_config.json")
        special = {k: v["content"] if isinstance(v, dict) else v
                   for k in ("bos_token", "eos_token", "unk_token", "pad_token") if (v := tc.get(k))}
        template = tc.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):
            template = {t["name"]: t["template"] for t in template}.get("default")
        bos = backend.token_to_id(special["bos_token"]) if "bos_token" in special else None
        eos = [backend.token_to_id(special["eos_token"])] if "eos_token" in special else []
        return cls(backend, bos_token_id=bos, eos_token_ids=_unique([*eos_token_ids, *eos]),
                   chat_template=template, special_tokens=special)

    @classmethod
    def from_gguf_metadata(cls, md: dict) -> "Tokenizer":
        kind = md.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE)")
        tokens = md["tokenizer.ggml.tokens"]
        types = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        backend = _byte_level_bpe(tokens, types, md.get("tokenizer.ggml.merges", []), md.get("tokenizer.ggml.pre"))
        ids = {k: md.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "eot", "eom", "unknown", "padding")}
        bos, prefix, suffix = ids["bos"], [], []
        if md.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
            prefix = [tokens[bos]]
        if md.get("tokenizer.ggml.add_eos_token", False) and ids["eos"] is not None:
            suffix = [tokens[ids["eos"]]]
        if prefix or suffix:
            special = [(t, tokens.index(t)) for t in dict.fromkeys(prefix + suffix)]
            backend.post_processor = processors.TemplateProcessing(
                single=" ".join([*prefix, "$A", *suffix]),
                pair=" ".join([*prefix, "$A", *suffix, *prefix, "$B:1", *suffix]), special_tokens=special)
        names = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
        special_tokens = {k: tokens[ids[v]] for k, v in names.items() if ids[v] is not None}
        eos = [ids[k] for k in ("eos", "eot", "eom") if ids[k] is not None]
        return cls(backend, bos_token_id=bos, eos_token_ids=_unique(eos),
                   chat_template=md.get("tokenizer.chat_template"), special_tokens=special_tokens)


def _byte_level_bpe(tokens: list[str], types: list[int], merges: list[str], pre: str | None) -> Backend:
    alphabet = set(_BYTE_CHARS.values())
    vocab = {}
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        if kind not in (_CONTROL, _USER_DEFINED) and not set(tok) <= alphabet:  # respell raw text in bytes
            tok = "".join(_BYTE_CHARS[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)
    bpe = models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges], ignore_merges=_SPLITS.get(pre) == _LLAMA3_SPLIT)
    backend = Backend(bpe)
    if pre == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False)])
    elif pre in _SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre in ("qwen2", "deepseek-r1-qwen"):
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED])
    return backend


def _bytes_to_unicode() -> dict[int, str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


_BYTE_CHARS = _bytes_to_unicode()


def _unique(ids) -> list[int]:
    return [i for i in dict.fromkeys(ids) if i is not None]


def _read_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{file}: cannot read JSON: {e}") from e


def _normalize_message(message: dict) -> dict:
    message = {k: v for k, v in dict(message).items() if v is not None}
    reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning") if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


class _Generation(jinja2.ext.Extension):
    """Accepts transformers' {% generation %}...{% endgeneration %} markers and renders their body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
