"""The KV events of one prefix-cache call, coalesced as they are made (the Python reference of
the C core's `ev_*`, native/csrc/prefix_core.c): a block named with the last block of the pending
BlockStored as its parent (both with token ids or both without) extends it, and consecutive
removals are one BlockRemoved, as kv/events.coalesce merges them. The call hands them to
`on_event` as it returns, in order: a prompt's run of new blocks is one event, not one per block.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Protocol, TypeVar

from everybyte.kv.events import BlockRemoved, BlockStored, KVEvent

F = TypeVar("F", bound=Callable[..., Any])


class PendingEvents:
    """The event being built; flush() hands it over."""

    def __init__(self) -> None:
        self._kind: type | None = None
        self._names: list[bytes] = []
        self._parent: bytes | None = None
        self._tokens: list[int] = []

    def stored(self, on_event: Callable[[KVEvent], None] | None, block_size: int, name: bytes,
               parent: bytes | None, token_ids: Any) -> None:
        if self._kind is BlockStored and parent is not None and parent == self._names[-1] \
                and bool(self._tokens) == bool(token_ids):
            self._names.append(name)
            self._tokens.extend(token_ids)
            return
        self.flush(on_event, block_size)
        self._kind, self._names, self._parent, self._tokens = BlockStored, [name], parent, list(token_ids)

    def removed(self, on_event: Callable[[KVEvent], None] | None, block_size: int, name: bytes) -> None:
        if self._kind is not BlockRemoved:
            self.flush(on_event, block_size)
            self._kind, self._names = BlockRemoved, []
        self._names.append(name)

    def flush(self, on_event: Callable[[KVEvent], None] | None, block_size: int) -> None:
        kind, self._kind = self._kind, None
        if kind is None or on_event is None:
            return
        on_event(BlockStored(self._names, block_size, self._parent, token_ids=self._tokens) if kind is BlockStored
                 else BlockRemoved(self._names))


class _Emitting(Protocol):
    events: PendingEvents
    on_event: Callable[[KVEvent], None] | None
    block_size: int


def emits(method: F) -> F:
    """A cache method whose events go out as it returns; an error it raised stays the error (one
    from on_event then is dropped, as the C core drops it)."""
    @functools.wraps(method)
    def call(self: _Emitting, *args: Any, **kwargs: Any) -> Any:
        try:
            out = method(self, *args, **kwargs)
        except BaseException:
            with contextlib.suppress(Exception):
                self.events.flush(self.on_event, self.block_size)
            raise
        self.events.flush(self.on_event, self.block_size)
        return out
    return call  # type: ignore[return-value]
