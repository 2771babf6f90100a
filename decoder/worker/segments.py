r"""The segment of a request: named by the caller (body ``segment`` or the X-Specd-Segment header), else
inferred from the prompt by a small heuristic classifier, else the configured default.

The classifier is deliberately simple and explainable: the controller learns per segment, so a stable,
cheap label matters more than a clever one. Callers who know their traffic should name it.

Its cost is bounded whatever a client sends: it reads a prompt's first and last ``WINDOW_CHARS`` characters only
(``window``), and every pattern is linear: no repeat runs past a line start where another match may begin.
A pattern like ``^\s*`` under MULTILINE lets each line start of a run of newlines rescan the rest of the run (quadratic:
20,000 newlines take 9.6 s; a 200,000-character prompt within the limits would hold the event loop for minutes).
"""

from __future__ import annotations

import re
from collections import Counter

CLASSIFIER_SEGMENTS = ("extractive", "structured", "code", "adversarial", "prose")  # what classify_prompt returns
WINDOW_CHARS = 8192  # the classifier reads this many characters from each end of a prompt
# Indentation is whitespace but a newline ([^\S\n]): a line start's repeat stops at the next line start, so the scans
# from all line starts together cover the text once. It finds what ^\s* found (a run of blank lines before a
# statement is matched from the statement's own line start). ``.`` and ``\S`` stop at a newline too.
_CODE = re.compile(r"^[^\S\n]*(def |class |import |from \S+ import |return\b|if .*:$|for .*:$|@\w+)", re.MULTILINE)
_SQL = re.compile(r"\b(SELECT|INSERT INTO|CREATE TABLE|UPDATE \w+ SET|DELETE FROM|WHERE|VALUES)\b")
_WORD = re.compile(r"[A-Za-z]{2,}")


def window(text: str, chars: int = WINDOW_CHARS) -> str:
    """``text`` if it is at most ``2 * chars`` long, else its first and last ``chars`` characters on two lines: what
    the classifier reads of a long prompt (its start says what it is; its end, what is asked of it)."""
    return text if len(text) <= 2 * chars else f"{text[:chars]}\n{text[-chars:]}"


def classify_prompt(text: str, self_repetition: float, chars: int | None = WINDOW_CHARS) -> str:
    """One of ``extractive``, ``structured``, ``code``, ``adversarial``, ``prose`` for a prompt, read through
    ``window(text, chars)`` (``chars=None``: the whole text).

    # self_repetition: the prompt's share of trailing n-grams seen earlier (specd_client.self_repetition)
    """
    stripped = (window(text, chars) if chars is not None else text).strip()
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
    same = max(Counter(commas).values())  # linear: counting each distinct count's lines again was not
    if min(commas) >= 2 and same >= 0.7 * len(lines):
        return True
    stamped = sum(bool(re.match(r"^\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}", line)) for line in lines)
    return stamped >= 0.7 * len(lines)
