"""The OpenAI-compatible HTTP API of a real `specd worker` process: completions and chat, streamed and not,
the official `openai` client unchanged, /health, /v1/models, /metrics, segments, bad input, and clients that
go away mid-request.

The worker decodes greedily with the draft model (K=3) of a tiny random pair; its text is gibberish (random
weights, byte-level BPE: partial UTF-8 characters included), which makes a good test of the detokenizer."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import openai
import pytest

from tests.worker.conftest import MODEL, Worker

LONG = "The quick brown fox"  # greedy output runs to max_tokens (no EOS within 500 tokens)
ENDS_WITH_EOS = "def hello(x):\n    return"  # greedy output emits EOS after 15 tokens


def completion_text(body: dict) -> str:
    return str(body["choices"][0]["text"])


# -- /v1/completions ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "finish_reason"),
    [
        pytest.param(LONG, 40, "length", id="runs-to-max_tokens"),
        pytest.param(ENDS_WITH_EOS, 64, "stop", id="ends-with-eos"),
    ],
)
def test_streamed_deltas_concatenate_to_the_non_streaming_text(
    draft_worker: Worker, reference, prompt: str, max_tokens: int, finish_reason: str
):
    request: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    full = draft_worker.complete(**request)
    payloads = draft_worker.stream("/v1/completions", {**request, "stream_options": {"include_usage": True}})

    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    *deltas, final, usage_chunk = chunks
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert all(c["choices"][0]["finish_reason"] is None for c in deltas)
    assert len(deltas) > 3, "the text came in one piece: nothing was streamed"
    assert "".join(c["choices"][0]["text"] for c in [*deltas, final]) == completion_text(full)
    assert final["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"] == finish_reason
    assert final["specd"]["drafter"] == full["specd"]["drafter"] == "draft"
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]

    prompt_tokens = len(reference.tokenizer(prompt)["input_ids"])
    completion_tokens = full["usage"]["completion_tokens"]
    assert full["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    specd = full["specd"]
    assert specd["k"] == 3 and specd["decision_reason"] == "local_default"
    assert 0 <= specd["num_accepted"] <= specd["num_drafted"]
    if finish_reason == "length":
        assert completion_tokens == max_tokens
        # the prefill's first token, then accepted + 1 bonus per round
        assert 1 + specd["num_rounds"] + specd["num_accepted"] == completion_tokens
    else:  # tokens the last round accepted past the EOS are not emitted
        assert completion_tokens < max_tokens
        assert 1 + specd["num_rounds"] + specd["num_accepted"] >= completion_tokens


def test_stream_without_usage_ends_with_the_finish_chunk(draft_worker: Worker):
    payloads = draft_worker.stream("/v1/completions", {"prompt": LONG, "max_tokens": 8, "temperature": 0})
    assert payloads[-1] == "[DONE]"
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in p for p in payloads[:-1])


def test_greedy_text_is_the_target_models_own(draft_worker: Worker, reference):
    """The whole HTTP path (tokenize, queue, speculate, detokenize) changes nothing: the text is what the
    target alone decodes greedily, computed here in-process with transformers' generate."""
    for prompt, max_tokens in ((LONG, 48), (ENDS_WITH_EOS, 64)):
        body = draft_worker.complete(prompt, max_tokens=max_tokens, temperature=0)
        ids = reference.greedy(prompt, max_tokens)
        assert completion_text(body) == reference.tokenizer.decode(ids, skip_special_tokens=True)
        assert body["usage"]["completion_tokens"] == len(ids)


def test_a_stop_string_split_across_tokens_is_never_streamed(draft_worker: Worker, reference):
    request: dict[str, Any] = {"prompt": LONG, "max_tokens": 64, "temperature": 0}
    ids = reference.greedy(LONG, 64)
    tokenizer = reference.tokenizer
    stop = _across_a_token_boundary(ids, tokenizer)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    expected = text[: text.find(stop)]
    assert 0 < len(expected) < len(text) - 2

    full = draft_worker.complete(**request, stop=["never-there", stop])
    payloads = draft_worker.stream("/v1/completions", {**request, "stop": stop})
    deltas = [p["choices"][0]["text"] for p in payloads[:-1] if p["choices"]]
    # Deltas are only ever appended: their concatenation being the cut text means no delta held the stop string.
    assert "".join(deltas) == completion_text(full) == expected
    assert full["choices"][0]["finish_reason"] == payloads[-2]["choices"][0]["finish_reason"] == "stop"


def _across_a_token_boundary(ids: list[int], tokenizer) -> str:
    """Two visible ASCII characters of the output, the first ending one token and the second starting the next;
    the first place they occur in the text is that boundary."""
    for i in range(1, len(ids) - 1):
        left, right = tokenizer.decode(ids[i : i + 1]), tokenizer.decode(ids[i + 1 : i + 2])
        stop = left[-1:] + right[:1]
        if len(stop) == 2 and all(33 <= ord(c) < 127 for c in stop):
            before = tokenizer.decode(ids[: i + 1])
            if stop not in before and tokenizer.decode(ids[: i + 2]).find(stop) == len(before) - 1:
                return stop
    raise AssertionError("no boundary between two visible ASCII characters in the greedy output")


# -- /v1/chat/completions ----------------------------------------------------------------------------------

CHAT: list[Any] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Say hi"}]},  # content parts: their text is kept
]
CHAT_AS_TEXT = "system: Be brief.\nuser: Say hi\nassistant:"  # the tiny tokenizer has no chat template


def test_chat_streamed_and_not_agree_and_render_as_a_transcript(draft_worker: Worker):
    request = {"messages": CHAT, "max_tokens": 24, "temperature": 0, "model": MODEL}
    response = draft_worker.post("/v1/chat/completions", request)
    assert response.status_code == 200, response.text
    full = response.json()
    assert full["object"] == "chat.completion" and full["model"] == MODEL
    message = full["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert message["content"] == completion_text(draft_worker.complete(CHAT_AS_TEXT, max_tokens=24, temperature=0))
    assert full["choices"][0]["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 24
    assert full["specd"]["drafter"] == "draft"

    payloads = draft_worker.stream("/v1/chat/completions", request)
    assert payloads[-1] == "[DONE]"
    first, *middle, final = payloads[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in payloads[:-1])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"]["content"] for c in middle) == message["content"]
    assert all(c["choices"][0]["finish_reason"] is None for c in middle)
    assert final["choices"][0]["finish_reason"] == "length" and final["specd"]["k"] == 3


# -- the official openai client, unchanged -----------------------------------------------------------------


def test_the_openai_client_works_unchanged(draft_worker: Worker):
    client = openai.OpenAI(base_url=draft_worker.url + "/v1", api_key="unused", max_retries=0)
    expected = completion_text(draft_worker.complete(LONG, max_tokens=20, temperature=0))

    completion = client.completions.create(model=MODEL, prompt=LONG, max_tokens=20, temperature=0)
    assert completion.choices[0].text == expected
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 20
    assert (completion.model_extra or {})["specd"]["drafter"] == "draft"

    stream = client.completions.create(model=MODEL, prompt=LONG, max_tokens=20, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected

    chat_text = completion_text(draft_worker.complete(CHAT_AS_TEXT, max_tokens=12, temperature=0))
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == chat_text
    chat_stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(chat_stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12

    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=LONG, n=2)
    assert refused.value.param == "n"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt=LONG)


# -- /health, /v1/models, /metrics --------------------------------------------------------------------------


def test_health_and_models(draft_worker: Worker):
    with draft_worker.client() as client:
        health = client.get("/health")
        models = client.get("/v1/models")
    assert health.status_code == 200
    assert health.json() | {"queue_depth": 0, "batch_size": 0} == {
        "status": "ok", "model": MODEL, "queue_depth": 0, "batch_size": 0, "controller": None,
    }  # fmt: skip
    assert models.status_code == 200
    assert [(m["id"], m["object"]) for m in models.json()["data"]] == [(MODEL, "model")]


def test_metrics_count_what_the_requests_did(draft_worker: Worker):
    segment = "metrics-probe"
    before = draft_worker.metrics()
    bodies = [draft_worker.complete(LONG, max_tokens=n, temperature=0, segment=segment) for n in (30, 45)]
    after = draft_worker.metrics()

    def moved(name: str, **labels: str) -> float:
        return after.total(name, **labels) - before.total(name, **labels)

    proposed = sum(b["specd"]["num_drafted"] for b in bodies)
    accepted = sum(b["specd"]["num_accepted"] for b in bodies)
    assert 0 < accepted < proposed, "the near draft should be accepted sometimes, not always"
    assert moved("specd_draft_tokens_total", segment=segment, drafter="draft") == proposed
    assert moved("specd_accepted_tokens_total", segment=segment, drafter="draft") == accepted
    assert moved("specd_requests_total", segment=segment, status="finished") == 2
    assert moved("specd_generated_tokens_total", segment=segment) == 75
    assert moved("specd_decisions_total", segment=segment, drafter="draft", reason="local_default") == 2
    rounds = sum(b["specd"]["num_rounds"] for b in bodies)
    assert moved("specd_rounds_total", segment=segment) == rounds
    # Per draft position: K=3 positions; position i can only be accepted when position i - 1 was.
    proposed_at = [moved("specd_position_proposed_total", segment=segment, position=str(i)) for i in range(4)]
    accepted_at = [moved("specd_position_accepted_total", segment=segment, position=str(i)) for i in range(4)]
    assert sum(proposed_at) == proposed and sum(accepted_at) == accepted and proposed_at[3] == 0
    assert accepted_at[0] >= accepted_at[1] >= accepted_at[2] > 0
    assert moved("specd_step_batch_size_count") >= rounds  # one observation per step
    assert {"specd_queue_depth", "specd_batch_size", "specd_step_seconds_count", "specd_decide_seconds_count",
            "specd_request_seconds_count"} <= after.names()  # fmt: skip
    assert after.total("specd_queue_depth") == 0 and after.total("specd_batch_size") == 0  # idle again


# -- segments ---------------------------------------------------------------------------------------------

CODE = "def area(r):\n    return 3.14 * r * r\n\ndef main():\n    print(area(2))\n"
SQL = "SELECT name, email FROM users WHERE age > 30"


@pytest.mark.parametrize(
    ("prompt", "body_segment", "header", "expected", "why"),
    [
        (LONG, "tenant-x", None, "tenant-x", "the body names it"),
        (LONG, None, "tenant-y", "tenant-y", "the X-Specd-Segment header names it"),
        (LONG, "tenant-x", "tenant-y", "tenant-x", "the body wins over the header"),
        (CODE, None, None, "code", "no name: the heuristic classifier sees Python"),
        (SQL, None, None, "structured", "no name: the heuristic classifier sees SQL"),
        ("Once upon a time, in a small village by the sea, there lived an old fisherman.", None, None, "prose",
         "no name: plain sentences"),
    ],
)  # fmt: skip
def test_the_segment_comes_from_body_header_or_classifier(draft_worker: Worker, prompt, body_segment, header, expected,
                                                          why):  # fmt: skip
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    if body_segment is not None:
        body["segment"] = body_segment
    headers = {"X-Specd-Segment": header} if header else {}
    before = draft_worker.metrics().total("specd_decisions_total", segment=expected)
    response = draft_worker.post("/v1/completions", body, headers=headers)
    assert response.status_code == 200, response.text
    assert response.json()["specd"]["segment"] == expected, why
    assert draft_worker.metrics().total("specd_decisions_total", segment=expected) == before + 1


def test_without_a_classifier_unnamed_requests_get_the_default_segment(lookup_worker: Worker):
    assert lookup_worker.complete(CODE, max_tokens=2)["specd"]["segment"] == "tenant-a"
    assert lookup_worker.complete(CODE, max_tokens=2, segment="named")["specd"]["segment"] == "named"


@pytest.mark.parametrize("where", ["body", "header"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_invalid_segment_is_refused_naming_the_field(draft_worker: Worker, where: str, stream: bool):
    body = {"prompt": LONG, "max_tokens": 2, "stream": stream}
    headers = {}
    if where == "body":
        body["segment"] = "no spaces allowed"
    else:
        headers["X-Specd-Segment"] = "no spaces allowed"
    response = draft_worker.post("/v1/completions", body, headers=headers)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "segment" and error["type"] == "invalid_request_error"
    assert error["message"].startswith("segment"), error["message"]


# -- bad input --------------------------------------------------------------------------------------------


def test_the_caller_can_choose_the_drafter_and_k(draft_worker: Worker):
    # the worker's local default is the draft model at K 3; a request asks for prompt lookup at 5 instead
    body = {"prompt": "a b c a b c a b", "max_tokens": 12, "temperature": 0}
    chosen = draft_worker.complete(**body, speculation={"drafter": "prompt_lookup", "k": 5})
    chain = draft_worker.complete(**body, speculation={"drafter": "chain", "k": 4})  # the worker has both drafters
    plain = draft_worker.complete(**body, speculation={"drafter": "none", "k": 0})
    default = draft_worker.complete(**body)
    assert (chosen["specd"]["drafter"], chosen["specd"]["k"], chosen["specd"]["decision_source"]) == (
        "prompt_lookup", 5, "request")  # fmt: skip
    assert (chain["specd"]["drafter"], chain["specd"]["k"]) == ("chain", 4) and chain["specd"]["num_drafted"] > 0
    assert (plain["specd"]["drafter"], plain["specd"]["num_drafted"]) == ("none", 0)
    assert default["specd"]["drafter"] == "draft"
    texts = {completion_text(r) for r in (chosen, chain, plain, default)}
    assert len(texts) == 1, texts  # greedy: exact


def test_a_request_may_name_every_drafter_there_is():
    from typing import get_args

    from decoder.worker.openai_api import SpeculationChoice
    from specd_api.plan import DRAFTER_NAMES

    assert set(get_args(SpeculationChoice.model_fields["drafter"].annotation)) == set(DRAFTER_NAMES)


@pytest.mark.parametrize(
    ("path", "body", "param", "why"),
    [
        ("/v1/completions", {"prompt": "x", "n": 2}, "n", "one choice per request"),
        ("/v1/completions", {"max_tokens": 2}, "prompt", "no prompt"),
        ("/v1/completions", {"prompt": ""}, "prompt", "an empty prompt"),
        ("/v1/completions", {"prompt": []}, "prompt", "an empty list of tokens"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt", "two prompts in one request"),
        ("/v1/completions", {"prompt": [1, 99999]}, "prompt", "a token id past the vocabulary"),
        ("/v1/completions", {"prompt": [1, -1]}, "prompt", "a negative token id"),
        ("/v1/completions", {"prompt": "x", "temperature": 5}, "temperature", "temperature is 0..2"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p", "top_p is in (0, 1]"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 501}, "max_tokens", "above max_tokens_limit (500)"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "at least one token"),
        ("/v1/completions", {"prompt": "x", "logprobs": 3}, "logprobs", "logprobs are not served"),
        ("/v1/completions", {"prompt": "x", "echo": True}, "echo", "echo is not served"),
        ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 stop strings"),
        ("/v1/completions", {"prompt": "x", "speculation": {"drafter": "medusa", "k": 2}}, "speculation.drafter",
         "an unknown drafter"),
        ("/v1/completions", {"prompt": "x", "speculation": {"drafter": "none", "k": 3}}, "speculation.k",
         "none drafts nothing"),
        ("/v1/completions", {"prompt": "x", "speculation": {"drafter": "draft", "k": 99}}, "speculation.k",
         "K is at most 64"),
        ("/v1/completions", {"prompt": "x", "speculation": {"drafter": "draft", "k": 9}}, "speculation.k",
         "a client's K is at most client_speculation.max_k (8 by default)"),
        ("/v1/completions", {"prompt": "x", "stop": ["ok", "x" * 257]}, "stop", "stop strings: 256 characters each"),
        ("/v1/completions", {"prompt": "x", "top_k": 1 << 31}, "top_k", "top_k is an int32 on the controller's wire"),
        ("/v1/chat/completions", {"messages": []}, "messages", "no messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role",
         "an unknown role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, "logprobs",
         "logprobs are not served"),
        ("/v1/completions", {"prompt": "x", "logprobs": 0}, "logprobs", "0 asks for the chosen token's logprob"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": -100}}, "logit_bias", "a banned token"),
        ("/v1/completions", {"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty", "a penalty"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": -1}, "presence_penalty", "a penalty"),
        ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of", "several candidates"),
        ("/v1/completions", {"prompt": "x", "best_of": True}, "best_of", "true is not 1"),
        ("/v1/completions", {"prompt": "x", "suffix": "end"}, "suffix", "insertion"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [3]}, "stop_token_ids", "stops by id"),
        ("/v1/completions", {"prompt": "x", "min_tokens": 4}, "min_tokens", "a floor on the length"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "response_format": {"type": "json_object"}}, "response_format", "a format"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tools"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                  "max_completion_tokens": 3}, "max_completion_tokens", "two lengths that differ"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(draft_worker: Worker, path: str, body: dict, param: str, why: str):
    for stream in (False, True):
        response = draft_worker.post(path, {**body, "stream": stream})
        assert response.status_code == 400, (why, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error", why
        assert error["param"] == param, (why, error)
        assert error["message"].startswith(param.split(".")[0]), (why, error["message"])
    assert draft_worker.health()["status"] == "ok"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "x", "logit_bias": {}, "frequency_penalty": 0, "presence_penalty": 0.0,
                             "best_of": 1, "suffix": None, "logprobs": None, "stop_token_ids": [], "ignore_eos": False,
                             "user": "someone"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "text"},
                                  "tool_choice": "none", "tools": [], "logprobs": False, "max_tokens": 3,
                                  "max_completion_tokens": 3}),
    ],
)  # fmt: skip
def test_the_no_op_values_of_parameters_not_served_are_taken(draft_worker: Worker, path: str, body: dict) -> None:
    response = draft_worker.post(path, {"max_tokens": 3, **body, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


def test_max_completion_tokens_bounds_a_chat(draft_worker: Worker) -> None:
    body = {"messages": [{"role": "user", "content": "Count: one two three"}], "max_completion_tokens": 3,
            "temperature": 0}  # fmt: skip
    response = draft_worker.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    ("path", "body", "param", "reason", "why"),
    [
        ("/v1/completions", {"prompt": "ab\ud800cd"}, "prompt", "lone surrogate (U+D800) at character 2",
         "JSON can spell a lone surrogate; the tokenizer cannot take one (it was a 500 with a traceback)"),
        ("/v1/completions", {"prompt": ["\udfff"]}, "prompt", "lone surrogate (U+DFFF) at character 0",
         "the same inside the one-prompt list"),
        ("/v1/completions", {"prompt": "x", "stop": ["ok", "\ud800"]}, "stop", "lone surrogate",
         "stop strings are text too"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud83d"}]}, "messages.0.content",
         "lone surrogate (U+D83D) at character 3", "half of an emoji's surrogate pair"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
         "messages.0.content", "lone surrogate", "inside a content part"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
         "messages.0.content", "part 0 is a text part whose text is not a string", "was turned into '5'"),
        ("/v1/completions", {"prompt": "x", "model": "\ud800"}, "model", "lone surrogate",
         "the model name is quoted back in a 404"),
        ("/v1/completions", {"prompt": "x", "temperature": float("nan")}, "temperature", "finite number",
         "NaN fails every comparison; the message once said 'should be less than or equal to 2'"),
        ("/v1/completions", {"prompt": "x", "temperature": float("inf")}, "temperature", "finite number",
         "Infinity is what JSON parsers here accept too"),
        ("/v1/completions", {"prompt": "x", "top_p": float("-inf")}, "top_p", "finite number", "nor -Infinity"),
        ("/v1/completions", {"prompt": "x", "seed": 1 << 64}, "seed", "less than 18446744073709551616",
         "a torch generator takes 64 bits; 2**64 was a 400 that named no field"),
    ],
)  # fmt: skip
def test_text_and_numbers_no_tokenizer_or_sampler_can_take_are_a_400(
    draft_worker: Worker, path: str, body: dict, param: str, reason: str, why: str
):
    """Sent as the raw JSON a hostile client would write (json.dumps escapes surrogates and writes NaN)."""
    with draft_worker.client() as client:
        response = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert response.status_code == 400, (why, response.text)
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", (why, error)
    assert error["message"].startswith(f"{param}: ") and reason in error["message"], (why, error["message"])
    assert draft_worker.health()["status"] == "ok"


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", "an integer of 5,000 digits (Python refuses it)"),
        (b'{"prompt": "x", "stop": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "100,000 levels of nesting"),
        (b'{"prompt": "caf\xe9"}', "Latin-1, not UTF-8"),
    ],
)  # fmt: skip
def test_a_body_json_cannot_parse_is_a_400_in_the_openai_shape(draft_worker: Worker, body: bytes, why: str):
    """These once came back as FastAPI's own {"detail": ...}, which OpenAI clients cannot read."""
    with draft_worker.client() as client:
        response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, (why, response.text)
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "JSON" in error["message"], (why, error)


@pytest.mark.parametrize("where", ["header", "model"])
def test_a_10kb_value_is_never_echoed_whole(draft_worker: Worker, where: str):
    value = "no spaces allowed " + "x" * 10_240
    if where == "header":
        response = draft_worker.post("/v1/completions", {"prompt": "x"}, headers={"X-Specd-Segment": value})
        assert response.status_code == 400
    else:
        response = draft_worker.post("/v1/completions", {"prompt": "x", "model": value})
        assert response.status_code == 404
    message = response.json()["error"]["message"]
    assert value[:64] in message and value[:65] not in message, message
    assert "(10258 characters)" in message and len(response.content) < 500


def test_a_prompt_longer_than_the_context_is_a_400(draft_worker: Worker):
    response = draft_worker.post("/v1/completions", {"prompt": list(range(1, 600)), "max_tokens": 2})
    assert response.status_code == 400, response.text
    assert "prompt" in response.json()["error"]["message"]
    assert draft_worker.health()["status"] == "ok"


def test_malformed_json_and_an_unknown_model(draft_worker: Worker):
    with draft_worker.client() as client:
        garbled = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        unknown = client.post("/v1/completions", json={"prompt": "x", "model": "gpt-4o"})
        chat_unknown = client.post("/v1/chat/completions", json={"messages": CHAT, "model": "gpt-4o"})
    assert garbled.status_code == 400 and garbled.json()["error"]["type"] == "invalid_request_error"
    assert "JSON" in garbled.json()["error"]["message"]
    for response in (unknown, chat_unknown):
        assert response.status_code == 404
        error = response.json()["error"]
        assert error["param"] == "model" and "gpt-4o" in error["message"] and error["type"] == "not_found_error"


# -- clients that go away ----------------------------------------------------------------------------------


def _cancelled(worker: Worker, segment: str) -> float:
    return worker.metrics().total("specd_requests_total", segment=segment, status="cancelled")


def test_a_streaming_client_that_disconnects_cancels_its_request(draft_worker: Worker):
    segment = "goes-away-streaming"
    request = {"prompt": LONG, "max_tokens": 480, "temperature": 0, "stream": True, "segment": segment}
    with draft_worker.client() as client, client.stream("POST", "/v1/completions", json=request) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    # The connection is closed with ~470 tokens still to go (about a second of decoding).
    draft_worker.wait_for(lambda: _cancelled(draft_worker, segment) == 1, "the request counted as cancelled", 10)
    draft_worker.wait_idle()
    metrics = draft_worker.metrics()
    assert metrics.total("specd_requests_total", segment=segment, status="finished") == 0
    assert metrics.total("specd_queue_depth") == 0 and metrics.total("specd_batch_size") == 0


def test_a_waiting_client_that_disconnects_cancels_its_request(draft_worker: Worker):
    segment = "goes-away-waiting"
    request = {"prompt": LONG, "max_tokens": 480, "temperature": 0, "segment": segment}
    with draft_worker.client() as client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json=request, timeout=httpx.Timeout(10, read=0.1))
    draft_worker.wait_for(lambda: _cancelled(draft_worker, segment) == 1, "the request counted as cancelled", 10)
    draft_worker.wait_idle()
    assert draft_worker.metrics().total("specd_requests_total", segment=segment, status="finished") == 0


def test_concurrent_streams_interleave_and_each_is_whole(draft_worker: Worker):
    """Three streams at once, each with its own prompt: none gets another's text."""
    prompts = [LONG, CODE, SQL]
    expected = [completion_text(draft_worker.complete(p, max_tokens=30, temperature=0)) for p in prompts]
    got: list[str | None] = [None] * len(prompts)

    def run(i: int) -> None:
        payloads = draft_worker.stream("/v1/completions", {"prompt": prompts[i], "max_tokens": 30, "temperature": 0})
        got[i] = "".join(p["choices"][0]["text"] for p in payloads[:-1] if p["choices"])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == expected


def test_a_seeded_sampled_request_is_reproducible_whatever_else_runs(draft_worker: Worker) -> None:
    """The worker's own plan is the draft model at K 3; a seeded sampled request runs target-only instead, so its
    text is the one target-only decoding gives for the seed, alone or beside other requests."""
    body = {"prompt": "Once upon a time there was", "max_tokens": 24, "temperature": 1.0, "seed": 1234}
    alone = draft_worker.post("/v1/completions", {**body, "speculation": {"drafter": "none", "k": 0}}).json()
    results: dict[int, dict] = {}

    def send(index: int, payload: dict) -> None:
        results[index] = draft_worker.post("/v1/completions", payload).json()

    loads = [{**body, "seed": None, "prompt": f"Request {i}:"} for i in range(3)]
    payloads = [body, *loads, body, body]
    threads = [threading.Thread(target=send, args=(i, p)) for i, p in enumerate(payloads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seeded = [results[i] for i, p in enumerate(payloads) if p["seed"] is not None]
    assert [r["choices"][0]["text"] for r in seeded] == [alone["choices"][0]["text"]] * 3
    assert all(r["specd"]["decision_reason"] == "seeded_sampling" and r["specd"]["drafter"] == "none" for r in seeded)
    assert all(results[i]["specd"]["decision_reason"] != "seeded_sampling" for i in (1, 2, 3))
