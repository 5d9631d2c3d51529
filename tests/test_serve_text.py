"""The server's pure text functions: reasoning split and tool-call parsing, whole and streamed.

The streamed outputs must equal the whole-text ones however the text is cut (here: one character
at a time, and every two-piece cut), and no partial tag may leak into the answer text.
"""

import json

import pytest

from dflash_jax.serve.reasoning import ReasoningSplitter, prompt_opens_reasoning, split_reasoning
from dflash_jax.serve.tool_calls import ToolCallParser, parse_call

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}, "hours": {"type": "array"},
    "scale": {"type": "number"}, "note": {"type": ["string", "null"]}}}}}]


def run(pieces, in_reasoning=False, tools=TOOLS):
    """``(reasoning, content, [(name, arguments dict)])`` of text fed in ``pieces``."""
    sp, tp = ReasoningSplitter(in_reasoning), ToolCallParser(tools)
    reasoning, content, calls = [], [], []
    for piece in list(pieces) + [None]:
        r, c = sp.feed(piece) if piece is not None else sp.finish()
        text, new = tp.feed(c)
        reasoning.append(r)
        content.append(text)
        calls += new
    content.append(tp.finish())
    return "".join(reasoning), "".join(content), [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


CASES = [
    # (text, in_reasoning, reasoning, content, calls)
    ("<think>plan it</think>\n\nThe answer.", False, "plan it", "The answer.", []),
    ("  <think>a < b</think>x", False, "a < b", "x", []),
    ("plain <think>not reasoning</think>", False, "", "plain <think>not reasoning</think>", []),
    ("still thinking</think>done", True, "still thinking", "done", []),
    ("<think>cut by the budget", False, "cut by the budget", "", []),
    ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n', False, "", "Sure.",
     [("get_weather", {"city": "Paris", "days": 3})]),
    ("<think>hm</think><tool_call>get_weather\n<arg_key>city</arg_key><arg_value>  New York \n</arg_value>\n"
     "<arg_key>days</arg_key><arg_value> 3 </arg_value>\n<arg_key>metric</arg_key><arg_value>true</arg_value>\n"
     "<arg_key>hours</arg_key><arg_value>[1, 2]</arg_value><arg_key>scale</arg_key><arg_value>1.5</arg_value>"
     "<arg_key>note</arg_key><arg_value> x</arg_value></tool_call>", False, "hm", "",
     [("get_weather", {"city": "  New York \n", "days": 3, "metric": True, "hours": [1, 2], "scale": 1.5, "note": " x"})]),
    ('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call><tool_call>b</tool_call>', False, "", "",
     [("a", {"x": 1}), ("b", {})]),
    ("<tool_call>{not json}</tool_call> after", False, "", "<tool_call>{not json}</tool_call> after", []),
    ("text <tool_call>get_weather<arg_key>city", False, "", "text<tool_call>get_weather<arg_key>city", []),
    ("a <tool_ call> b", False, "", "a <tool_ call> b", []),
]


@pytest.mark.parametrize("text,in_reasoning,reasoning,content,calls", CASES)
def test_whole_and_streamed_agree(text, in_reasoning, reasoning, content, calls):
    assert run([text], in_reasoning) == (reasoning, content, calls)
    assert run(list(text), in_reasoning) == (reasoning, content, calls)  # one character at a time
    for i in range(len(text) + 1):  # every cut into two pieces
        assert run([text[:i], text[i:]], in_reasoning) == (reasoning, content, calls), i


def test_no_partial_tag_leaks_while_streaming():
    text = "<think>r</think>ok <tool_call>get_weather<arg_key>city</arg_key><arg_value>x</arg_value></tool_call>"
    sp, tp = ReasoningSplitter(), ToolCallParser(TOOLS)
    for ch in text:
        r, c = sp.feed(ch)
        out, _ = tp.feed(c)
        assert "<" not in out and "<" not in r, ch


def test_split_reasoning_and_prompt_detection():
    assert split_reasoning("no tags") == (None, "no tags")
    assert split_reasoning("<think></think>x") == ("", "x")
    assert prompt_opens_reasoning("<assistant><think>\n") and not prompt_opens_reasoning("<assistant><think></think>")


def test_parse_call_refuses_what_is_not_a_call():
    assert parse_call('{"arguments": {}}', {}) is None  # no name
    assert parse_call("f<arg_key>k</arg_key>", {}) is None  # a key without a value
    assert parse_call("bad name\n", {}) is None
    assert parse_call("f<arg_key>k</arg_key>no value", {}) is None
    assert parse_call("", {}) is None
    assert parse_call("f<arg_key>k</arg_key><arg_value>{bad</arg_value>", {}) == ("f", '{"k": "{bad"}')  # untyped: text
