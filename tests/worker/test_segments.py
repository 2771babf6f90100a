"""The heuristic segment classifier: a table of clear cases, its accuracy on the repo's own workloads (48 prompts per
segment, labelled by how they were built), and its time on the worst prompts found (it runs on every request)."""

from __future__ import annotations

import random
import re
import string
import time
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import workloads
from decoder.worker.config import RequestLimits
from decoder.worker.segments import _CODE, CLASSIFIER_SEGMENTS, WINDOW_CHARS, classify_prompt
from specd_client import self_repetition
from tests.fuzzing import fuzz_settings

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("text", "repetition", "expected", "why"),
    [
        ("def f(x):\n    return x + 1\n\nclass A:\n    pass\n", 0.0, "code", "two Python statements at line starts"),
        ("import os\nprint(os.getcwd())\nprint(len(os.listdir('.')))", 0.0, "code", "an import and calls"),
        ('{"a": 1, "b": [1, 2]}', 0.0, "structured", "starts like JSON"),
        ("SELECT id FROM t WHERE x = 1", 0.0, "structured", "SQL keywords"),
        ("id,name,score\n1,ann,3\n2,bob,4\n3,cy,5\n", 0.0, "structured", "CSV: the same commas on every line"),
        ("2024-01-02 10:00:01 INFO start\n2024-01-02 10:00:02 WARN slow\n", 0.0, "structured", "timestamped log"),
        ("The river bends twice before it reaches the sea.", 0.0, "prose", "a plain sentence"),
        ("The river bends twice before it reaches the sea.", 0.6, "extractive", "a prompt that repeats itself"),
        ("x7#Qz!@9 %^&* (1)[2]{3} <>?|~` 0x1F +-=", 0.0, "adversarial", "mostly not words"),
        ("   \n  ", 0.0, "prose", "nothing to go on"),
    ],
)
def test_clear_cases(text: str, repetition: float, expected: str, why: str):
    assert classify_prompt(text, repetition) == expected, why


@pytest.fixture(scope="module")
def predictions() -> dict[str, Counter[str]]:
    """For each workload segment, how the classifier labels its prompts (self-repetition measured with the
    shipped reference tokenizer, as the worker serving it would)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "reference" / "target")
    found: dict[str, Counter[str]] = {}
    for segment, prompts in workloads.load_all(REPO / "workloads").items():
        found[segment] = Counter(
            classify_prompt(p.prompt, self_repetition(tokenizer(p.prompt)["input_ids"])) for p in prompts
        )
    return found


@pytest.mark.parametrize(
    ("segment", "at_least"),
    [
        ("code", 0.8),
        ("structured", 0.8),
        ("prose", 0.8),
        # Code and text prompts asking to copy a span are told apart only by how much they repeat themselves.
        ("extractive", 0.5),
        # Mostly shuffled words and pseudo-words, which read as prose to a character-level heuristic; only the
        # random-character prompts are caught. Guard that share from getting worse.
        ("adversarial", 0.25),
    ],
)
def test_accuracy_on_the_workloads(predictions, segment: str, at_least: float):
    counts = predictions[segment]
    share = counts[segment] / sum(counts.values())
    assert share >= at_least, f"{segment}: {share:.0%} right ({dict(counts)})"


def test_prose_is_rarely_mistaken_for_something_else(predictions):
    """A segment's label steers its speculation: code and structured traffic should not be diluted by prose."""
    for segment in ("code", "structured"):
        wrong = sum(n for label, n in predictions["prose"].items() if label == segment)
        assert wrong <= 0.1 * sum(predictions["prose"].values()), (segment, dict(predictions["prose"]))


# -- bounded time, whatever the prompt ------------------------------------------------------------------------------

MAX_PROMPT_CHARS = RequestLimits().max_prompt_chars  # the largest text prompt a worker takes by default


def blank_lines_then_an_if(chars: int = MAX_PROMPT_CHARS, blank: int = 40_000) -> str:
    r"""The slowest prompt found that the classifier reads (it repeats itself too little, 0.27, to be called
    extractive first): every one of the ``blank`` line starts matched ``\s*`` down to the ``if``, then scanned the
    rest (random characters, no colon) for ``:$``: 40 s for such a pattern's first pass alone."""
    rng = random.Random(0)
    alphabet = [c for c in string.printable[:94] if c != ":"]
    return "x" + "\n" * blank + "if " + "".join(rng.choice(alphabet) for _ in range(chars - blank - 4))


# Runs of the characters the patterns repeat: whitespace at line starts (`^\s*` rescans the rest of a newline run
# from every line start: quadratic, 20,000 newlines take 9.6 s), a line that almost ends in a colon, decorators, SQL.
SLOW_ONCE = {
    "newlines": "a" + "\n" * MAX_PROMPT_CHARS + "a",
    "blank lines": "a" + "\n " * (MAX_PROMPT_CHARS // 2) + "a",
    "crlf": "a" + "\r\n" * (MAX_PROMPT_CHARS // 2) + "a",
    "vertical tabs": "a" + "\n\x0b" * (MAX_PROMPT_CHARS // 2) + "a",
    "indented lines": "x\n" + " " * MAX_PROMPT_CHARS + "a",
    "an if without its colon": "x\nif " + ":" * MAX_PROMPT_CHARS + "a",
    "blank lines, then an if without its colon": blank_lines_then_an_if(),
    "decorators": "@" * MAX_PROMPT_CHARS,
    "update without set": "UPDATE " + "a" * MAX_PROMPT_CHARS,
    "a comma more per line": "\n".join("," * i for i in range(630)),
}


# What a request pays (the window) must stay under 50 ms; the patterns on the whole text show they are linear: under a
# quarter of a second at the limit, where the quadratic one took minutes (work linear in 200,000 characters, e.g.
# splitting 50,000 words, takes tens of milliseconds on a busy machine: a tighter bound would be flaky).
WINDOWED_SECONDS, WHOLE_SECONDS = 0.05, 0.25


def classify_in(text: str, chars: int | None, bound: float) -> None:
    started = time.perf_counter()
    assert classify_prompt(text, 0.0, chars) in CLASSIFIER_SEGMENTS
    seconds = time.perf_counter() - started
    assert seconds < bound, f"{seconds * 1000:.0f} ms reading {'the window' if chars else 'the whole text'}"


@pytest.mark.parametrize("name", sorted(SLOW_ONCE))
def test_the_worst_inputs_found_classify_in_bounded_time(name: str):
    """At the largest prompt the limits allow: windowed under 50 ms; read whole, linear (the window is a second
    bound, not the only one)."""
    classify_in(SLOW_ONCE[name], WINDOW_CHARS, WINDOWED_SECONDS)
    classify_in(SLOW_ONCE[name], None, WHOLE_SECONDS)


# What the patterns repeat, line breaks of every kind, and the words they look for.
HOSTILE_PIECES = [*" \t\n\r\x0b\x0c\x85\u2028:,@(){}[]#-_aZ9", "if ", "for ", "def ", "from x import ", "return",
                  "SELECT", "UPDATE ", " SET", "2024-01-02 10:00"]  # fmt: skip
hostile_units = st.lists(st.sampled_from(HOSTILE_PIECES), min_size=1, max_size=12).map("".join)


@given(unit=hostile_units)
@fuzz_settings(60)
def test_any_repeated_text_classifies_in_bounded_time(unit: str):
    """Any short pattern repeated to the prompt limit: windowed under 50 ms, read whole linear."""
    text = unit * (MAX_PROMPT_CHARS // len(unit) + 1)
    classify_in(text, WINDOW_CHARS, WINDOWED_SECONDS)
    classify_in(text, None, WHOLE_SECONDS)


QUADRATIC_CODE = re.compile(r"^\s*(def |class |import |from \S+ import |return\b|if .*:$|for .*:$|@\w+)", re.MULTILINE)


@given(text=st.lists(hostile_units, max_size=40).map("".join))
@fuzz_settings(300)
def test_the_linear_code_pattern_finds_what_the_quadratic_one_found(text: str):
    """The old pattern on short texts (where it is fast) is the oracle: the same statements are found, so the segments
    the controller learned keep their traffic. Texts up to twice the window are read whole."""
    assert [m.group(1) for m in _CODE.finditer(text)] == [m.group(1) for m in QUADRATIC_CODE.finditer(text)]
    assert classify_prompt(text, 0.0) == classify_prompt(text, 0.0, chars=None)
