"""Deterministic token content: equal hash ids give equal token ids; a run marker opens each session.

The token at scaled position s of a turn's input comes from the hash block that holds recorded
position s * token_scale: token = f(namespace, hash id, s). The namespace is the trace for global
hash ids (shared across sessions) and the session for local ones. Input past the last hashed block
(an unhashed tail) is unique to its turn. The first MARKER_LEN tokens of every prompt are a marker
derived from the run marker (and, for local ids, the session and its replay instance), so repeated
runs and recycled sessions do not hit each other's cache while sharing inside a run stays intact.

A prompt is built as the model's own output joins the context: a turn that extends an earlier one
is that turn's prompt + the ids generated for it + its new input (SessionPrompts.prompt).
"""
from __future__ import annotations

import functools
import hashlib
import os
from typing import Any, Final

import numpy as np

from everybyte.native import loader
from everybyte.traces.model import Session
from everybyte.traces.scaling import Scaling

MARKER_LEN: Final = 4
_M64: Final = (1 << 64) - 1
_A: Final = 0x2545F4914F6CDD1D


def key64(*parts) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def _mix(x: int) -> int:                      # splitmix64 finalizer
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


_U_A = np.uint64(_A)
_C = [np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 30, 27, 31)]


def _mix_u64(x: np.ndarray) -> np.ndarray:    # _mix over a uint64 array, in place (multiplication wraps mod 2**64)
    x += _C[0]
    x ^= x >> _C[3]
    x *= _C[1]
    x ^= x >> _C[4]
    x *= _C[2]
    x ^= x >> _C[5]
    return x


@functools.cache
def _compiled() -> Any:
    """The compiled prompt tokens, or None (one warning) when they do not build or
    EVERYBYTE_NATIVE_TOKENS=0: numpy then."""
    if os.environ.get("EVERYBYTE_NATIVE_TOKENS", "1") == "0":
        return None
    return loader.try_module("prompt_tokens", "compiled prompt tokens", "numpy")[0]


@functools.lru_cache(maxsize=256)
def _global_key(*parts: str | int) -> int:
    return key64(*parts)


def _scoped_key(scope: str, *parts: str | int) -> int:
    """key64 of a namespace in `scope` (a session id, or "*": the whole trace, made once per trace
    instead of once per session); scope is the second part."""
    return _global_key(parts[0], scope, *parts[1:]) if scope == "*" else key64(parts[0], scope, *parts[1:])


@functools.lru_cache(maxsize=256)
def _marker(low: int, high: int, ns: int) -> list[int]:
    """The run marker's tokens (a global-scope trace's sessions share one: made once, not per session)."""
    return [TokenSpace(low, high).token(ns, i, 0) for i in range(MARKER_LEN)]


class TokenSpace:
    """Token ids drawn from [low, high): clear of special tokens at the bottom of most vocabularies."""

    @classmethod
    def compact(cls) -> "TokenSpace":
        """The simulator's ids, [0, 256): no model reads them, they only name blocks (equal or not,
        and 16 of 256 values collide as rarely as the names' 128 bits), and they are the
        interpreter's own cached ints, a few KB, where a prompt's references into the 29,000 ints of
        [1000, 30000) missed the caches (the prompt generator: 6.7% of the loop's cycles at 2,000
        sessions, under 1.4% with these)."""
        return cls(0, 256)

    @classmethod
    def parse(cls, text: str, option: str = "--vocab-range") -> "TokenSpace":
        """LOW,HIGH as an option gives it; ValueError naming the option when it is not two
        integers or the range is empty."""
        try:
            low, high = (int(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"{option} must be LOW,HIGH (two integers), got {text!r}") from None
        try:
            return cls(low, high)
        except ValueError as e:
            raise ValueError(f"{option} {text!r}: {e}") from None

    def __init__(self, low: int = 1000, high: int = 30000):
        if not 0 <= low < high:
            raise ValueError(f"needs 0 <= LOW < HIGH, got [{low}, {high})")
        self.low, self.high = low, high

    def token(self, ns: int, a: int, b: int) -> int:
        return self.low + _mix(ns ^ _mix((a * _A + b) & _M64)) % (self.high - self.low)


class SessionPrompts:
    """Prompts of one replay instance of a session; `outputs[k]` are the ids generated for turn k."""

    def __init__(self, session: Session, scaling: Scaling, space: TokenSpace, run_marker: str,
                 trace_name: str, instance: int = 0):
        self.session, self.scaling, self.space = session, scaling, space
        scope = session.id if session.hash_scope != "global" else "*"
        self.ns_blocks = _scoped_key(scope, trace_name)
        self.ns_unique = key64(trace_name, session.id, "unique")
        self.marker = _marker(space.low, space.high, _scoped_key(scope, run_marker, instance))
        self.prompts: dict[int, list[int]] = {}
        self.spans: dict[int, list[tuple]] = {}    # (rec_start, rec_end, act_start, act_end, kind, turn)
        self.native: Any = _compiled()             # what content() calls per turn, resolved once

    def content(self, k: int, rec_a: int, rec_b: int, n: int | None = None) -> list[int]:
        """Tokens for recorded input positions [rec_a, rec_b) of turn k (only the last n if given):
        TokenSpace.token over the positions, compiled (native/csrc/prompt_tokens.c) or with numpy."""
        sc = self.scaling
        first, end = sc.scaled_pos(rec_a), sc.scaled_pos(rec_b)
        start = first if n is None else max(first, end - n)
        if end <= start:
            return []
        compiled = self.native
        if compiled is None:
            return self.content_numpy(k, rec_a, start, end)
        space = self.space
        return compiled.content(self.session.turns[k].hash_ids, start, end, float(sc.token_scale), rec_a,
                                self.session.block_size, ((-1 - k) * _A) & _M64, self.ns_blocks, self.ns_unique,
                                space.low, space.high - space.low)

    def content_numpy(self, k: int, rec_a: int, start: int, end: int) -> list[int]:
        """content() for scaled positions [start, end), vectorized (splitmix64 in uint64 wraps like
        & _M64): the reference the compiled path is tested against."""
        turn, sc, bs = self.session.turns[k], self.scaling, self.session.block_size
        s = np.arange(start, end, dtype=np.int64)
        pos = s if sc.token_scale == 1.0 else (s * sc.token_scale).astype(np.int64)   # int(s * scale)
        block = np.maximum(pos, rec_a) // bs              # non-decreasing: the hashed ones come first
        h = turn.hash_ids
        m = int(np.searchsorted(block, len(h)))           # positions in hashed blocks (block < len(h))
        x = np.empty(len(s), dtype=np.uint64)
        if m:
            lo = int(block[0])
            ids = np.array([v & _M64 for v in h[lo:int(block[m - 1]) + 1]], dtype=np.uint64)
            x[:m] = ids[block[:m] - lo] * _U_A
        x[m:] = ((-1 - k) * _A) & _M64
        x += s.view(np.uint64)                            # s >= 0: the same bits
        x = _mix_u64(x)
        x[:m] ^= np.uint64(self.ns_blocks)
        x[m:] ^= np.uint64(self.ns_unique)
        x = _mix_u64(x)
        x %= np.uint64(self.space.high - self.space.low)
        x += np.uint64(self.space.low)
        return x.tolist()

    def filler(self, k: int, n: int) -> list[int]:
        """Stand-in ids for turn k's output when the server's own cannot be had."""
        return [self.space.token(self.ns_unique, 1 << 40 | k, i) for i in range(n)]

    def _cut(self, p: int, rec_pos: int) -> int:
        for ra, rb, aa, ab, kind, _ in self.spans[p]:
            if rec_pos <= ra:
                return aa
            if rec_pos < rb:
                if kind == "in":
                    return min(ab, aa + self.scaling.scaled_pos(rec_pos) - self.scaling.scaled_pos(ra))
                return aa + round((rec_pos - ra) / (rb - ra) * (ab - aa))
        return self._length(p)

    def _length(self, p: int) -> int:
        return self.spans[p][-1][3]             # the end of its last span: a sequence adopting the
                                                # list may have appended its output past it

    def prompt(self, k: int, outputs: dict[int, list[int]], last_child: bool = False) -> list[int]:
        """Turn k's prompt. The caller may append to the list (a Sequence adopting it appends its
        output): only the prompt's own length is read back. last_child: no later turn builds on
        the parent's prompt, so a turn that extends it takes the parent's list over (forgotten
        here; whatever was appended past the parent's prompt is replaced by its output, the same
        tokens when a sequence appended them) instead of copying it."""
        turn = self.session.turns[k]
        base, spans, rec = [], [], 0
        p = turn.parent
        if p is not None and p in self.prompts:
            parent = self.session.turns[p]
            if turn.extends and p in outputs:
                out = outputs[p]
                if last_child:
                    base = self.prompts.pop(p)
                    del base[self._length(p):]
                else:
                    base = self.prompts[p][:self._length(p)]
                base += out
                rec = parent.input_tokens + parent.output_tokens
                spans = self.spans[p] + [(parent.input_tokens, rec, len(base) - len(out), len(base), "out", p)]
            else:
                rec = turn.shared_blocks * self.session.block_size
                cut = self._cut(p, rec)
                base = self.prompts[p][:cut]
                spans = [(ra, min(rb, rec), aa, min(ab, cut), kind, j)
                         for ra, rb, aa, ab, kind, j in self.spans[p] if ra < rec and aa < cut]
        # the context keeps its scaled recorded length: outputs scaled less than inputs take
        # their extra tokens out of the new input (at least one new token stays)
        end = self.scaling.scaled_pos(turn.input_tokens)
        full = max(0, end - self.scaling.scaled_pos(rec))
        want = max(min(1, full), end - len(base))
        new = self.content(k, rec, turn.input_tokens, want) if full else []
        if not base and not new:
            new = [self.space.token(self.ns_unique, -1 - k, 0)]
        spans.append((rec, max(rec, turn.input_tokens), len(base), len(base) + len(new), "in", k))
        ids = base                          # a fresh list in every branch above: extended, not copied
        ids += new
        ids[:MARKER_LEN] = self.marker[:min(MARKER_LEN, len(ids))]
        self.prompts[k], self.spans[k] = ids, spans
        return ids

    def text(self, k: int, out_texts: dict[int, str], out_lens: dict[int, int]) -> str:
        """Turn k's prompt (built by prompt()) as text: content ids as words, outputs as generated."""
        ids, pieces = self.prompts[k], []
        for _, _, aa, ab, kind, j in self.spans[k]:
            if kind == "in":
                pieces.append(ids_to_text(ids[aa:ab]))
            else:
                t, full = out_texts.get(j, ""), max(1, out_lens.get(j, ab - aa))
                pieces.append(t if ab - aa >= full else t[:len(t) * (ab - aa) // full])
        return "".join(pieces)

    def forget(self, k: int) -> None:
        """Drop a turn's prompt once no later turn can build on it (keeps memory flat)."""
        self.prompts.pop(k, None)
        self.spans.pop(k, None)


WORDS = ("the of and to in is for on that with as by at from this be or are an it was not can all "
         "will has one which more about use new may other their time any there data file code line "
         "test run value type list name call return error result first last next make model set get "
         "start end read write open close path user tool step plan note case item part page text word "
         "number field table query index block cache token layer batch queue state event check build "
         "group order point space level image input output source target option method object class "
         "module server client request response session memory device").split()


def ids_to_text(ids: list[int]) -> str:
    """Text stand-in for token ids where an endpoint takes text only: one common word per id."""
    return "".join(" " + WORDS[t % len(WORDS)] for t in ids)
