"""Hermes-style tool calls in model output, and the auto-park they trigger."""
import json

from everybyte.serve.tool_calls import parse_tool_calls, visible_prefix


def test_parse_tool_calls():
    text = 'Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me look."
    assert calls[0]["function"]["name"] == "read_file"
    assert json.loads(calls[0]["function"]["arguments"]) == {"path": "a.py"}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")


def test_malformed_blocks_stay_text():
    text = "<tool_call>not json</tool_call>"
    assert parse_tool_calls(text) == (text, [])
    assert parse_tool_calls("no calls here") == ("no calls here", [])


def test_visible_prefix_holds_back_a_partial_tag():
    assert visible_prefix("Sure <tool") == "Sure "
    assert visible_prefix("Sure <tool_call>{") == "Sure "
    assert visible_prefix("plain text") == "plain text"


def test_tool_call_turn_parks_its_session():
    from everybyte.serve.state import ServerConfig, ServerState

    class FakeEngine:
        parked = []

        def has_unfinished_requests(self):
            return False

        def has_pending_loads(self):
            return False

        def park(self, sid, expected_gap_s=None):
            self.parked.append(sid)

    engine = FakeEngine()
    state = ServerState(engine, tokenizer=None, config=ServerConfig("m", 128, 10))
    state.after_turn("s1", "tool_calls")
    state.after_turn("s2", "stop")
    state.after_turn(None, "tool_calls")
    state.engine.shutdown(timeout=5)
    assert engine.parked == ["s1"]
