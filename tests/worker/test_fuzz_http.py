"""The worker's OpenAI-style HTTP API under hostile requests (hypothesis), in-process (the app over Starlette's test
client, the tiny model pair decoding): every answer is 200 or a 4xx in the OpenAI error shape, and a request wrong
in one field is refused naming that field; never a 500, and /health answers after.

Bodies are JSON with every known field of any type (numbers huge and negative, NaN and Infinity as Python's JSON
writes them, lone surrogates, deep nesting), unknown fields, invalid UTF-8, or random bytes. Decoding stays short:
the worker's max_tokens limit is 8. Sampling parameters include the values at float32, bfloat16 and float16 limits
(tests/fuzzing.py). Run counts: `pytest --hypothesis-show-statistics tests/worker/test_fuzz_http.py`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st
from starlette.testclient import TestClient

from decoder.worker.app import build_app
from decoder.worker.config import load_worker_config
from decoder.worker.service import WorkerService
from tests.fuzzing import DTYPE_LIMITS, fuzz_settings
from tests.worker.conftest import MODEL, write_config

MAX_TOKENS_LIMIT = 8  # any request asking for more is refused: no example decodes long
MAX_BODY = 64 << 10
PATHS = ["/v1/completions", "/v1/chat/completions"]
VALID = {
    "/v1/completions": {"prompt": "def f(x):", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0},
}


@pytest.fixture(scope="module")
def client(tiny_pair, tmp_path_factory) -> Iterator[TestClient]:
    path = write_config(
        tmp_path_factory.mktemp("fuzz-http"), "fuzz", tiny_pair, draft=str(tiny_pair.draft),
        max_tokens_limit=MAX_TOKENS_LIMIT, default_max_tokens=4, max_batch=4,
        limits={"max_request_bytes": MAX_BODY, "max_prompt_chars": 4_000, "max_prompt_tokens": 1_000},
    )  # fmt: skip
    service = WorkerService(load_worker_config(path))
    service.startup()
    try:
        with TestClient(build_app(service), raise_server_exceptions=False) as client:
            assert client.get("/health").status_code == 200  # the models are loaded
            yield client
    finally:
        service.shutdown()


# --- strategies ----------------------------------------------------------------------------------------------

huge_ints = st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**30, -(10**30)])
json_numbers = st.one_of(
    st.integers(-3, 12), huge_ints, st.integers(), st.floats(), st.sampled_from([math.nan, math.inf, -math.inf, 0.5])
)
texts = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["", "\ud800", "a\udfffb", "\x00", "draft", "none", "tenant-a", MODEL, "x" * 129, "😀"]),
)
json_scalars = st.one_of(st.none(), st.booleans(), json_numbers, texts)
json_values = st.recursive(
    json_scalars, lambda children: st.lists(children, max_size=3) | st.dictionaries(texts, children, max_size=3),
    max_leaves=8,
)  # fmt: skip
content_parts = st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", 1])}, optional={"text": json_values}),
    max_size=3,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool", "robot", ""]) | json_values},
        optional={"content": texts | content_parts | json_values, "name": json_values},
    ),
    max_size=3,
)
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "prompt": st.one_of(texts, st.lists(texts, max_size=2), st.lists(st.integers(-2, 300) | huge_ints, max_size=5)),
    "messages": messages,
    "model": st.sampled_from([MODEL, None, "", "other"]) | texts,
    "max_tokens": st.integers(-1, MAX_TOKENS_LIMIT + 1) | json_numbers,
    "temperature": st.sampled_from([0, 0.0, 1, 2, 2.0001, -0.0, *DTYPE_LIMITS]) | json_numbers,
    "top_p": st.sampled_from([0, 0.5, 1, 1.5, *DTYPE_LIMITS]) | json_numbers,
    "top_k": st.sampled_from([0, 1, 5, 10**6, 2**31 - 1, 2**31, 2**63 - 1]) | json_numbers,
    "stop": st.one_of(texts, st.lists(texts, max_size=6)),
    "seed": st.sampled_from([0, -1, -(2**63), 2**64 - 1, 2**64]) | json_numbers,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": json_values}) | json_values,
    "n": st.sampled_from([1, 2, 0]) | json_numbers,
    "logprobs": st.sampled_from([None, False, 0, True, 5]) | json_values,
    "echo": st.booleans() | json_values,
    "segment": st.sampled_from(["tenant-a", "a" * 128, "a" * 129, "a b", ""]) | texts,
    "speculation": st.fixed_dictionaries(
        {"drafter": st.sampled_from(["draft", "prompt_lookup", "none", "other"])},
        optional={"k": st.integers(-1, 65) | json_numbers, "report": json_values},
    ) | json_values,
}  # fmt: skip
field_values = {name: strategy | json_values for name, strategy in FIELDS.items()}


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    """Any subset of the known fields, each of any type, plus unknown fields."""
    names = draw(st.sets(st.sampled_from(sorted(FIELDS))))
    body = {name: draw(field_values[name]) for name in sorted(names)}
    body.update(draw(st.dictionaries(st.text(max_size=8).filter(lambda k: k not in FIELDS), json_values, max_size=2)))
    return body


def encode(draw: Callable[..., Any], body: Any) -> bytes:
    """JSON as Python writes it (NaN and Infinity as bare words); lone surrogates escaped or, raw, as invalid UTF-8."""
    if draw(st.booleans()):
        return json.dumps(body).encode()
    return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")


@st.composite
def raw_bodies(draw: st.DrawFn) -> bytes:
    """Random bytes, JSON of the wrong shape, or a body nested deeper than any parser recurses."""
    kind = draw(st.sampled_from(["bytes", "json", "nested"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "json":
        return encode(draw, draw(json_values))
    depth = draw(st.integers(1, 30_000))
    opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
    return ('{"prompt": "x", "deep": ' + opener * depth + "1" + closer * depth + "}").encode()


# --- the checks -----------------------------------------------------------------------------------------------


def post(client: TestClient, path: str, content: bytes) -> Any:
    return client.post(path, content=content, headers={"content-type": "application/json"})


def check_answer(response: Any, record: bool = True) -> dict[str, Any] | None:
    """200 (a completion, or a whole event stream) or a 4xx in the OpenAI error shape; the error, if any.
    ``record``: count the status among the test's hypothesis events (--hypothesis-show-statistics)."""
    if record:
        event(f"HTTP {response.status_code}")
    assert response.status_code < 500, f"{response.status_code}: {response.text[:2000]}"
    if response.status_code == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            text = response.text
            assert text.endswith("data: [DONE]\n\n"), text[-500:]
            assert "server_error" not in text, text[-2000:]
        else:
            assert response.json()["choices"], response.text
        return None
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] in ("invalid_request_error", "not_found_error", "rate_limit_error"), error
    assert error["param"] is None or isinstance(error["param"], str), error
    return dict(error)


def assert_healthy(client: TestClient) -> None:
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text


# --- the tests ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@given(body=bodies(), data=st.data())
@fuzz_settings(150)
def test_any_json_body_is_answered_200_or_4xx(client: TestClient, path: str, body: dict[str, Any], data: st.DataObject):
    check_answer(post(client, path, encode(data.draw, body)))


@pytest.mark.parametrize("path", PATHS)
@given(field=st.sampled_from(sorted(FIELDS)), data=st.data())
@fuzz_settings(150)
def test_one_hostile_field_is_named_in_the_error(client: TestClient, path: str, field: str, data: st.DataObject):
    """A valid request with one field replaced: served, or refused naming that field (in ``param`` or the message)."""
    value = data.draw(field_values[field], label="value")
    check_named(client, path, field, value, encode(data.draw, {**VALID[path], field: value}))


def check_named(client: TestClient, path: str, field: str, value: Any, content: bytes, record: bool = True) -> None:
    error = check_answer(post(client, path, content), record)
    if error is not None and "JSON" not in error["message"]:  # invalid UTF-8 or JSON: no field to name
        named = f"{error['param'] or ''} {error['message']}"
        assert field in named, f"{field}={value!r} refused without naming it: {error}"


@pytest.mark.parametrize("path", PATHS)
@given(content=raw_bodies())
@example(content=b'{"prompt": "\\ud800", "max_tokens": 1}')
@example(content=b'{"prompt": "x", "max_tokens": 1, "temperature": NaN}')
@example(content=b"\xff\xfe{}")
@example(content=b"{" * (MAX_BODY + 1))
@fuzz_settings(100)
def test_any_bytes_are_answered_400_or_413(client: TestClient, path: str, content: bytes):
    check_answer(post(client, path, content))


@pytest.mark.parametrize("path", PATHS)
def test_the_worker_is_healthy_after_the_fuzzing(client: TestClient, path: str):
    nan = json.dumps({**VALID[path], "temperature": math.nan}).encode()  # NaN once said "must be <= 2"
    check_named(client, path, "temperature", math.nan, nan, record=False)
    assert_healthy(client)
