"""Build the segment workloads (``workloads/*.jsonl``) from text the reference models were not trained on.

``python -m workloads.build`` writes the files; ``python -m workloads.build --check`` exits 1 when the committed
files differ from what it would write. Everything is seeded, so the same Python install gives the same files.

Sources (see ``workloads/README.md``): validation-split code and prose documents of :mod:`refmodels.corpus`,
IDLE's help page (``idlelib/help.html``; ``idlelib`` is not in the corpus), structured text generated with the
corpus's generators under another seed, and seeded random text. Every candidate prompt is checked against the
training split (:class:`TrainingIndex`) and dropped if any of its windows occurs there.
"""

from __future__ import annotations

import argparse
import ast
import base64
import html
import json
import random
import re
import string
import sys
import sysconfig
import textwrap
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from refmodels.corpus import CorpusConfig, Document, structured_document, train_documents, validation_documents
from workloads import Prompt

SEGMENTS: tuple[str, ...] = ("code", "prose", "structured", "extractive", "adversarial", "toolcall")
PROMPTS_PER_SEGMENT = 48
SEED = 2024  # the builder's own random choices
STRUCTURED_SEED = 101  # CorpusConfig seed for generated structured text; training uses CorpusConfig().seed == 0
MAX_NEW_TOKENS: dict[str, int] = {
    "code": 96, "prose": 96, "structured": 96, "extractive": 128, "adversarial": 64, "toolcall": 128,
}  # fmt: skip
ADVERSARIAL_TEMPERATURES: tuple[float, ...] = (1.2, 1.3, 1.4, 1.5)
PROSE_TEMPERATURES: tuple[float, ...] = (0.0, 0.8)  # alternating, by prompt index

WINDOW = 120  # a prompt overlaps the training split when one of its WINDOW-char windows occurs there
STEP = 50  # windows start every STEP chars (plus one window that ends the prompt)
BLOCK = 50  # index granularity; any WINDOW-char match contains a whole aligned block while WINDOW >= 2*BLOCK - 1

DEFAULT_FOLDER = Path(__file__).resolve().parent
HELP_HTML = Path(sysconfig.get_paths()["stdlib"]) / "idlelib" / "help.html"

Accept = Callable[[str], bool]
DOCUMENTED_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


# ---------------------------------------------------------------------------------------------------------
# Overlap with the training split


def windows(text: str, width: int = WINDOW, step: int = STEP) -> list[str]:
    """``width``-char windows of ``text`` every ``step`` chars, plus the one ending it; ``[text]`` if shorter."""
    if len(text) <= width:
        return [text]
    starts = list(range(0, len(text) - width + 1, step))
    if starts[-1] != len(text) - width:
        starts.append(len(text) - width)
    return [text[i : i + width] for i in starts]


@dataclass(frozen=True)
class TrainingIndex:
    """Hashes of the training text's aligned ``BLOCK``-char blocks, plus the text itself to confirm hits."""

    blocks: frozenset[int]
    text: str  # the training documents joined by NUL, which no document contains

    @classmethod
    def build(cls, docs: Iterable[Document]) -> TrainingIndex:
        """Index every document's blocks at offsets 0, BLOCK, 2*BLOCK, ..."""
        texts = [doc.text for doc in docs]
        blocks = frozenset(hash(t[i : i + BLOCK]) for t in texts for i in range(0, len(t) - BLOCK + 1, BLOCK))
        return cls(blocks=blocks, text="\0".join(texts))

    def contains(self, window: str) -> bool:
        """Whether ``window`` occurs in a training document (the block filter only skips the exact search)."""
        if len(window) >= 2 * BLOCK - 1:
            candidates = (window[j : j + BLOCK] for j in range(len(window) - BLOCK + 1))
            if not any(hash(block) in self.blocks for block in candidates):
                return False
        return window in self.text

    def overlaps(self, prompt: str) -> bool:
        """Whether any window of ``prompt`` (see :func:`windows`) occurs in the training split."""
        return any(self.contains(window) for window in windows(prompt))


@lru_cache(maxsize=1)
def training_index() -> TrainingIndex:
    """The index of the default corpus's training split (built once per process, ~2 s)."""
    return TrainingIndex.build(train_documents())


# ---------------------------------------------------------------------------------------------------------
# Helpers


def take(candidates: Iterable[str], count: int, segment: str) -> list[str]:
    """The first ``count`` distinct candidates; an error when there are fewer."""
    chosen: list[str] = []
    for prompt in candidates:
        if prompt not in chosen:
            chosen.append(prompt)
            if len(chosen) == count:
                return chosen
    raise RuntimeError(f"{segment}: only {len(chosen)} of {count} prompts pass the training-overlap check")


def interleave(*streams: Iterable[str]) -> Iterator[str]:
    """Round-robin over ``streams`` until all are exhausted (filter the streams first, so that each kind
    gets an equal share of the *accepted* prompts)."""
    iterators = [iter(stream) for stream in streams]
    while iterators:
        for iterator in list(iterators):
            item = next(iterator, None)
            if item is None:
                iterators.remove(iterator)
            else:
                yield item


def validation_by_domain(domain: str) -> list[Document]:
    """The validation-split documents of ``domain``, in doc-id order."""
    return sorted((d for d in validation_documents() if d.domain == domain), key=lambda d: d.doc_id)


def paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks of ``text`` (trailing whitespace stripped)."""
    return [p.rstrip() for p in re.split(r"\n[ \t]*\n", text) if p.strip()]


def is_sentence_paragraph(paragraph: str) -> bool:
    """A paragraph of running English text: enough words, mostly alphabetic, not a code or grammar block."""
    words = paragraph.split()
    alphabetic = sum(word.strip(".,;:()\"'").isalpha() for word in words)
    return len(words) >= 15 and alphabetic >= 0.7 * len(words) and "::=" not in paragraph


def cut_mid_sentence(paragraph: str, rng: random.Random) -> str:
    """A prefix of ``paragraph`` ending at a word boundary 35-70% of the way in, not right after a full stop."""
    spaces = [m.start() for m in re.finditer(r"[ \n]+", paragraph)]
    lo, hi = 0.35 * len(paragraph), 0.7 * len(paragraph)
    cuts = [i for i in spaces if lo <= i <= hi and paragraph[i - 1] not in ".:;!?"]
    return paragraph[: rng.choice(cuts)] if cuts else paragraph[: spaces[len(spaces) // 2]]


def passages(text: str, rng: random.Random, min_chars: int = 300, max_chars: int = 800) -> list[str]:
    """Non-overlapping passages of ``text``: whole paragraphs, then part of a sentence paragraph.

    Each passage ends mid-sentence inside a paragraph of running text, so its continuation is the rest of
    that sentence; the next passage starts after that paragraph.
    """
    paras = paragraphs(text)
    found, start = [], 0
    for end, paragraph in enumerate(paras):
        if not is_sentence_paragraph(paragraph):
            continue
        head = "\n\n".join(paras[start:end])
        while len(head) > max_chars - 100 and start < end:  # drop leading paragraphs of an over-long head
            start += 1
            head = "\n\n".join(paras[start:end])
        prompt = (head + "\n\n" if head else "") + cut_mid_sentence(paragraph, rng)
        if min_chars <= len(prompt) <= max_chars:
            found.append(prompt)
            start = end + 1
    return found


# ---------------------------------------------------------------------------------------------------------
# code: validation-split stdlib sources, cut inside a function


@dataclass(frozen=True)
class FunctionSpan:
    """A function's lines (0-based): ``first`` (decorators included), ``body`` (first body line), ``end``."""

    name: str
    first: int
    body: int
    end: int  # exclusive
    docstring_end: int | None  # exclusive end of the docstring statement, when there is one


def function_spans(source: str) -> list[FunctionSpan]:
    """Every function and method of ``source``, in source order."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            doc_end = node.body[0].end_lineno if ast.get_docstring(node, clean=False) is not None else None
            spans.append(FunctionSpan(node.name, first, node.body[0].lineno - 1, node.end_lineno, doc_end))
    return sorted(spans, key=lambda s: s.first)


def code_snippet(lines: Sequence[str], span: FunctionSpan, rng: random.Random) -> tuple[int, int] | None:
    """Line range ``(start, stop)`` of a 300-900 char snippet ending inside ``span`` with >= 2 lines left."""
    if span.end - span.body < 4:
        return None
    stop = rng.randint(span.body + 1, span.end - 2)
    start = span.first
    while stop > span.body + 1 and len("".join(lines[start:stop])) > 900:
        stop -= 1
    while start > 0 and len("".join(lines[start:stop])) < 300:
        start -= 1
    size = len("".join(lines[start:stop]))
    if not 300 <= size <= 900 or not lines[stop].strip():
        return None
    return start, stop


def code_streams(docs: Sequence[Document], rng: random.Random, accept: Accept) -> list[Iterable[str]]:
    """Per file, accepted non-overlapping snippets from its functions in shuffled order."""

    def one_file(doc: Document) -> Iterator[str]:
        lines = doc.text.splitlines(keepends=True)
        spans = function_spans(doc.text)
        rng.shuffle(spans)
        used: list[tuple[int, int]] = []
        for span in spans:
            found = code_snippet(lines, span, rng)
            if found is None or any(found[0] < b and a < found[1] for a, b in used):
                continue
            snippet = "".join(lines[found[0] : found[1]])
            if accept(snippet):
                used.append(found)
                yield snippet

    return [one_file(doc) for doc in docs]


# ---------------------------------------------------------------------------------------------------------
# prose: validation-split help topics, then IDLE's help page


def help_html_text(path: Path = HELP_HTML) -> str:
    """The paragraphs and headings of IDLE's documentation page as plain text, blank-line separated."""
    page = path.read_text(encoding="utf-8")
    body = page[page.index('<div class="body"') :]
    blocks = re.findall(r"<(p|dt|h[1-3])\b[^>]*>(.*?)</\1>", body, flags=re.S)
    texts = []
    for _, inner in blocks:
        text = html.unescape(re.sub(r"<[^>]+>", "", inner)).replace("¶", "")
        text = "\n".join(line.strip() for line in text.strip().splitlines())
        if text:
            texts.append(text)
    return "\n\n".join(texts) + "\n"


def prose_stream(rng: random.Random) -> Iterator[str]:
    """Validation prose passages first, then passages of IDLE's help page."""
    for doc in validation_by_domain("prose"):
        yield from passages(doc.text, rng)
    yield from passages(help_html_text(), rng)


# ---------------------------------------------------------------------------------------------------------
# structured: the corpus's generators under another seed, cut at a record boundary


def records(text: str, kind: str) -> list[str]:
    """Split a generated document into records (a CSV header, a row, a log line, an SQL statement, a JSON value)."""
    found, pending = [], ""
    for line in text.splitlines(keepends=True):
        pending += line
        if kind == "sql" and not pending.rstrip().endswith(";"):
            continue
        if kind == "json":
            try:
                json.loads(pending)
            except json.JSONDecodeError:
                continue
        found.append(pending)
        pending = ""
    return found


def structured_stream(rng: random.Random, accept: Accept) -> Iterator[str]:
    """Per generated document, the first run of 3-8 records (250-900 chars) that passes ``accept``."""
    cfg = CorpusConfig(seed=STRUCTURED_SEED)
    for index in range(10 * PROMPTS_PER_SEGMENT):
        doc = structured_document(cfg, index)
        kind = doc.doc_id.split("/")[1]
        recs = records(doc.text, kind)
        header, rows = (recs[:1], recs[1:]) if kind == "csv" else ([], recs)
        count = rng.randint(3, 8)
        for start in range(len(rows) - count):
            prompt = "".join(header + rows[start : start + count])
            while len(prompt) > 900 and count > 2:
                count -= 1
                prompt = "".join(header + rows[start : start + count])
            if len(prompt) >= 250 and accept(prompt):
                yield prompt
                break


# ---------------------------------------------------------------------------------------------------------
# extractive: continuations that repeat long spans of the prompt


def function_texts(docs: Sequence[Document], want_docstring: bool) -> Iterator[tuple[FunctionSpan, str]]:
    """Dedented functions of 150-1200 chars from ``docs`` (only those with a docstring when asked)."""
    for doc in docs:
        lines = doc.text.splitlines(keepends=True)
        for span in function_spans(doc.text):
            text = "".join(lines[span.first : span.end])
            if 150 <= len(text) <= 1200 and (span.docstring_end is not None or not want_docstring):
                yield span, text


def restate_prompts(docs: Sequence[Document], rng: random.Random) -> list[str]:
    """A function, then the same function without its docstring (or renamed), started with its first 2 lines."""
    prompts = []
    for span, text in function_texts(docs, want_docstring=False):
        lines = text.splitlines(keepends=True)
        if span.docstring_end is not None and span.end - span.docstring_end >= 3:
            keep = lines[: span.body - span.first] + lines[span.docstring_end - span.first :]
            edited, instruction = textwrap.dedent("".join(keep)), "with the docstring removed"
        elif span.docstring_end is None and span.end - span.body >= 3:
            edited = textwrap.dedent(text).replace(f"def {span.name}(", f"def {span.name}_v2(", 1)
            instruction = f"renamed to {span.name}_v2"
        else:
            continue
        head = "".join(edited.splitlines(keepends=True)[:2])
        prompts.append(f"# Original:\n{textwrap.dedent(text)}\n# Same function, {instruction}:\n{head}")
    rng.shuffle(prompts)
    return prompts


_REGIONS = ("eu-west-1", "us-east-2", "ap-south-1", "sa-east-1", "af-south-1", "ca-central-1")
_PLANS = ("free", "team", "business", "enterprise")
_OWNERS = ("platform", "payments", "growth", "infra", "data", "mobile", "search", "identity")
_WORDS = ("prod", "staging", "critical", "batch", "canary", "legacy", "eu", "beta", "gpu", "spot")
_WAREHOUSES = ("Rotterdam", "Yokohama", "Valencia", "Gdansk", "Durban", "Santos", "Tacoma", "Mersin")
_ITEMS = ("hex bolt M8", "washer 10mm", "hinge 75mm", "drill bit 6mm", "cable tie 200mm", "fuse 5A", "relay 12V")


def json_record_list(rng: random.Random) -> str:
    """A JSON array of records that share most fields; the next record is the continuation."""
    first_id = rng.randint(1000, 9000)
    base = {
        "id": first_id,
        "service": rng.choice(_OWNERS) + "-" + rng.choice(("api", "worker", "db", "cron")),
        "region": rng.choice(_REGIONS),
        "plan": rng.choice(_PLANS),
        "replicas": rng.randint(2, 12),
        "tags": sorted(rng.sample(_WORDS, 2)),
        "healthy": True,
    }
    rows = []
    for i in range(rng.randint(4, 7)):
        row = dict(base, id=first_id + i)
        if rng.random() < 0.4:
            row["replicas"] = rng.randint(2, 12)
        rows.append("  " + json.dumps(row) + ",\n")
    return "[\n" + "".join(rows)


def csv_table(rng: random.Random) -> str:
    """A CSV stock table whose rows repeat date, warehouse, item and price; only the counts change."""
    date = f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    warehouse, item, price = rng.choice(_WAREHOUSES), rng.choice(_ITEMS), f"{rng.uniform(0.05, 40):.2f}"
    first = rng.randint(10000, 90000)
    rows = [f"{first + i},{date},{warehouse},{item},{price},{rng.randint(0, 500)}\n" for i in range(rng.randint(5, 9))]
    return "sku_row,date,warehouse,item,unit_price,on_hand\n" + "".join(rows)


def log_table(rng: random.Random) -> str:
    """Log lines from one template where only a counter and a timestamp move."""
    host = f"{rng.choice(_OWNERS)}-{rng.randint(1, 40):02d}.{rng.choice(_REGIONS)}.internal"
    job = f"{rng.choice(_WORDS)}-{rng.randint(100, 999)}"
    day, hour, minute, second = rng.randint(1, 28), rng.randint(0, 23), rng.randint(0, 59), rng.randint(0, 50)
    lines = []
    for i in range(rng.randint(5, 8)):
        lines.append(
            f"2025-03-{day:02d} {hour:02d}:{minute:02d}:{second + i:02d} INFO host={host} "
            f"job={job} step={i + 1}/12 status=ok checkpoint=/var/lib/jobs/{job}/step-{i + 1:03d}.ckpt\n"
        )
    return "".join(lines)


def docstrings(docs: Sequence[Document]) -> Iterator[str]:
    """The module, class and function docstrings of ``docs`` (cleaned of their indentation), in source order."""
    for doc in docs:
        nodes = [n for n in ast.walk(ast.parse(doc.text)) if isinstance(n, DOCUMENTED_NODES)]
        for node in sorted(nodes, key=lambda n: getattr(n, "lineno", 0)):
            text = ast.get_docstring(node)
            if text:
                yield text


def copy_prompts(code_docs: Sequence[Document], rng: random.Random) -> list[str]:
    """'Copy the following text exactly' over validation prose paragraphs and validation code docstrings."""
    prose = [p for doc in validation_by_domain("prose") for p in paragraphs(doc.text) if is_sentence_paragraph(p)]
    prompts = []
    for text in [*prose, *docstrings(code_docs)]:
        if 200 <= len(text) <= 900:
            first_words = " ".join(text.split()[: rng.randint(3, 6)])
            prompts.append(f"Copy the following text exactly:\n\n{text}\n\nCopy:\n\n{first_words}")
    rng.shuffle(prompts)
    return prompts


def extractive_streams(code_docs: Sequence[Document], rng: random.Random) -> list[Iterable[str]]:
    """The five kinds: restated code, JSON record lists, CSV tables, log tables, copies."""
    generated = (
        [json_record_list(rng) for _ in range(PROMPTS_PER_SEGMENT)],
        [csv_table(rng) for _ in range(PROMPTS_PER_SEGMENT)],
        [log_table(rng) for _ in range(PROMPTS_PER_SEGMENT)],
    )
    return [restate_prompts(code_docs, rng), *generated, copy_prompts(code_docs, rng)]


# ---------------------------------------------------------------------------------------------------------
# adversarial: random-looking text, sampled hot


def random_characters(rng: random.Random) -> str:
    """Printable ASCII noise."""
    alphabet = string.ascii_letters + string.digits + string.punctuation + "    "
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(200, 400)))


def base64_blob(rng: random.Random) -> str:
    """Base64 of random bytes, wrapped at 76 columns."""
    raw = base64.b64encode(rng.randbytes(rng.randint(180, 300))).decode()
    return "\n".join(textwrap.wrap(raw, 76)) + "\n"


def random_words(rng: random.Random) -> str:
    """Pronounceable nonsense words with random punctuation."""
    consonants, vowels = "bcdfghjklmnprstvwxz", "aeiou"
    words = []
    for _ in range(rng.randint(40, 70)):
        word = "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(1, 4)))
        words.append(word + rng.choice(("", "", "", ",", ".", ";", "?")))
    return " ".join(words)


def unicode_mix(rng: random.Random) -> str:
    """Characters drawn from several scripts (Greek, Cyrillic, Hiragana, CJK, Hangul, symbols)."""
    ranges = ((0x391, 0x3C9), (0x410, 0x44F), (0x3041, 0x3096), (0x4E00, 0x4FFF), (0xAC00, 0xAD00), (0x2190, 0x21FF))
    chars = []
    for _ in range(rng.randint(120, 200)):
        lo, hi = rng.choice(ranges)
        chars.append(chr(rng.randint(lo, hi)) if rng.random() < 0.85 else " ")
    return "".join(chars)


def shuffled_words(texts: Sequence[str], rng: random.Random) -> Iterator[str]:
    """The words (or code tokens) of validation passages in random order."""
    for text in texts:
        words = text.split()
        rng.shuffle(words)
        yield " ".join(words)


def adversarial_streams(code_docs: Sequence[Document], rng: random.Random) -> list[Iterable[str]]:
    """Six kinds of noise; the shuffled words come from validation prose and code."""
    count = PROMPTS_PER_SEGMENT
    prose_texts = [p for d in validation_by_domain("prose") for p in passages(d.text, random.Random(SEED))]
    code_texts = [d.text[i : i + 600] for d in code_docs for i in range(0, len(d.text) - 600, 3000)]
    rng.shuffle(prose_texts)
    rng.shuffle(code_texts)
    return [
        [random_characters(rng) for _ in range(count)],
        [base64_blob(rng) for _ in range(count)],
        [random_words(rng) for _ in range(count)],
        [unicode_mix(rng) for _ in range(count)],
        shuffled_words(prose_texts, rng),
        shuffled_words(code_texts, rng),
    ]


# ---------------------------------------------------------------------------------------------------------
# toolcall: JSON tool calls whose few schemas recur across requests (where suffix decoding should win)

_PROJECTS = ("billing", "checkout", "search", "mobile-app", "data-platform", "identity", "warehouse-ops")
_TICKET_WORDS = ("timeout", "refund", "stuck", "duplicate", "login", "export", "invoice", "crash", "slow", "missing")
_FIRST_NAMES = ("amara", "bjorn", "chiara", "dmitri", "elif", "farah", "goran", "hana", "ines", "jonas", "keiko")
_LOCALES = ("en-US", "de-DE", "fr-FR", "ja-JP", "pt-BR", "es-MX")


def _date(rng: random.Random) -> str:
    return f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _ticket(rng: random.Random) -> dict[str, object]:
    project = rng.choice(_PROJECTS)
    return {
        "project": project, "title": " ".join(rng.sample(_TICKET_WORDS, 3)),
        "priority": rng.choice(("low", "medium", "high", "urgent")), "assignee": f"oncall-{project}",
        "labels": sorted(rng.sample(_WORDS, 2)),
    }  # fmt: skip


def _orders(rng: random.Random) -> dict[str, object]:
    return {
        "customer_id": rng.randint(10000, 99999), "status": rng.choice(("open", "shipped", "cancelled", "refunded")),
        "since": _date(rng), "limit": rng.choice((10, 20, 50)),
    }  # fmt: skip


def _inventory(rng: random.Random) -> dict[str, object]:
    return {
        "warehouse": rng.choice(_WAREHOUSES), "item": rng.choice(_ITEMS),
        "delta": rng.choice((-1, 1)) * rng.randint(1, 90),
        "reason": rng.choice(("restock", "damage", "audit", "return")),
    }  # fmt: skip


def _email(rng: random.Random) -> dict[str, object]:
    name = rng.choice(_FIRST_NAMES)
    return {
        "to": f"{name}@example.com", "template": rng.choice(("welcome", "password_reset", "invoice", "reminder")),
        "locale": rng.choice(_LOCALES), "variables": {"name": name.title(), "plan": rng.choice(_PLANS)},
    }  # fmt: skip


def _metrics(rng: random.Random) -> dict[str, object]:
    return {
        "service": rng.choice(_OWNERS) + "-" + rng.choice(("api", "worker", "db")), "region": rng.choice(_REGIONS),
        "metric": rng.choice(("latency_p99_ms", "error_rate", "cpu_utilization", "requests_per_second")),
        "window": rng.choice(("5m", "1h", "24h")),
    }  # fmt: skip


TOOLS: dict[str, Callable[[random.Random], dict[str, object]]] = {
    "create_ticket": _ticket, "search_orders": _orders, "update_inventory": _inventory, "send_email": _email,
    "get_metrics": _metrics,
}  # fmt: skip


def tool_call_log(rng: random.Random) -> str:
    """An agent's log of tool calls, one JSON object per line, ending in an opened call: 1-3 calls of 1-3 of the
    five tools, so a prompt shows few of the schemas its continuation (more calls) will use; the schemas recur
    across requests, their values do not."""
    lines = ["# tool calls, one JSON object per line\n"]
    for name in rng.choices(list(TOOLS), k=rng.randint(1, 3)):
        lines.append(json.dumps({"tool": name, "arguments": TOOLS[name](rng)}) + "\n")
    return "".join(lines) + '{"tool": "'


# ---------------------------------------------------------------------------------------------------------
# Assembly


def segment_prompts(segment: str, accept: Accept) -> list[str]:
    """The accepted prompt texts of ``segment``: round-robin over its kinds (or files), seeded per segment."""
    rng = random.Random(f"{SEED}/{segment}")
    code_docs = validation_by_domain("code")
    streams: list[Iterable[str]]
    if segment == "code":
        streams = code_streams(code_docs, rng, accept)
    elif segment == "prose":
        streams = [prose_stream(rng)]
    elif segment == "structured":
        streams = [structured_stream(rng, accept)]
    elif segment == "extractive":
        streams = extractive_streams(code_docs, rng)
    elif segment == "adversarial":
        streams = adversarial_streams(code_docs, rng)
    elif segment == "toolcall":
        streams = [[tool_call_log(rng) for _ in range(2 * PROMPTS_PER_SEGMENT)]]
    else:
        raise ValueError(f"unknown segment {segment!r}; choose one of {SEGMENTS}")
    return take(interleave(*(filter(accept, stream) for stream in streams)), PROMPTS_PER_SEGMENT, segment)


def temperature(segment: str, index: int, rng: random.Random) -> float:
    """0.0 (greedy) for code/structured/extractive/toolcall, alternating 0.0/0.8 for prose, 1.2-1.5 for
    adversarial."""
    if segment == "prose":
        return PROSE_TEMPERATURES[index % len(PROSE_TEMPERATURES)]
    if segment == "adversarial":
        return rng.choice(ADVERSARIAL_TEMPERATURES)
    return 0.0


def build_segment(segment: str, index: TrainingIndex) -> list[Prompt]:
    """The finished prompts of ``segment``: ids, decoding settings, nothing that overlaps ``index``."""

    def accept(prompt: str) -> bool:
        return not index.overlaps(prompt)

    rng = random.Random(f"{SEED}/{segment}/temperature")
    return [
        Prompt(f"{segment}-{i:03d}", segment, text, MAX_NEW_TOKENS[segment], temperature(segment, i, rng))
        for i, text in enumerate(segment_prompts(segment, accept))
    ]


def render(prompts: Sequence[Prompt]) -> str:
    """JSONL: one object per line, fields in :data:`workloads.FIELDS` order, UTF-8 kept as is."""
    return "".join(json.dumps(asdict(p), ensure_ascii=False) + "\n" for p in prompts)


def build_files(index: TrainingIndex | None = None) -> dict[str, str]:
    """``{file name: contents}`` for every segment."""
    index = index or training_index()
    return {f"{segment}.jsonl": render(build_segment(segment, index)) for segment in SEGMENTS}


def stale_files(folder: Path, files: dict[str, str]) -> list[str]:
    """Names of the files in ``files`` whose copy in ``folder`` is missing or different."""
    return [name for name, text in files.items() if not (folder / name).is_file() or read(folder / name) != text]


def read(path: Path) -> str:
    """A file's text exactly as stored (no newline translation)."""
    return path.read_bytes().decode("utf-8")


def main(argv: list[str] | None = None) -> int:
    """Write the workload files, or with ``--check`` report the ones that differ (exit 1)."""
    return write_or_check(argv, __doc__, DEFAULT_FOLDER, build_files, "workloads.build")


def write_or_check(
    argv: list[str] | None, description: str | None, default_out: Path, files_of: Callable[[], dict[str, str]],
    module: str,
) -> int:  # fmt: skip
    """The command line of a workload builder (``python -m {module}``): write the files ``files_of`` makes under
    ``--out``, or with ``--check`` name the ones that differ there and exit 1."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=default_out, help="folder of the .jsonl files")
    parser.add_argument("--check", action="store_true", help="compare with the files in --out; write nothing")
    args = parser.parse_args(argv)
    files = files_of()
    if args.check:
        stale = stale_files(args.out, files)
        for name in stale:
            print(f"{args.out / name}: differs from what `python -m {module}` writes", file=sys.stderr)
        return 1 if stale else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (args.out / name).write_bytes(text.encode("utf-8"))
        print(f"wrote {args.out / name} ({text.count(chr(10))} prompts)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
