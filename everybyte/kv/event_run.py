"""The KV events of one prefix-cache call, handed over as the call returns and coalesced as
kv/events.coalesce merges them (the Python reference of the C core's `ev_*`,
native/csrc/prefix_core.c): a run of blocks one call names in a chain is one BlockStored, the
blocks it forgets one BlockRemoved, not one event per block.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Protocol, TypeVar

from everybyte.kv.events import BlockRemoved, BlockStored, KVEvent, coalesce

F = TypeVar("F", bound=Callable[..., Any])


class PendingEvents:
    """The current call's events, one per block until flush() merges and hands them over."""

    def __init__(self) -> None:
        self._events: list[KVEvent] = []

    def stored(self, block_size: int, name: bytes, parent: bytes | None, token_ids: Any) -> None:
        self._events.append(BlockStored([name], block_size, parent, token_ids=list(token_ids)))

    def removed(self, name: bytes) -> None:
        self._events.append(BlockRemoved([name]))

    def flush(self, on_event: Callable[[KVEvent], None] | None) -> None:
        events, self._events = self._events, []
        if on_event is not None:
            for e in coalesce(events):
                on_event(e)


class _Emitting(Protocol):
    events: PendingEvents
    on_event: Callable[[KVEvent], None] | None


def emits(method: F) -> F:
    """A cache method whose events go out as it returns; an error it raised stays the error (one
    from on_event then is dropped, as the C core drops it)."""
    @functools.wraps(method)
    def call(self: _Emitting, *args: Any, **kwargs: Any) -> Any:
        try:
            out = method(self, *args, **kwargs)
        except BaseException:
            with contextlib.suppress(Exception):
                self.events.flush(self.on_event)
            raise
        self.events.flush(self.on_event)
        return out
    return call  # type: ignore[return-value]
