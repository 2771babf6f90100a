"""The heuristic segment classifier: a table of clear cases, and its accuracy on the repo's own workloads
(48 prompts per segment, labelled by how they were built)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

import workloads
from controller.client import self_repetition
from decoder.worker.segments import classify_prompt

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
