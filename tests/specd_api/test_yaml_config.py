"""YAML config loading: every bad file is rejected with the exact line and field path of each problem.

Each document below is numbered in its comment so the expected lines can be checked by eye.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field

from specd_api.errors import SpecdError
from specd_api.yaml_config import EMPTY_FILE, ConfigError, ConfigIssue, load_yaml_model, parse_yaml_model


class Draft(BaseModel):
    model_config = ConfigDict(extra="forbid")
    k_max: int = Field(ge=1)
    temperature: float = 0.0


class Drafters(BaseModel):
    model_config = ConfigDict(extra="forbid")
    draft: Draft


class Segment(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    drafters: Drafters


class Policy(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    segments: list[Segment] = []


class AllDefaults(BaseModel):
    model_config = ConfigDict(extra="forbid")
    k_max: int = 4


def _doc(*lines: str) -> str:
    """A YAML document whose line n is `lines[n - 1]`."""
    return "\n".join(lines) + "\n"


def _issues(text: str, model: type[BaseModel] = Policy) -> list[tuple[int | None, str, str]]:
    """(line, field, message) of every issue `parse_yaml_model` raises for `text`."""
    with pytest.raises(ConfigError) as caught:
        parse_yaml_model(text, model, "policies/x.yaml")
    assert all(issue.file == "policies/x.yaml" for issue in caught.value.issues)
    return [(issue.line, issue.field, issue.message) for issue in caught.value.issues]


VALID = _doc(
    "name: demo",  # 1
    "segments:",  # 2
    "  - name: code",  # 3
    "    drafters:",  # 4
    "      draft:",  # 5
    "        k_max: 4",  # 6
)


@pytest.mark.parametrize(
    ("text", "expected", "why"),
    [
        pytest.param(
            _doc(
                "name: demo",  # 1
                "segments:",  # 2
                "  - {name: code, drafters: {draft: {k_max: 4}}}",  # 3
                "  - {name: chat, drafters: {draft: {k_max: 2}}}",  # 4
                "  - name: math",  # 5
                "    drafters:",  # 6
                "      draft:",  # 7
                "        k_max: many",  # 8
            ),
            [
                (
                    8,
                    "segments[2].drafters.draft.k_max",
                    "Input should be a valid integer, unable to parse string as an integer",
                )
            ],
            "wrong type deep in a list: third item (index 2), its k_max key sits on line 8",
            id="wrong-type-deep-in-list",
        ),
        pytest.param(
            _doc(
                "name: demo",  # 1
                "segments:",  # 2
                "  - name: code",  # 3
                "    drafters:",  # 4
                "      draft:",  # 5
                "        temperature: 0.5",  # 6
                "        k_max: 0",  # 7
            ),
            [(7, "segments[0].drafters.draft.k_max", "Input should be greater than or equal to 1")],
            "k_max has ge=1; 0 is out of range on line 7, not the line its mapping starts on (6)",
            id="out-of-range",
        ),
        pytest.param(
            _doc(
                "name: demo",  # 1
                "segments:",  # 2
                "  - name: code",  # 3
                "    drafters: {draft: {k_max: 4}}",  # 4
                "  - drafters:",  # 5
                "      draft: {k_max: 4}",  # 6
            ),
            [(5, "segments[1].name", "Field required")],
            "a missing field is blamed on its parent mapping: the second list item, starting on line 5",
            id="missing-field-in-list-item",
        ),
        pytest.param(
            _doc(
                "name: demo",  # 1
                "segments:",  # 2
                "  - name: code",  # 3
                "    drafters:",  # 4
                "      draft:",  # 5
                "        temperature: 0.5",  # 6
            ),
            [(6, "segments[0].drafters.draft.k_max", "Field required")],
            "a block mapping starts at its first key: {temperature: 0.5} is the parent, on line 6",
            id="missing-nested-field",
        ),
        pytest.param(
            _doc(
                "# a comment first",  # 1
                "segments: []",  # 2
            ),
            [(2, "name", "Field required")],
            "missing top-level field: the root mapping starts at its first key, after the comment",
            id="missing-top-level-field",
        ),
        pytest.param(
            _doc(
                "name: demo",  # 1
                "segments:",  # 2
                "  - name: code",  # 3
                "    drafters:",  # 4
                "      draft:",  # 5
                "        k_max: 4",  # 6
                "        kmax: 5",  # 7
            ),
            [(7, "segments[0].drafters.draft.kmax", "Extra inputs are not permitted")],
            "extra='forbid': the unknown key itself is blamed, on line 7",
            id="unknown-key",
        ),
        pytest.param(
            _doc(
                "name: demo",  # 1
                "segments:",  # 2
                "  - name:",  # 3
                "      - code",  # 4
                "    drafters: {draft: {k_max: 4}}",  # 5
            ),
            [(3, "segments[0].name", "Input should be a valid string")],
            "the key's line is blamed, not line 4 where the (wrong) list value starts",
            id="value-on-next-line",
        ),
        pytest.param(
            _doc(
                "name: demo",  # 1
                "segments:",  # 2
                "  - name: code",  # 3
                "    drafters:",  # 4
                "      draft:",  # 5
                "        k_max: 4",  # 6
                "        k_max: 6",  # 7
            ),
            [(7, "segments[0].drafters.draft.k_max", "duplicate key 'k_max' (first at line 6)")],
            "PyYAML would silently keep k_max: 6; the second occurrence (line 7) is the error",
            id="duplicate-key",
        ),
        pytest.param(
            _doc(
                "name: demo",  # 1
                "segments:",  # 2
                "  - name: code",  # 3
                "    drafters:",  # 4
                "      draft: &fast {k_max: 4}",  # 5
                "  - name: chat",  # 6
                "    drafters:",  # 7
                "      draft:",  # 8
                "        <<: *fast",  # 9
                "        k_max: 0",  # 10
            ),
            [(10, "segments[1].drafters.draft.k_max", "Input should be greater than or equal to 1")],
            "overriding a merged key is no duplicate, and the override (line 10) is blamed, not the anchor",
            id="merge-key-override",
        ),
        pytest.param(
            _doc(
                "name: demo",  # 1
                "segments:",  # 2
                "  - name: code",  # 3
                "    drafters: {draft: {k_max: 4}",  # 4
                "  - name: chat",  # 5
            ),
            [(5, "", "while parsing a flow mapping at line 4, expected ',' or '}', but got '-'")],
            "syntax error: the unclosed flow mapping from line 4 is noticed at the '-' on line 5",
            id="syntax-error",
        ),
        pytest.param(
            _doc(
                "name: demo",  # 1
                "\tsegments: []",  # 2
            ),
            [(2, "", "while scanning for the next token, found character '\\t' that cannot start any token")],
            "a tab cannot indent YAML; the yaml mark (0-based line 1) becomes line 2",
            id="syntax-error-tab",
        ),
        pytest.param(
            _doc(
                "- name: demo",  # 1
            ),
            [(1, "", "expected a mapping at the top level, found a sequence")],
            "a model needs a mapping; a top-level list is reported for the whole document",
            id="top-level-not-mapping",
        ),
        pytest.param(
            _doc(
                "name: demo",  # 1
                "segments:",  # 2
                "  - name: code",  # 3
                "    drafters:",  # 4
                "      draft:",  # 5
                "        k_max: -1",  # 6
                "        temprature: 0.5",  # 7
                "  - name: math",  # 8
                "    name: chat",  # 9
                "    drafters:",  # 10
                "      draft: {}",  # 11
            ),
            [
                (6, "segments[0].drafters.draft.k_max", "Input should be greater than or equal to 1"),
                (7, "segments[0].drafters.draft.temprature", "Extra inputs are not permitted"),
                (9, "segments[1].name", "duplicate key 'name' (first at line 8)"),
                (11, "segments[1].drafters.draft.k_max", "Field required"),
            ],
            "every problem is reported, duplicates and validation errors merged into line order",
            id="several-errors",
        ),
    ],
)
def test_issue_lines_and_fields(text, expected, why):
    assert _issues(text) == expected, why


@pytest.mark.parametrize(
    ("text", "line", "why"),
    [
        ("", None, "an empty file: a save that has not written anything yet looks just like it"),
        ("# only a comment\n", None, "comments only: no document"),
        ("---\n", 2, "a document marker and nothing else: an empty (null) document, after the marker"),
        ("# policy\n~\n", 2, "a document that is only null"),
    ],
)
def test_an_empty_document_is_refused(text, line, why):
    """An empty policy once went live as "0 segment rules", silently dropping every forced rule."""
    assert _issues(text, AllDefaults) == [(line, "", EMPTY_FILE)], why


@pytest.mark.parametrize(
    ("text", "expected", "why"),
    [
        ("{}\n", AllDefaults(), "{} says so: every default"),
        ("# every default\n{}\n", AllDefaults(), "comments around it change nothing"),
    ],
)
def test_an_explicitly_empty_mapping_uses_defaults(text, expected, why):
    assert parse_yaml_model(text, AllDefaults, "empty.yaml") == expected, why


def test_an_explicitly_empty_list_is_a_document():
    assert parse_yaml_model("name: demo\nsegments: []\n", Policy, "p.yaml") == Policy(name="demo", segments=[])


def test_valid_file_loads_and_returns_text(tmp_path: Path):
    path = tmp_path / "policy.yaml"
    path.write_text(VALID, encoding="utf-8")
    policy, text = load_yaml_model(path, Policy)
    assert text == VALID
    assert policy == Policy(name="demo", segments=[Segment(name="code", drafters=Drafters(draft=Draft(k_max=4)))])


def test_missing_file(tmp_path: Path):
    path = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError) as caught:
        load_yaml_model(path, Policy)
    assert caught.value.issues == (ConfigIssue(path, None, "", "cannot read file: No such file or directory"),)


def test_file_errors_name_the_path_as_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    Path("bad.yaml").write_text("name: demo\nname: again\n", encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_yaml_model("bad.yaml", Policy)
    assert str(caught.value) == "bad.yaml:2: name: duplicate key 'name' (first at line 1)"


def test_unsafe_tag_is_rejected_not_run():
    issues = _issues("name: !!python/object/apply:os.system [echo pwned]\n")
    assert [(line, field) for line, field, _ in issues] == [(1, "")]
    assert "could not determine a constructor" in issues[0][2]


@pytest.mark.parametrize(
    ("issue", "expected", "why"),
    [
        (
            ConfigIssue("policies/x.yaml", 14, "segments[2].drafters.draft.k_max", "too small"),
            "policies/x.yaml:14: segments[2].drafters.draft.k_max: too small",
            "file:line: field: message",
        ),
        (ConfigIssue("x.yaml", 3, "", "bad YAML"), "x.yaml:3: bad YAML", "no field: the whole document"),
        (ConfigIssue("x.yaml", None, "", "cannot read file"), "x.yaml: cannot read file", "no line known"),
    ],
)
def test_issue_str(issue, expected, why):
    assert str(issue) == expected, why


def test_config_error_is_a_specd_error_with_one_line_per_issue():
    issues = [ConfigIssue("x.yaml", 1, "a", "first"), ConfigIssue("x.yaml", 2, "b", "second")]
    error = ConfigError(issues)
    assert isinstance(error, SpecdError)
    assert error.issues == tuple(issues)
    assert str(error) == "x.yaml:1: a: first\nx.yaml:2: b: second"
