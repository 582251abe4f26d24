"""OpenAI wire format: request and response schemas, and OpenAI-style errors."""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from everybyte.engine.sampling_params import SEED_MAX, SEED_MIN
from everybyte.kv.sessions import MAX_GAP_S

MAX_SESSION_ID = 256      # characters of a session id, whether in the body, the header or a path
MAX_CACHE_SALT = 256


class APIError(Exception):
    """An error the client caused or must handle, rendered as OpenAI's error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)   # None: the model's default
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = None
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0)
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    seed: Optional[int] = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    ignore_eos: bool = False
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    user: Optional[str] = None
    session_id: Optional[str] = Field(default=None, max_length=MAX_SESSION_ID)
    cache_salt: Optional[str] = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT)   # vLLM's
    return_token_ids: bool = False    # vLLM-compatible: the generated token ids in each choice
    kv_transfer_params: Optional[dict[str, Any]] = None   # vLLM's disaggregated prefill/decode (engine/kv_transfer)


class CompletionRequest(_Request):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for p in self.content:
            if p.get("type") != "text":
                raise APIError(400, f"unsupported content part type {p.get('type')!r}; only 'text' is supported",
                               param="messages")
            parts.append(str(p.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    tokens: list[int]


class ParkRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    expected_gap_s: Optional[float] = Field(default=None, ge=0, le=MAX_GAP_S, allow_inf_nan=False)
