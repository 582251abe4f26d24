"""Block names a session's next turn can reuse: the tokens and names of the last context of each
of the most recently active sessions (bounded, least recent dropped). A new sequence of the
session takes the names of its longest whole-block prefix equal, token for token, to that
context (a session with none: the most recent context of any session); only the blocks after it
are hashed. Names depend only on the tokens and the tenant salt, so a checked prefix is always
right; the memo saves hashing, nothing else."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Hashable, TypeVar

from everybyte.kv.block_id import compiled_names


class NameMemo:
    def __init__(self, max_sessions: int = 0) -> None:
        self.max_sessions = max_sessions
        # session -> (salt, tokens, names, blocks): the first `blocks` names name those blocks of tokens
        self.entries: OrderedDict[Hashable, tuple[str | None, list[int], list[bytes], int]] = OrderedDict()
        self.reused = 0                       # names taken from the memo instead of hashed

    def keep(self, session: Hashable, salt: str | None, tokens: list[int], names: list[bytes],
             block_size: int) -> None:
        """The session's context now: `names` are the names of the first len(names) blocks of
        `tokens`. Both are kept by reference, not copied (a context is most of a request's
        tokens): the caller only ever appends to them, as a sequence does to its token ids and
        block names, so their first len(names) blocks stay what they are now."""
        if not self.max_sessions or not names:
            return
        self.entries[session] = (salt, tokens, names, len(names))
        self.entries.move_to_end(session)
        if len(self.entries) > self.max_sessions:
            self.entries.popitem(last=False)

    def prefix(self, session: Hashable, salt: str | None, tokens: list[int], block_size: int) -> list[bytes]:
        """Names of the longest whole-block prefix of `tokens` equal to the session's kept context,
        or, for a session with none (its first turn, or no session), to the most recently kept
        one: sessions often start with the same system prompt."""
        got = self.entries.get(session)
        if got is None and self.entries:
            got = next(reversed(self.entries.values()))
        if got is None or got[0] != salt:
            return []
        _, kept, names, blocks = got
        n = equal_blocks(tokens, kept, min(blocks, len(tokens) // block_size), block_size)
        self.reused += n
        return names[:n]


T = TypeVar("T")


def equal_blocks(tokens: list[T], kept: list[T], n: int, block_size: int) -> int:
    """The most leading whole blocks (at most n) in which tokens equals kept, token for token."""
    if tokens is kept:                    # a turn that took its parent's list over (SessionPrompts)
        return n
    native: Any = compiled_names()
    if native is not None:
        return int(native.common_prefix(tokens, kept, n * block_size)) // block_size
    if tokens[:n * block_size] == kept[:n * block_size]:
        return n
    lo, hi = 0, n - 1                     # a turn that keeps only a part: binary search
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tokens[:mid * block_size] == kept[:mid * block_size]:
            lo = mid
        else:
            hi = mid - 1
    return lo
