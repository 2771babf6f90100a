"""The segment workloads: they load, they are what each segment calls for, none of them is in the training split,
the loader rejects bad lines with file:line:field messages, and the builder reproduces the committed files."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from refmodels.corpus import train_documents, validation_documents
from workloads import FIELDS, Prompt, load_all, load_workload
from workloads import build as builder

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "workloads"
SEGMENTS = ("code", "prose", "structured", "extractive", "adversarial", "toolcall")
MIN_PROMPTS = 40
WINDOW, STEP = 120, 50  # the overlap rule: no 120-char window (taken every 50 chars) occurs in training
BLOCK = 40  # this test's own index: aligned 40-char blocks; any 120-char match contains one (120 >= 2*40 - 1)


@pytest.fixture(scope="module")
def workloads() -> dict[str, list[Prompt]]:
    return load_all(FOLDER)


# ---------------------------------------------------------------------------------------------------------
# Shape of the files


def test_every_segment_has_enough_prompts(workloads):
    assert sorted(workloads) == sorted(SEGMENTS)
    for segment, prompts in workloads.items():
        assert len(prompts) >= MIN_PROMPTS, segment


def test_fields_and_types(workloads):
    for segment, prompts in workloads.items():
        for index, p in enumerate(prompts):
            assert p.segment == segment
            assert p.id == f"{segment}-{index:03d}"
            assert isinstance(p.prompt, str) and len(p.prompt) >= 100, p.id
            assert isinstance(p.max_new_tokens, int) and 64 <= p.max_new_tokens <= 128, p.id
            assert isinstance(p.temperature, float), p.id


def test_temperatures_match_the_segment(workloads):
    """Greedy where speculation should win, mixed for prose, hot (1.2-1.5) where it should lose."""
    for segment in ("code", "structured", "extractive", "toolcall"):
        assert {p.temperature for p in workloads[segment]} == {0.0}, segment
    assert {p.temperature for p in workloads["prose"]} == {0.0, 0.8}
    assert all(1.2 <= p.temperature <= 1.5 for p in workloads["adversarial"])
    assert all(p.max_new_tokens == 64 for p in workloads["adversarial"])


def test_ids_are_unique_across_files(workloads):
    ids = [p.id for prompts in workloads.values() for p in prompts]
    assert len(ids) == len(set(ids))


def test_lines_are_utf8_json_objects_with_the_fields_in_order():
    for path in sorted(FOLDER.glob("*.jsonl")):
        for line in path.read_bytes().decode("utf-8").splitlines():
            assert list(json.loads(line)) == list(FIELDS), path.name


def test_code_prompts_are_verbatim_validation_code():
    """Each code prompt is a slice of a held-out stdlib file, ending at a line boundary."""
    sources = [d.text for d in validation_documents() if d.domain == "code"]
    for p in load_workload(FOLDER / "code.jsonl"):
        assert p.prompt.endswith("\n")
        assert any(p.prompt in text for text in sources), p.id


def test_extractive_prompts_cover_the_kinds(workloads):
    """Restated code, JSON record lists, CSV tables, log tables and copies, at least five of each."""
    kinds = {
        "restate": r"\A# Original:\n",
        "json": r"\A\[\n  \{",
        "csv": r"\Asku_row,",
        "log": r"\A2025-\d\d-\d\d ",
        "copy": r"\ACopy the following text exactly:",
    }
    for kind, pattern in kinds.items():
        assert sum(bool(re.match(pattern, p.prompt)) for p in workloads["extractive"]) >= 5, kind


def test_toolcall_prompts_repeat_few_schemas_across_requests(workloads):
    """Each prompt is a log of 1-3 JSON tool calls ending in an opened call; across the prompts the same five tools
    recur with the same argument keys (the structure suffix decoding's cache can learn), while no prompt shows them
    all (what prompt lookup can copy from the prompt alone)."""
    schemas: dict[str, set[tuple[str, ...]]] = {}
    for p in workloads["toolcall"]:
        header, *calls, opened = p.prompt.split("\n")
        assert header.startswith("# tool calls") and opened == '{"tool": "' and 1 <= len(calls) <= 3, p.id
        for call in map(json.loads, calls):
            schemas.setdefault(call["tool"], set()).add(tuple(call["arguments"]))
        assert len({json.loads(c)["tool"] for c in calls}) < 5, p.id
    assert len(schemas) == 5 and all(len(keys) == 1 for keys in schemas.values()), schemas
    assert all(sum(tool in p.prompt for p in workloads["toolcall"]) >= 10 for tool in schemas)


# ---------------------------------------------------------------------------------------------------------
# No overlap with the training split (an index written independently of the builder's)


class TrainingText:
    """The training documents joined by NUL, plus the set of their aligned BLOCK-char blocks."""

    def __init__(self, texts: list[str]):
        self.text = "\0".join(texts)
        self.blocks = {t[i : i + BLOCK] for t in texts for i in range(0, len(t) - BLOCK + 1, BLOCK)}

    def contains(self, window: str) -> bool:
        if len(window) >= 2 * BLOCK - 1 and not any(
            window[j : j + BLOCK] in self.blocks for j in range(len(window) - BLOCK + 1)
        ):
            return False
        return window in self.text

    def overlapping_window(self, prompt: str) -> str | None:
        """The first window of ``prompt`` found in training, or None."""
        if len(prompt) <= WINDOW:
            return prompt if self.contains(prompt) else None
        starts = [*range(0, len(prompt) - WINDOW + 1, STEP), len(prompt) - WINDOW]
        return next((prompt[i : i + WINDOW] for i in starts if self.contains(prompt[i : i + WINDOW])), None)


@pytest.fixture(scope="module")
def training() -> TrainingText:
    return TrainingText([d.text for d in train_documents()])


def test_overlap_check_finds_training_text(training):
    """Controls: windows at random (unaligned) offsets of training documents are found; noise is not."""
    rng = random.Random(0)
    docs = [d for d in train_documents() if len(d.text) > 1000]
    for doc in rng.sample(docs, 20):
        start = rng.randrange(len(doc.text) - 300)
        assert training.overlapping_window("noise " * 30 + doc.text[start : start + 130]) is not None, doc.doc_id
    assert training.overlapping_window("".join(rng.choice("abcdefgh ") for _ in range(500))) is None


def test_overlap_check_catches_a_duplicated_validation_document(training):
    """``prose/customization`` is held out, but ``prose/specialnames`` repeats it: a prompt from it must fail."""
    text = next(d.text for d in validation_documents() if d.doc_id == "prose/customization")
    assert training.overlapping_window(text[500:1000]) is not None


def test_no_prompt_overlaps_the_training_split(workloads, training):
    for prompts in workloads.values():
        for p in prompts:
            window = training.overlapping_window(p.prompt)
            assert window is None, f"{p.id} shares {window!r} with the training split"


# ---------------------------------------------------------------------------------------------------------
# The loader rejects bad lines

GOOD = {"id": "a-000", "segment": "code", "prompt": "def f(", "max_new_tokens": 96, "temperature": 0.0}
_DROP = object()  # a field value meaning "leave the field out"


def _with(**changes: object) -> str:
    record = {**GOOD, "id": "a-001", **changes}
    return json.dumps({k: v for k, v in record.items() if v is not _DROP})


BAD_LINES = [
    # (second line of the file, expected "field: reason" part) — each row breaks exactly one rule
    (_with(prompt=_DROP), "prompt: missing field"),
    (_with(max_new_tokens=_DROP), "max_new_tokens: missing field"),
    (_with(tenant="x"), "tenant: unknown field"),
    (_with(id=7), "id: must be a string, got int"),
    (_with(segment=None), "segment: must be a string, got NoneType"),
    (_with(prompt=""), "prompt: must not be empty"),
    (_with(max_new_tokens=0), "max_new_tokens: must be positive, got 0"),
    (_with(max_new_tokens=-5), "max_new_tokens: must be positive, got -5"),
    (_with(max_new_tokens="96"), "max_new_tokens: must be an integer, got str"),
    (_with(max_new_tokens=96.0), "max_new_tokens: must be an integer, got float"),
    (_with(max_new_tokens=True), "max_new_tokens: must be an integer, got bool"),  # bool is an int to Python
    (_with(temperature=-0.1), "temperature: must be a finite number >= 0, got -0.1"),
    (_with(temperature=float("nan")), "temperature: must be a finite number >= 0, got nan"),  # json writes NaN
    (_with(temperature="0.7"), "temperature: must be a number, got str"),
    (_with(temperature=False), "temperature: must be a number, got bool"),
    (_with(id="a-000"), "id: duplicate id 'a-000' (first at "),  # line 1 has the same id
    ('{"id": "a-001", ', "(line): invalid JSON"),
    ("[1, 2]", "(line): expected a JSON object, got list"),
]


@pytest.mark.parametrize(("line", "message"), BAD_LINES, ids=[message for _, message in BAD_LINES])
def test_loader_names_file_line_and_field(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError) as info:
        load_workload(path)
    assert str(info.value).startswith(f"{path}:2: {message}")


def test_loader_counts_blank_lines_and_accepts_good_ones(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + _with(temperature=1) + "\n" + _with(id="a-002", max_new_tokens=0))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:4: max_new_tokens: "):
        load_workload(path)
    path.write_text(json.dumps(GOOD) + "\n\n" + _with(temperature=1) + "\n")
    assert load_workload(path) == [Prompt(**GOOD), Prompt("a-001", "code", "def f(", 96, 1.0)]


def test_load_all_rejects_ids_repeated_across_files(tmp_path):
    (tmp_path / "one.jsonl").write_text(json.dumps(GOOD) + "\n")
    (tmp_path / "two.jsonl").write_text(json.dumps(GOOD) + "\n")
    with pytest.raises(ValueError, match=r"two\.jsonl:1: id: duplicate id 'a-000' \(first at .*one\.jsonl:1\)"):
        load_all(tmp_path)
    with pytest.raises(ValueError, match=r"no \.jsonl workload files"):
        load_all(tmp_path / "missing")


# ---------------------------------------------------------------------------------------------------------
# Reproducibility


def test_build_check_passes_on_the_committed_files():
    """``python -m workloads.build --check`` in a fresh process, under a different string-hash seed."""
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    result = subprocess.run(
        [sys.executable, "-m", "workloads.build", "--check"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_build_check_fails_on_an_edited_file(tmp_path, capsys):
    for path in FOLDER.glob("*.jsonl"):
        shutil.copy(path, tmp_path / path.name)
    assert builder.main(["--check", "--out", str(tmp_path)]) == 0
    edited = tmp_path / "prose.jsonl"
    text = edited.read_text(encoding="utf-8").replace('"temperature": 0.8', '"temperature": 0.7', 1)
    edited.write_text(text, encoding="utf-8")
    assert builder.main(["--check", "--out", str(tmp_path)]) == 1
    assert "prose.jsonl: differs" in capsys.readouterr().err


def test_held_out_workloads_are_new_segments_from_new_sources_and_rebuild_the_same(training):
    """``python -m workloads.heldout --check`` in a fresh process; the held-out segments are none of the shipped
    ones, and no prompt overlaps the training split or repeats a shipped prompt."""
    from workloads import load_all
    from workloads.heldout import HELD_OUT_FOLDER, SEGMENTS

    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    result = subprocess.run(
        [sys.executable, "-m", "workloads.heldout", "--check"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    held_out, shipped = load_all(HELD_OUT_FOLDER), load_all(FOLDER)
    assert set(held_out) == set(SEGMENTS) and not set(held_out) & set(shipped)
    shipped_texts = {p.prompt for prompts in shipped.values() for p in prompts}
    for prompts in held_out.values():
        assert len(prompts) == 24
        for p in prompts:
            assert training.overlapping_window(p.prompt) is None and p.prompt not in shipped_texts
