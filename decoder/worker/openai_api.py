"""The OpenAI-compatible request bodies (/v1/completions, /v1/chat/completions) and response shapes.

Every OpenAI parameter that changes the output is either done exactly (speculation included) or refused with a 400
naming the field when set to anything but its no-op value (``NOT_SERVED``: n > 1, logprobs, echo, best_of,
logit_bias, penalties, suffix, response_format, tools, stop_token_ids, ...): a client that asked for a banned token
or a format never silently gets something else. ``max_completion_tokens`` is ``max_tokens`` by its newer name.
Other unknown fields (``user``, ``metadata``, client-library extras) change nothing and are ignored.

``segment`` is specd's extension: the traffic segment the controller judges the request by (also the
X-Specd-Segment header); so are ``speculation``: the caller's own drafter and K for the request
(``SpeculationChoice``), and ``share_outputs``: false keeps the request's output out of the suffix cache other
requests propose from.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specd_api.segments import SEGMENT_PATTERN

_SURROGATE = re.compile("[\ud800-\udfff]")
MAX_STOPS = 4
# Each stop string is matched against the text every round (the decode thread) and every streamed delta: unbounded,
# 200,000-character stops slow an innocent stream 3.3x.
MAX_STOP_CHARS = 256


def valid_text(value: Any) -> Any:
    """``value`` (a string or a list of strings; anything else is passed through) if it is all Unicode text; a lone
    surrogate (JSON can spell one, ``"\\ud800"``, but no tokenizer or encoder can take it) raises ValueError."""
    for i, text in enumerate(value if isinstance(value, list) else [value]):
        found = _SURROGATE.search(text) if isinstance(text, str) else None
        if found:
            where = f"character {found.start()}" + (f" of item {i}" if isinstance(value, list) else "")
            raise ValueError(f"a lone surrogate (U+{ord(found.group()):04X}) at {where} is not Unicode text")
    return value


class StreamOptions(BaseModel):
    include_usage: bool = False


class SpeculationChoice(BaseModel):
    """specd's extension: the caller chooses the drafter and K for this request (A/B tests, benchmarks); the
    controller is not asked, and every round runs at ``k``. ``report: false`` keeps its rounds from the
    controller's statistics."""

    model_config = ConfigDict(extra="forbid")

    drafter: Literal["draft", "prompt_lookup", "chain", "suffix", "eagle", "none"]  # specd_api.plan.DRAFTER_NAMES
    k: int = Field(0, ge=0, le=64)
    report: bool = True

    @field_validator("k")
    @classmethod
    def _k_fits(cls, k: int, info: Any) -> int:
        if (info.data.get("drafter") == "none") != (k == 0):
            raise ValueError("k must be 0 exactly when the drafter is none")
        return k


# parameter -> the values that ask for nothing (what OpenAI does without it): any other value is refused. The
# completion-only and chat-only ones are fields of their request only.
NOT_SERVED: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "stop_token_ids": (None, []),
    "bad_words": (None, []),
    "ignore_eos": (None, False),
    "top_logprobs": (None, 0),
    "prompt_logprobs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "best_of": (None, 1),  # completions
    "suffix": (None, ""),  # completions
    "response_format": (None, {"type": "text"}),  # chat, and the rest below
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
}


def not_served(name: str, value: Any) -> Any:
    """``value`` if it asks for nothing ``name`` does; else ValueError (the request asked for what is not done)."""
    if any((value == allowed and type(value) is not bool) or value is allowed for allowed in NOT_SERVED[name]):
        return value
    raise ValueError(f"this worker does not implement {name}: leave it out")


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)  # OpenAI's default
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, le=(1 << 31) - 1)  # an extension several servers accept; 0 = off; int32 on the wire
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)  # what a torch generator takes
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: Any = None
    segment: str | None = Field(None, pattern=SEGMENT_PATTERN)
    speculation: SpeculationChoice | None = None
    # false: this request's output is never added to the worker's suffix cache, so no other request's suffix
    # decoding can propose from it (docs/RELIABILITY.md, "Suffix decoding and data isolation")
    share_outputs: bool = True
    logit_bias: Any = None
    frequency_penalty: Any = None
    presence_penalty: Any = None
    repetition_penalty: Any = None
    min_p: Any = None
    min_tokens: Any = None
    stop_token_ids: Any = None
    bad_words: Any = None
    ignore_eos: Any = None
    top_logprobs: Any = None
    prompt_logprobs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @field_validator(*NOT_SERVED, check_fields=False)
    @classmethod
    def _not_served(cls, value: Any, info: Any) -> Any:
        return not_served(info.field_name, value)

    @field_validator("model", "stop")
    @classmethod
    def _text(cls, value: Any) -> Any:
        return valid_text(value)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: Any) -> Any:
        if value is not None and value is not False:  # logprobs 0 asks for the chosen token's own logprob
            raise ValueError("logprobs are not supported")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ValueError(f"stop takes up to {MAX_STOPS} non-empty strings")
        for i, s in enumerate(stops):
            if len(s) > MAX_STOP_CHARS:
                which = f"stop string {i}" if isinstance(stop, list) else "the stop string"
                raise ValueError(f"{which} has {len(s)} characters; this worker takes at most {MAX_STOP_CHARS} each")
        return stop

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    echo: bool = False
    best_of: Any = None
    suffix: Any = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str] | list[int]) -> str | list[str] | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str) and len(prompt) != 1:
            raise ValueError("one prompt per request (batch them as concurrent requests)")
        if not prompt:
            raise ValueError("the prompt is empty")
        return valid_text(prompt)

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text(cls, content: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        if not isinstance(content, list):
            return valid_text(content)
        for i, part in enumerate(content):
            if part.get("type") != "text":
                continue
            if not isinstance(part.get("text"), str):
                raise ValueError(f"part {i} is a text part whose text is not a string")
            try:
                valid_text(part["text"])
            except ValueError as e:
                raise ValueError(f"part {i}: {e}") from None
        return content

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "".join(part["text"] for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # max_tokens by its newer name
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_length(cls, value: int | None, info: Any) -> int | None:
        given = info.data.get("max_tokens")
        if value is not None and given is not None and given != value:
            raise ValueError(f"{value} differs from max_tokens ({given}); send one of the two")
        return value

    @model_validator(mode="after")
    def _newer_name(self) -> ChatRequest:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


def render_chat(messages: list[ChatMessage], tokenizer: Any) -> str:
    """The prompt for a chat: the tokenizer's chat template when it has one, else a plain transcript."""
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.text()} for m in messages], tokenize=False, add_generation_prompt=True
        )
        return str(rendered)
    lines = [f"{m.role}: {m.text()}" for m in messages]
    return "\n".join([*lines, "assistant:"])


def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def envelope(
    request_id: str, model: str, kind: str, choices: list[dict[str, Any]], use: dict[str, int] | None,
    specd: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The fields every response and chunk share; ``usage`` and the ``specd`` block only when given."""
    body: dict[str, Any] = {
        "id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices,
    }  # fmt: skip
    if use is not None:
        body["usage"] = use
    if specd:
        body["specd"] = specd
    return body


def completion_body(
    request_id: str, model: str, text: str, finish_reason: str | None, use: dict[str, int] | None, specd: dict[str, Any]
) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return envelope(request_id, model, "text_completion", [choice], use, specd)


def chat_body(
    request_id: str, model: str, text: str, finish_reason: str | None, use: dict[str, int] | None, specd: dict[str, Any]
) -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
    return envelope(request_id, model, "chat.completion", [choice], use, specd)


def chat_chunk(
    request_id: str, model: str, delta: dict[str, Any], finish_reason: str | None, use: dict[str, int] | None = None
) -> dict[str, Any]:
    choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    return envelope(request_id, model, "chat.completion.chunk", choices if delta or finish_reason else [], use)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
