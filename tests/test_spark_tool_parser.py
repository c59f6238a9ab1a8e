"""The ``spark25`` tool-call parser on model text (no engine): complete and streamed output.

Streaming is checked against the non-streaming result of the same text, for every way of cutting
the text into deltas of 1, 2, 3 and 7 characters (tags split anywhere).
"""

from __future__ import annotations

import json

import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from omni_cpu_fastpath.spark.tool_parser import Spark25ToolParser, convert_value

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "unit": {"type": "string"},
                    "detailed": {"type": "boolean"},
                    "hours": {"type": "array"},
                    "ratio": {"type": ["number", "null"]},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}},
]


def _request() -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS)


def _parser() -> Spark25ToolParser:
    return Spark25ToolParser(tokenizer=None)  # type: ignore[arg-type]  # the parser reads text only


TEXT = (
    "Let me check.\n"
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>null</arg_value>"
    "<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>unit</arg_key><arg_value>123</arg_value>"
    "<arg_key>detailed</arg_key><arg_value>true</arg_value>"
    "<arg_key>hours</arg_key><arg_value>[1, 2]</arg_value>"
    "<arg_key>ratio</arg_key><arg_value>null</arg_value></tool_call>\n"
    '<tool_call>search<arg_key>q</arg_key><arg_value>{"a": 1}</arg_value>'
    "<arg_key>text</arg_key><arg_value>a < b</arg_value></tool_call>"
)
WANT = [
    (
        "get_weather",
        {"city": "null", "days": 3, "unit": "123", "detailed": True, "hours": [1, 2], "ratio": None},
    ),
    ("search", {"q": {"a": 1}, "text": "a < b"}),
]


def test_complete_output_gives_typed_arguments_and_the_text_as_content():
    info = _parser().extract_tool_calls(TEXT, _request())
    assert info.tools_called
    got = [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]
    assert got == WANT
    assert info.content == "Let me check."


def test_plain_text_is_content_and_no_call():
    info = _parser().extract_tool_calls("no tools here <tool_ but not a call", _request())
    assert not info.tools_called and info.content == "no tools here <tool_ but not a call"


@pytest.mark.parametrize(
    "raw,types,want",
    [
        ("null", {"string"}, "null"),
        ("7", {"integer"}, 7),
        ("true", {"integer"}, "true"),  # a bool is not an integer; nothing fits: kept as text
        ("2.5", {"number"}, 2.5),
        ("x y", {"integer"}, "x y"),
        ("null", {"number", "null"}, None),
        ("[1]", None, [1]),
        ("hello", None, "hello"),
    ],
)
def test_values_take_the_schema_type(raw, types, want):
    got = convert_value(raw, types)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_streaming_equals_the_complete_parse_for_any_cut(size: int):
    parser, request = _parser(), _request()
    previous, content, calls = "", "", {}
    for i in range(0, len(TEXT), size):
        delta = TEXT[i : i + size]
        current = previous + delta
        msg = parser.extract_tool_calls_streaming(previous, current, delta, [], [], [], request)
        previous = current
        if msg is None:
            continue
        content += msg.content or ""
        for tc in msg.tool_calls:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
            entry["id"] = entry["id"] or tc.id
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == WANT
    assert all(c["id"] for c in calls.values())
    assert content.strip() == "Let me check." and "<tool" not in content
    assert parser.get_remaining_unstreamed_args() == ""


def test_tool_requests_keep_special_tokens_for_the_parser():
    request = _parser().adjust_request(_request())
    assert request.skip_special_tokens is False
