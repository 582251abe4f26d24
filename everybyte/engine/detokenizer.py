"""Incremental detokenization and stop-string matching for one request."""
from __future__ import annotations

_CONTEXT = 5   # prompt tokens decoded before the output so leading spaces come out right


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self._held = 0           # characters at the end of text that could still start a stop string

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str | None:
        """Append a token; returns the stop string it completed (text truncated before it), if any."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        if not self.stop:
            return None
        # only the new text and the max_stop_len - 1 characters before it can hold a new match:
        # the cost per token depends on this request's stop strings, never on how long its text is
        start = max(0, len(self.text) - len(delta) - self.max_stop_len + 1)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            self._held = self._partial_stop()
            return None
        i, s = min(hits)
        self.text, self._held = self.text[:i], 0
        return s

    def _partial_stop(self) -> int:
        """Length of the longest tail of text that is a proper prefix of some stop string."""
        text, held = self.text, 0
        for s in self.stop:
            tail = text[len(text) - min(len(s) - 1, len(text)):]
            p = tail.find(s[0])
            while 0 <= p and len(tail) - p > held:       # the earliest start is the longest tail
                if s.startswith(tail[p:]):
                    held = len(tail) - p
                    break
                p = tail.find(s[0], p + 1)
        return held

    def stable_text(self) -> str:
        """The text minus a tail that could still become a stop string (safe to stream)."""
        return self.text[:len(self.text) - self._held]
