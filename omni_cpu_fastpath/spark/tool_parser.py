"""The ``spark25`` tool-call parser.

Spark-X2.5 writes each call as
``<tool_call>NAME<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>``. Values are raw
text: each is converted to the JSON type the tool's schema declares for that parameter, so a
string parameter whose value is ``null`` or ``123`` stays a string, and an integer parameter's
``123`` becomes a number. Without a schema a value that parses as JSON is taken as JSON.

Streaming sends text outside calls as content (holding back a possible partial ``<tool_call>``)
and each call, name and complete arguments, once its closing tag has arrived.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import Any

from vllm.entrypoints.chat_utils import make_tool_call_id
from vllm.entrypoints.generate.base.protocol import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tokenizers import TokenizerLike
from vllm.tool_parsers.abstract_tool_parser import Tool, ToolParser
from vllm.tool_parsers.utils import partial_tag_overlap

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so a server's log shows it

NAME = "spark25"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


def _schema_types(tools: Sequence[Any] | None, name: str, key: str) -> set[str] | None:
    """The JSON types the tool ``name`` declares for parameter ``key`` (None: not declared)."""
    for tool in tools or ():
        function = getattr(tool, "function", None)
        if function is None or getattr(function, "name", None) != name:
            continue
        params = getattr(function, "parameters", None) or {}
        prop = (params.get("properties") or {}).get(key)
        if not isinstance(prop, dict) or "type" not in prop:
            return None
        declared = prop["type"]
        return {declared} if isinstance(declared, str) else {str(t) for t in declared}
    return None


def convert_value(raw: str, types: set[str] | None) -> Any:
    """``raw`` as the first declared JSON type it is valid for; a string when nothing else fits."""
    if types == {"string"}:
        return raw
    try:
        parsed = json.loads(raw)
    except ValueError:
        return raw
    if types is None:
        return parsed
    for t in types:
        py = _JSON_TYPES.get(t)
        # bool is an int in Python; an integer parameter must not take true/false.
        if py and isinstance(parsed, py) and not (t in ("integer", "number") and isinstance(parsed, bool)):
            return parsed
    # Nothing declared fits: the text as written, for the caller's validation to report.
    return raw


def parse_call(body: str, tools: Sequence[Any] | None) -> tuple[str, dict[str, Any]]:
    """(name, arguments) of one call's text between its tags."""
    first = body.find("<arg_key>")
    name = (body if first < 0 else body[:first]).strip()
    args = {
        key.strip(): convert_value(value, _schema_types(tools, name, key.strip()))
        for key, value in _ARG.findall(body)
    }
    return name, args


class Spark25ToolParser(ToolParser):
    """OpenAI ``tool_calls`` from Spark-X2.5's tagged format, streaming and not."""

    # A named or "required" tool choice constrains the output to vLLM's JSON schema of the tools,
    # so vLLM's own JSON parsing reads it; this parser reads the model's own format under "auto".
    supports_required_and_named = True

    def __init__(self, tokenizer: TokenizerLike, tools: list[Tool] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._content_sent = 0  # characters of content already streamed
        self._calls_sent = 0

    def adjust_request(self, request: Any) -> Any:
        request = super().adjust_request(request)
        if request.tools and request.tool_choice != "none":
            # The tags may be special tokens, which detokenization would otherwise drop before
            # the parser sees them.
            request.skip_special_tokens = False
        return request

    def _tools(self, request: ChatCompletionRequest | None) -> Sequence[Any] | None:
        if request is not None and getattr(request, "tools", None):
            return request.tools
        return self.tools

    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest
    ) -> ExtractedToolCallInformation:
        if CALL_START not in model_output:
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        tools = self._tools(request)
        calls = []
        for body in _CALL.findall(model_output):
            name, args = parse_call(body, tools)
            if not name:
                logger.warning("spark25: a tool call without a name was dropped")
                continue
            calls.append(
                ToolCall(
                    type="function",
                    function=FunctionCall(name=name, arguments=json.dumps(args, ensure_ascii=False)),
                )
            )
        content = _CALL.sub("", model_output)
        # An unclosed call at the end (output cut off) is not content either.
        cut = content.find(CALL_START)
        if cut >= 0:
            content = content[:cut]
        content = content.strip()
        return ExtractedToolCallInformation(
            tools_called=bool(calls), tool_calls=calls, content=content or None
        )

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: ChatCompletionRequest,
    ) -> DeltaMessage | None:
        # Recomputed from the whole text each time: content outside calls, and complete calls.
        content_parts: list[str] = []
        bodies: list[str] = []
        pos = 0
        while True:
            start = current_text.find(CALL_START, pos)
            if start < 0:
                tail = current_text[pos:]
                hold = partial_tag_overlap(tail, CALL_START)
                content_parts.append(tail[: len(tail) - hold])
                break
            content_parts.append(current_text[pos:start])
            end = current_text.find(CALL_END, start)
            if end < 0:
                break  # a call still arriving
            bodies.append(current_text[start + len(CALL_START) : end])
            pos = end + len(CALL_END)
        content = "".join(content_parts)
        if bodies:
            # Whitespace between and around calls is formatting, not content.
            content = content.rstrip() if content.strip() else ""
        new_content = content[self._content_sent :] if len(content) > self._content_sent else ""
        self._content_sent = max(self._content_sent, len(content))

        deltas: list[DeltaToolCall] = []
        tools = self._tools(request)
        for body in bodies[self._calls_sent :]:
            name, args = parse_call(body, tools)
            arguments = json.dumps(args, ensure_ascii=False)
            index = len(self.prev_tool_call_arr)
            self.prev_tool_call_arr.append({"name": name, "arguments": args})
            self.streamed_args_for_tool.append(arguments)
            self.current_tool_id = index
            deltas.append(
                DeltaToolCall(
                    index=index,
                    type="function",
                    id=make_tool_call_id(),
                    function=DeltaFunctionCall(name=name, arguments=arguments).model_dump(exclude_none=True),
                )
            )
        self._calls_sent = len(bodies)
        if not deltas and not new_content:
            return None
        return DeltaMessage(content=new_content or None, tool_calls=deltas)
