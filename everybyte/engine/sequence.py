"""A request's token ids and progress; what the scheduler and block manager see."""
from __future__ import annotations

import time
from enum import Enum, auto
from itertools import count
from typing import Any, ClassVar

from everybyte.engine.outputs import RequestMetrics
from everybyte.engine.sampling_params import SamplingParams
from everybyte.kv.seq_state import KVSequence


class SequenceStatus(Enum):
    WAITING = auto()
    LOADING = auto()      # admitted, its KV blocks loading from a tier; not computed until they are in
    RUNNING = auto()
    FINISHED = auto()


class Sequence(KVSequence):
    counter: ClassVar[count[int]] = count()

    def __init__(self, token_ids: list[int], params: SamplingParams | None = None,
                 request_id: str | None = None, prompt: str | None = None,
                 arrival_time: float | None = None, adopt: bool = False):
        """adopt: the sequence takes token_ids as its own list (its output is appended to it)
        instead of a copy, and the caller changes it no more (the simulator's prompt builder reads
        only the prompt part back; the copy was about 2% of the simulator's instructions)."""
        self.seq_id = next(Sequence.counter)
        self.request_id = str(self.seq_id) if request_id is None else request_id
        self.status = SequenceStatus.WAITING
        self.token_ids = token_ids if adopt else list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0     # tokens whose KV is in the pool
        self.kv_stored_until = 0         # positions below already stored in the pool (recomputed, not rewritten)
        self.block_table: list[int] = []
        self.params = params or SamplingParams()
        self.prompt = prompt
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[dict[int, float]] | None = [] if self.params.logprobs is not None else None
        self.session_id: str | None = None       # agent session this request belongs to
        self.cache_salt: str | None = None       # tenant salt: blocks are shared only within it
        self.num_cached_tokens = 0               # prompt tokens reused instead of computed
        self.kv_transfer: str | None = None      # "publish": its prompt's KV goes to a decode worker
        self.kv_transfer_params: dict[str, Any] | None = None   # where that KV waits, once published
        self.metrics = RequestMetrics(time.time() if arrival_time is None else arrival_time)

    @property
    def first_admission(self) -> bool:
        return self.metrics.first_scheduled_time is None

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def block(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size:(i + 1) * block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, status={self.status.name}, len={len(self)}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")
