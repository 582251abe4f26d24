"""Incremental detokenization and stop strings with a byte-level toy tokenizer."""
from everybyte.engine.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def feed(text, stop=(), prompt=b"hi "):
    d = IncrementalDetokenizer(ByteTokenizer(), list(prompt), list(stop))
    streamed, hit = [], None
    for b in text.encode():
        hit = d.add(b)
        streamed.append(d.stable_text())
        if hit:
            break
    return d, hit, streamed


def test_multibyte_characters_wait_for_completion():
    d, hit, streamed = feed("é€x")
    assert d.text == "é€x" and hit is None
    assert all("\ufffd" not in s for s in streamed)


def test_stop_string_truncates_and_holds_back():
    d, hit, streamed = feed("hello END world", stop=["END", "xyz"])
    assert hit == "END" and d.text == "hello "
    assert all(not s.endswith(("E", "EN")) for s in streamed)
    assert all(d.text.startswith(s) for s in streamed)


def test_stop_string_spanning_tokens_and_earliest_wins():
    d, hit, _ = feed("abcdef", stop=["cde", "bcdef"])
    assert hit == "cde" and d.text == "ab"


def test_no_stop():
    d, hit, streamed = feed("plain text", stop=["zz"])
    assert hit is None and d.text == "plain text" and streamed[-1] == "plain text"
