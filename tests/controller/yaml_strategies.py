"""Hypothesis strategies for hostile policy files (bytes, as they would lie on disk): random YAML documents, the
shipped policy with keys deleted, values of the wrong type or out of range, its text cut, spliced and re-tagged,
anchors, aliases and merge keys, invalid UTF-8, and plain random bytes. Shared by the loader's fuzz test and the
daemon's (ReloadPolicy)."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

from controller.decision.policy import DrafterSettings, PolicyDocument, SegmentRule, Settings

DEFAULT_POLICY = Path(__file__).resolve().parents[2] / "policies" / "default.yaml"
DEFAULT_TEXT = DEFAULT_POLICY.read_text()
DEFAULT_DOC: dict[str, Any] = yaml.safe_load(DEFAULT_TEXT)

FIELD_NAMES = sorted(
    {*PolicyDocument.model_fields, *Settings.model_fields, *SegmentRule.model_fields, *DrafterSettings.model_fields}
    | {"draft", "prompt_lookup", "none"}
)
# Every tag a YAML 1.1 file can carry, the unsafe and unknown ones included.
TAGS = [
    "!!int", "!!float", "!!bool", "!!null", "!!str", "!!timestamp", "!!binary", "!!seq", "!!map", "!!set", "!!omap",
    "!!pairs", "!!merge", "!!value", "!!python/tuple", "!!python/name:os.system", "!local", "!<tag:example.com,2000:x>",
]  # fmt: skip
# Numbers at and around every bound the policy has (0, 1, 64, the open intervals of prior_alpha), and beyond.
EDGE_NUMBERS = [0, 1, -1, 2, 63, 64, 65, 2**31, 2**63, 2**64, -(2**63), 10**30, 0.0, -0.0, 0.5, 0.999999, 1.0,
                1.0000001, 1e-300, 1e308, -1e308, math.inf, -math.inf, math.nan]  # fmt: skip

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.sampled_from(EDGE_NUMBERS),
    st.text(max_size=12),
    st.text(max_size=200),
    st.sampled_from(["draft", "prompt_lookup", "none", "*", "tenant-*", "", "~", "yes", "<<", "&a", "*a"]),
    st.binary(max_size=12),
    st.datetimes(),
)
keys = st.one_of(
    st.sampled_from(FIELD_NAMES),
    st.text(max_size=10),
    st.integers(),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False),
)
values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(keys, children, max_size=4),
    max_leaves=16,
)
numbers = st.one_of(st.sampled_from(EDGE_NUMBERS), st.integers(), st.floats())


def dump(draw: st.DrawFn, doc: Any) -> bytes:
    """``doc`` as a YAML file, in block or flow style, Unicode or escaped."""
    text = yaml.safe_dump(
        doc, default_flow_style=draw(st.sampled_from([False, True, None])), allow_unicode=draw(st.booleans()),
        sort_keys=False,
    )  # fmt: skip
    return text.encode("utf-8", "surrogatepass")


@st.composite
def random_documents(draw: st.DrawFn) -> bytes:
    """A random document, on its own or where the policy expects one (defaults, a rule, a drafter)."""
    value = draw(values)
    doc = draw(st.sampled_from(["bare", "defaults", "segments", "drafters"]))
    if doc == "defaults":
        value = {"defaults": value}
    elif doc == "segments":
        value = {"segments": [value] if isinstance(value, dict) else value}
    elif doc == "drafters":
        value = {"defaults": {"drafters": {draw(st.sampled_from(["draft", "prompt_lookup", "none"])): value}}}
    return dump(draw, value)


def _places(doc: Any) -> list[tuple[Any, Any]]:
    """Every (container, key or index) in ``doc``."""
    found: list[tuple[Any, Any]] = []
    stack = [doc]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            found.append((node, key))
            stack.append(value)
    return found


@st.composite
def mutated_default_documents(draw: st.DrawFn) -> bytes:
    """The shipped policy with one to three edits: a key deleted, a value replaced (any type), a number out of range,
    an unknown key or item added."""
    doc = copy.deepcopy(DEFAULT_DOC)
    for _ in range(draw(st.integers(1, 3))):
        places = _places(doc)
        if not places:
            break
        container, key = draw(st.sampled_from(places))
        action = draw(st.sampled_from(["delete", "replace", "number", "add"]))
        if action == "delete":
            del container[key]
        elif action == "replace":
            container[key] = draw(values)
        elif action == "number":
            container[key] = draw(numbers)
        elif isinstance(container, dict):
            container[draw(keys)] = draw(values)
        else:
            container.append(draw(values))
    return dump(draw, doc)


SPLICES = [
    b"&a ", b"*a", b"*undefined", b"<<: *a\n", b"<<: [*a, *a]\n", b"\t", b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00",
    b"{", b"}", b"[", b"]", b"- ", b": ", b"? ", b'"\\ud800"', b'"\\x00"', b"%YAML 1.1\n", b"%TAG ! tag:x,2000:\n",
    b"---\n", b"...\n", b"#", b"'", b'"', b"|", b">", b"\n  ", b"\xef\xbb\xbf", b"\r", b"\x85", b"\xe2\x80\xa8",
]  # fmt: skip


@st.composite
def mutated_default_texts(draw: st.DrawFn) -> bytes:
    """The shipped policy's bytes, cut, with lines deleted or repeated, a value re-tagged, or pieces spliced in
    (YAML syntax, anchors and aliases, invalid UTF-8, control characters)."""
    data = DEFAULT_TEXT.encode()
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["cut", "delete_line", "repeat_line", "splice", "tag"]))
        if action == "cut":
            data = data[: draw(st.integers(0, len(data)))]
            continue
        lines = data.split(b"\n")
        i = draw(st.integers(0, len(lines) - 1))
        if action == "delete_line":
            del lines[i]
        elif action == "repeat_line":
            lines.insert(i, lines[i])
        elif action == "tag" and b": " in lines[i]:
            head, _, tail = lines[i].partition(b": ")
            lines[i] = head + b": " + draw(st.sampled_from(TAGS)).encode() + b" " + tail
        elif action == "tag":
            lines[i] = draw(st.sampled_from(TAGS)).encode() + b" " + lines[i]
        else:
            at = draw(st.integers(0, len(lines[i])))
            piece = draw(st.sampled_from(SPLICES) | st.binary(min_size=1, max_size=6))
            lines[i] = lines[i][:at] + piece + lines[i][at:]
        data = b"\n".join(lines)
    return data


@st.composite
def alias_documents(draw: st.DrawFn) -> bytes:
    """Anchors, aliases and merge keys: repeated, nested, self-referring, merged into rules and defaults."""
    field = draw(st.sampled_from(FIELD_NAMES))
    value = yaml.safe_dump(draw(scalars), default_flow_style=True).split("\n")[0]
    copies = draw(st.integers(1, 9))
    depth = draw(st.integers(1, 6))
    lines = [f"base: &a0 {{{field}: {value}}}"]
    for level in range(1, depth + 1):
        merged = ", ".join([f"*a{level - 1}"] * copies)
        lines.append(f"l{level}: &a{level} {{<<: [{merged}], k{level}: 1}}")
    top = f"*a{depth}"
    lines += draw(
        st.sampled_from(
            [
                [f"defaults: {top}"],
                [f"defaults:\n  <<: {top}\n  drafters: {{draft: {{<<: *a0}}}}"],
                [f"segments:\n  - <<: {top}\n    match: x\n  - {top}"],
                [f"segments: [{', '.join([top] * copies)}]"],
                ["loop: &r [*r]"],
                ["loop: &m {x: *m}"],
                [f"defaults: &d {{{field}: *d}}"],
            ]
        )
    )
    return "\n".join(lines).encode() + b"\n"


policy_files = st.one_of(
    random_documents(),
    mutated_default_documents(),
    mutated_default_texts(),
    alias_documents(),
    st.binary(max_size=300),
)
