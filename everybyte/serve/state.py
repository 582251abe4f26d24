"""What the HTTP layer holds: the engine thread, the tokenizer, metrics and limits."""
from __future__ import annotations

import time
from dataclasses import dataclass

from everybyte.serve.async_engine import AsyncEngine
from everybyte.serve.metrics import ServerMetrics


@dataclass
class ServerConfig:
    model_name: str
    max_model_len: int
    vocab_size: int
    api_keys: tuple[str, ...] = ()          # any of them is accepted; empty: no key needed
    max_queue: int = 256
    max_body_bytes: int = 8 * 1024 * 1024
    auto_park: bool = True
    cache_salt_from_api_key: bool = False   # tenants (keys) get apart KV blocks and session names
    role: str = "both"                      # disaggregation: both | prefill | decode
    kv_connector: str | None = None         # the endpoint this worker serves its KV blocks on


class ServerState:
    def __init__(self, engine, tokenizer, config: ServerConfig):
        self.config = config
        self.tokenizer = tokenizer
        self.engine = AsyncEngine(engine, max_queue=config.max_queue)
        self.metrics = ServerMetrics()
        self.started = int(time.time())

    def after_turn(self, session_id: str | None, finish_reason: str | None) -> None:
        """A chat turn that ends in tool calls means the agent goes off to run a tool: park its
        session so its KV leaves the device until the next turn."""
        if session_id and finish_reason == "tool_calls" and self.config.auto_park:
            self.engine.park(session_id)
