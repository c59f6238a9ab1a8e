"""Spark-X2.5 served by ``vllm serve`` on loopback, through the official ``openai`` client.

One server (module scope) for every test: the tiny random checkpoint in fp32, eager, with
``--enable-auto-tool-choice --tool-call-parser spark25``. A random model does not choose to call
tools, so the chat tests constrain its output with a regex (vLLM's structured outputs) to the
tagged call format; what is checked is the way back: the served parser turning that text into
OpenAI ``tool_calls`` with the schema's JSON types, streaming and not. A named or ``"required"``
``tool_choice`` constrains the output to vLLM's JSON schema of the tools instead (compact JSON, so
that a random model ends it); those tests' tools have only enumerated values. Completions are
checked token for token against the plain-torch reference.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from spark_helpers import spark_tiny_dir  # noqa: F401

from omni_cpu_fastpath.testing.spark_reference import Reference

pytestmark = pytest.mark.slow

MODEL = "spark-tiny"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "unit": {"type": "string"},
                },
                "required": ["city", "days"],
            },
        },
    }
]
# The tagged format, with a string parameter whose value is "null".
CALL_REGEX = (
    r"<tool_call>get_weather<arg_key>city</arg_key><arg_value>[a-z]{2,6}</arg_value>"
    r"<arg_key>days</arg_key><arg_value>[1-9]</arg_value>"
    r"<arg_key>unit</arg_key><arg_value>null</arg_value></tool_call>"
)


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(spark_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:  # noqa: F811
    tmp = tmp_path_factory.mktemp("spark-served")
    port = _free_port()
    log = tmp / "server.log"
    env = {
        **os.environ,
        "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
    }
    vllm = str(Path(sys.executable).parent / "vllm")
    cmd = [
        vllm, "serve", str(spark_tiny_dir), "--served-model-name", MODEL, "--host", "127.0.0.1",
        "--port", str(port), "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "4",
        "--enforce-eager", "--enable-auto-tool-choice", "--tool-call-parser", "spark25",
        "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}',
    ]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    srv = Server(proc, port, log)
    deadline = time.monotonic() + 600
    while not srv.healthy():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"vllm serve did not come up:\n{log.read_text()[-6000:]}")
        time.sleep(2)
    yield srv
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _client(server: Server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)


def _chat_args() -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the weather in Oslo for 3 days?"}],
        "tools": TOOLS,
        "temperature": 0.0,
        "max_tokens": 200,
        "extra_body": {"structured_outputs": {"regex": CALL_REGEX}},
    }


def _check_call(name: str, arguments: str) -> dict:
    assert name == "get_weather"
    args = json.loads(arguments)
    assert set(args) == {"city", "days", "unit"}
    assert isinstance(args["city"], str) and re.fullmatch(r"[a-z]{2,6}", args["city"])
    assert isinstance(args["days"], int) and not isinstance(args["days"], bool) and 1 <= args["days"] <= 9
    assert args["unit"] == "null"  # a string parameter keeps the text, not JSON null
    return args


def test_chat_returns_openai_tool_calls_with_schema_types(server: Server):
    resp = _client(server).chat.completions.create(**_chat_args())
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    _check_call(call.function.name, call.function.arguments)
    assert not (choice.message.content or "").strip()


def test_streamed_chat_returns_the_same_tool_call(server: Server):
    client = _client(server)
    whole = client.chat.completions.create(**_chat_args()).choices[0].message.tool_calls[0]
    name, arguments, finish, ids = "", "", None, set()
    for chunk in client.chat.completions.create(**_chat_args(), stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            assert tc.index == 0
            ids.add(tc.id) if tc.id else None
            name += tc.function.name or ""
            arguments += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(ids) == 1
    assert _check_call(name, arguments) == json.loads(whole.function.arguments)


ENUM_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Time in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["oslo", "rome"]},
                "hour": {"type": "integer", "enum": [1, 2, 3]},
            },
            "required": ["city", "hour"],
            "additionalProperties": False,
        },
    },
}


def test_named_tool_choice_returns_that_tool_call_streaming_and_not(server: Server):
    client = _client(server)
    args = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What time is it in Rome?"}],
        "tools": [*TOOLS, ENUM_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "temperature": 0.0,
        "max_tokens": 64,
    }
    choice = client.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "stop", choice  # OpenAI's reason for a named tool choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and call.id
    called = json.loads(call.function.arguments)
    assert set(called) == {"city", "hour"}
    assert called["city"] in ("oslo", "rome") and called["hour"] in (1, 2, 3)
    assert not (choice.message.content or "").strip()
    name, arguments = "", ""
    for chunk in client.chat.completions.create(**args, stream=True):
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            name += tc.function.name or ""
            arguments += tc.function.arguments or ""
    assert name == "get_time" and json.loads(arguments) == called


def test_required_tool_choice_returns_calls_of_the_given_tools_streaming_and_not(
    server: Server,
    spark_tiny_dir: Path,  # noqa: F811
):
    # "required": vLLM constrains the output to a JSON array of one or more calls of any of the
    # tools and parses it back. A random model would go on adding calls, so the array's "]" is
    # favoured: the grammar allows it only once the first call is complete.
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(spark_tiny_dir / "tokenizer.json"))
    close = [i for i in range(tokenizer.get_vocab_size()) if "]" in tokenizer.decode([i])]
    assert close
    client = _client(server)
    other = {"type": "function", "function": {**ENUM_TOOL["function"], "name": "get_date"}}
    args = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What time is it in Rome?"}],
        "tools": [ENUM_TOOL, other],
        "tool_choice": "required",
        "temperature": 0.0,
        "max_tokens": 200,
        "logit_bias": {str(i): 100 for i in close},
    }
    choice = client.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert len(calls) == 1 and not (choice.message.content or "").strip()
    whole = []
    for call in calls:
        called = json.loads(call.function.arguments)
        assert call.function.name in ("get_time", "get_date"), call
        assert set(called) == {"city", "hour"}
        assert called["city"] in ("oslo", "rome") and called["hour"] in (1, 2, 3)
        whole.append((call.function.name, called))
    streamed: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(**args, stream=True):
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            part = streamed.setdefault(tc.index, ["", ""])
            part[0] += tc.function.name or ""
            part[1] += tc.function.arguments or ""
    assert [(n, json.loads(a)) for _, (n, a) in sorted(streamed.items())] == whole


def test_completions_equal_the_reference_and_streaming_equals_whole(server: Server, spark_tiny_dir: Path):  # noqa: F811
    prompt = list(range(16, 36))  # longer than the tiny window
    want, _ = Reference(spark_tiny_dir).greedy(prompt, 12)
    client = _client(server)
    args = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0.0}
    whole = client.completions.create(**args, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert whole.choices[0].token_ids == want
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(**args, stream=True, extra_body={"ignore_eos": True})
    )
    assert streamed == whole.choices[0].text


@pytest.mark.parametrize(
    "args,status",
    [
        ({"model": "no-such-model"}, 404),
        ({"max_tokens": -3}, 400),
        ({"prompt": list(range(16, 316)) * 4}, 400),  # longer than --max-model-len 1024
        ({"extra_body": {"structured_outputs": {"regex": "("}}}, 400),
    ],
)
def test_bad_requests_get_a_4xx_and_the_server_keeps_serving(server: Server, args: dict, status: int):
    import openai

    client = _client(server)
    request = {"model": MODEL, "prompt": [16, 17, 18], "max_tokens": 4, **args}
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(**request)
    assert err.value.status_code == status, err.value
    assert server.healthy()
    ok = client.completions.create(model=MODEL, prompt=[16, 17, 18], max_tokens=2, temperature=0.0)
    assert len(ok.choices[0].text) > 0 or ok.usage.completion_tokens == 2
