"""The segment of a request: named by the caller (body ``segment`` or the X-Specd-Segment header), else
inferred from the prompt by a small heuristic classifier, else the configured default.

The classifier is deliberately simple and explainable: the controller learns per segment, so a stable,
cheap label matters more than a clever one. Callers who know their traffic should name it.
"""

from __future__ import annotations

import re

CLASSIFIER_SEGMENTS = ("extractive", "structured", "code", "adversarial", "prose")  # what classify_prompt returns
_CODE = re.compile(r"^\s*(def |class |import |from \S+ import |return\b|if .*:$|for .*:$|@\w+)", re.MULTILINE)
_SQL = re.compile(r"\b(SELECT|INSERT INTO|CREATE TABLE|UPDATE \w+ SET|DELETE FROM|WHERE|VALUES)\b")
_WORD = re.compile(r"[A-Za-z]{2,}")


def classify_prompt(text: str, self_repetition: float) -> str:
    """One of ``extractive``, ``structured``, ``code``, ``adversarial``, ``prose`` for a prompt.

    # self_repetition: the prompt's share of trailing n-grams seen earlier (controller.client.self_repetition)
    """
    stripped = text.strip()
    if not stripped:
        return "prose"
    if self_repetition >= 0.5:
        return "extractive"  # the continuation can copy spans of the prompt: prompt-lookup territory
    lines = [line for line in stripped.splitlines() if line.strip()]
    if stripped[0] in "{[" or _SQL.search(stripped) or _looks_tabular(lines):
        return "structured"
    if len(_CODE.findall(stripped)) >= 2 or (lines and _CODE.search(stripped) and stripped.count("(") >= 2):
        return "code"
    words = _WORD.findall(stripped)
    letters = sum(len(w) for w in words)
    if letters < 0.5 * len(stripped.replace(" ", "").replace("\n", "")):
        return "adversarial"  # mostly not words: random-looking text, where drafts rarely agree
    return "prose"


def _looks_tabular(lines: list[str]) -> bool:
    """CSV or log lines: most lines carry the same number (>= 2) of commas, or start with a timestamp."""
    if len(lines) < 2:
        return False
    commas = [line.count(",") for line in lines]
    same = max(commas.count(c) for c in set(commas))
    if min(commas) >= 2 and same >= 0.7 * len(lines):
        return True
    stamped = sum(bool(re.match(r"^\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}", line)) for line in lines)
    return stamped >= 0.7 * len(lines)
