"""Tool calls in model output, Hermes style (Qwen2.5, many agent fine-tunes):
<tool_call>{"name": "...", "arguments": {...}}</tool_call>. A turn that ends in tool calls
gets finish_reason "tool_calls", and its session is parked while the agent runs the tool."""
from __future__ import annotations

import json
import re
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Split output into (content before the first call or None, OpenAI tool_calls). Blocks
    that are not a JSON object with a "name" stay in the content."""
    calls = []
    for m in _BLOCK.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": args if isinstance(args, str) else json.dumps(args)}})
    if not calls:
        return text, []
    content = text[:text.index(OPEN)].strip()
    return content or None, calls


def visible_prefix(text: str) -> str:
    """The part of streamed text that can be shown before tool calls are parsed at the end:
    everything before an opening tag, minus a tail that could still become one."""
    i = text.find(OPEN)
    if i >= 0:
        return text[:i]
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return text[:-k]
    return text
