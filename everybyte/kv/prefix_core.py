"""The G1 prefix cache compiled: `native/csrc/prefix_core.c` makes PrefixCache's decisions (with
its default policy, ParkedFirst(LRUPolicy()), and the session side of kv/prefix_sessions) with
per-block state in C arrays. The engine and the simulator both get it from `new_prefix_cache()`;
the Python PrefixCache stays the reference (tests/test_prefix_core.py runs both on the same random
operations and compares every result, order and callback).

`new_prefix_cache()` falls back to the Python class, with one warning, when the extension does
not build (no C compiler or no Python headers), and always when EVERYBYTE_NATIVE_KV=0.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable, Hashable, Iterable, Protocol, Sequence

from everybyte.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from everybyte.kv.prefix_cache import NoFreeBlocks, PrefixCache
from everybyte.kv.prefix_sessions import SHARED
from everybyte.native import loader

__all__ = ["G1Cache", "native_kv_enabled", "native_prefix_cache_class", "new_prefix_cache",
           "native_unavailable_reason"]
log = logging.getLogger("everybyte.kv.prefix_cache")


class G1Cache(Protocol):
    """What the data plane and the block manager use of a prefix cache (both classes have it)."""
    num_blocks: int
    block_size: int
    on_event: Callable[[KVEvent], None] | None

    @property
    def stats(self) -> dict[str, int]: ...
    @property
    def ref(self) -> Sequence[int]: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_empty_blocks(self) -> int: ...
    @property
    def num_used_blocks(self) -> int: ...
    def counts(self) -> dict[str, int]: ...
    def can_allocate(self, n: int) -> bool: ...
    def ref_count(self, block_id: int) -> int: ...
    def count_unreferenced(self, block_ids: Sequence[int]) -> int: ...
    def name_of(self, block_id: int) -> bytes | None: ...
    def block_of(self, name: bytes) -> int | None: ...
    def evictable_order(self) -> list[int]: ...
    def lookup(self, names: Sequence[bytes]) -> list[int]: ...
    def acquire(self, names: Sequence[bytes], owner: Hashable = ..., limit: int | None = ...) -> list[int]: ...
    def refresh(self, names: Sequence[bytes], owner: Hashable = ...) -> int: ...
    def count_hits(self, names: Sequence[bytes], limit: int) -> tuple[int, int]: ...
    def share(self, block_ids: Sequence[int]) -> None: ...
    def allocate(self, n: int = 1, ascending: bool = False) -> list[int]: ...
    def evict(self, n: int = 1) -> list[tuple[int, bytes]]: ...
    def evict_blocks(self, block_ids: Iterable[int]) -> list[tuple[int, bytes]]: ...
    def commit(self, block_id: int, name: bytes, owner: Hashable = ..., parent: bytes | None = None,
               token_ids: Sequence[int] = ...) -> int: ...
    def commit_run(self, block_ids: Sequence[int], names: Sequence[bytes], start: int, end: int,
                   owner: Hashable = ..., token_ids: Sequence[int] | None = None) -> list[int]: ...
    def free(self, block_ids: Sequence[int]) -> None: ...
    def touch(self, block_ids: Iterable[int]) -> None: ...
    def clear(self) -> int: ...
    def park(self, session_id: Hashable, expected_return: float | None = None) -> list[int]: ...
    def unpark(self, session_id: Hashable) -> int: ...
    def drop(self, session_id: Hashable, keep: Callable[[bytes], bool] | None = None) -> list[bytes]: ...


class _Hooks:
    """What the C core calls back into: Python objects and the event and logging paths."""
    SHARED = SHARED
    NoFreeBlocks = NoFreeBlocks

    @staticmethod
    def emit_stored(on_event: Callable[[KVEvent], None], names: list[bytes], block_size: int,
                    parent: bytes | None, token_ids: list[int] | None) -> None:
        """A run of blocks named in one call (kv/event_run); the lists are the core's to give away."""
        on_event(BlockStored(names, block_size, parent, token_ids=token_ids if token_ids is not None else []))

    @staticmethod
    def emit_removed(on_event: Callable[[KVEvent], None], names: list[bytes]) -> None:
        on_event(BlockRemoved(names))

    @staticmethod
    def emit_cleared(on_event: Callable[[KVEvent], None]) -> None:
        on_event(AllBlocksCleared())

    @staticmethod
    def log_evict_failure(block_id: int, exc: BaseException) -> None:
        log.error("on_evict failed for block %d; its content is dropped", block_id, exc_info=exc)


_why: list[str] = []


@functools.cache
def native_prefix_cache_class() -> Any:
    """The compiled PrefixCache class, or None (the reason in native_unavailable_reason())."""
    module, why = loader.try_module("prefix_core", "compiled prefix cache", "the Python PrefixCache",
                                   headers=("name_hash.h",))
    if module is None:
        _why.append(why or "unknown")
        return None
    core: Any = module.PrefixCore

    class NativePrefixCache(core):  # type: ignore[misc]
        """PrefixCache (default policy) in C; the same constructor without `policy`."""

        def __init__(self, num_blocks: int, on_evict: Callable[[int, bytes], None] | None = None,
                     max_owners: int = 32, on_event: Callable[[KVEvent], None] | None = None,
                     block_size: int = 16) -> None:
            super().__init__(num_blocks, _Hooks, max_owners, block_size)
            self.on_evict, self.on_event = on_evict, on_event

        def can_allocate(self, n: int) -> bool:
            return bool(n <= self.num_free_blocks)

        def counts(self) -> dict[str, int]:
            """Blocks by state: running (ref > 0), parked, cached (reusable), empty; they sum to num_blocks."""
            parked = self.num_parked
            return {"running": self.num_used_blocks, "parked": parked, "cached": self.num_evictable - parked,
                    "empty": self.num_empty_blocks}

    return NativePrefixCache


def native_unavailable_reason() -> str | None:
    native_prefix_cache_class()
    return _why[0] if _why else None


def native_kv_enabled() -> bool:
    """Whether new_prefix_cache() gives the compiled class (it builds, EVERYBYTE_NATIVE_KV is not 0)."""
    return os.environ.get("EVERYBYTE_NATIVE_KV", "1") != "0" and native_prefix_cache_class() is not None


def new_prefix_cache(num_blocks: int, on_evict: Callable[[int, bytes], None] | None = None,
                     max_owners: int = 32, on_event: Callable[[KVEvent], None] | None = None,
                     block_size: int = 16) -> G1Cache:
    """A PrefixCache with the default policy: compiled when it builds and EVERYBYTE_NATIVE_KV is not 0."""
    cls = native_prefix_cache_class() if native_kv_enabled() else None
    if cls is None:
        return PrefixCache(num_blocks, on_evict=on_evict, max_owners=max_owners, on_event=on_event,
                           block_size=block_size)
    cache: G1Cache = cls(num_blocks, on_evict=on_evict, max_owners=max_owners, on_event=on_event,
                         block_size=block_size)
    return cache
