"""A request's prompt tokens and block names at the router, computed exactly as a worker does.

The tokenizer is built from the same model files the worker loads (models/tokenizer, torch-free):
a GGUF's metadata read with the `gguf` package's reader, or a Hugging Face directory's
tokenizer.json. Chat requests go through the model's chat template (serve's message shape),
completions through a plain encode; block names through kv/block_id with the worker's namespace
(from /v1/kv/info), salted by the request's cache_salt. A body the router cannot read gives no
tokens: the request is still routed, and the worker answers its 4xx.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from everybyte.kv.block_id import KVNamespace, chain_block_ids
from everybyte.models.tokenizer import Tokenizer
from everybyte.serve.protocol import ChatCompletionRequest


def load_tokenizer(model: str | None) -> Tokenizer:
    """The tokenizer of `model` (a GGUF file, a directory with one, or an HF directory; None: the
    default model), without importing torch."""
    from everybyte.models.default_model import default_model_path
    path = Path(default_model_path() if model is None else model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path not found: {path}")
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return Tokenizer.from_hf_dir(path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ValueError(f"{path}: needs tokenizer.json or exactly one .gguf file")
        path = ggufs[0]
    from gguf import GGUFReader
    reader = GGUFReader(str(path))
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return Tokenizer.from_gguf_metadata(metadata)


class RequestBlocks:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def prompt_tokens(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The token ids the worker will prefill for this body, or None when it cannot be read."""
        try:
            if path.endswith("/chat/completions"):
                req = ChatCompletionRequest.model_validate(body)
                messages = [{"role": m.role, "content": m.text(), **({"tool_calls": m.tool_calls} if m.tool_calls else {})}
                            for m in req.messages]
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
                return self.tokenizer.encode(text, add_special_tokens=False)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
                prompt = prompt[0]            # several prompts go to one worker: route by the first
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt)
            if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return list(prompt)
        except (ValidationError, Exception):     # a body or template the router cannot read: route unhinted
            return None
        return None


def block_names(ns: KVNamespace, token_ids: list[int], cache_salt: str | None = None) -> list[bytes]:
    """Names of the prompt's full blocks in `ns` (salted like the worker salts a tenant's blocks)."""
    return chain_block_ids(_salted(ns, cache_salt), token_ids)


@lru_cache(maxsize=1024)
def _salted(ns: KVNamespace, salt: str | None) -> KVNamespace:
    return ns.with_tenant(salt) if salt else ns          # the worker salts only a non-empty salt


def namespace_from_info(fields: dict[str, Any]) -> KVNamespace:
    """The base namespace a worker states in /v1/kv/info (`KVNamespace(**ns)`)."""
    return KVNamespace(**fields)
