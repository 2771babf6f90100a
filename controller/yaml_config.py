"""Load a YAML file into a pydantic model; every problem is reported with its file, line and field path.

The text is composed once into a node tree (each node carries its `start_mark`) and then constructed
into plain Python data with PyYAML's safe constructor. Duplicate keys are found on the node tree before
construction, and each pydantic error's `loc` is followed through the same tree to find its line.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from specd_api.errors import SpecdError

M = TypeVar("M", bound=BaseModel)

_MERGE_TAG = "tag:yaml.org,2002:merge"
_NODE_KINDS = {yaml.MappingNode: "a mapping", yaml.SequenceNode: "a sequence", yaml.ScalarNode: "a scalar"}


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a config file, located well enough for a user to fix it."""

    file: str  # path as given
    line: int | None  # 1-based line of the offending key/value; None if unknown
    field: str  # dotted path, e.g. "segments[2].drafters.draft.k_max"; "" for the whole document
    message: str  # reason, e.g. "Input should be greater than or equal to 1"

    def __str__(self) -> str:
        """`file:line: field: message`, leaving out the line or field when there is none."""
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{where}: {self.field}: {self.message}" if self.field else f"{where}: {self.message}"


class ConfigError(SpecdError):
    """A config file was rejected; `issues` holds every problem found, in file order where known."""

    def __init__(self, issues: Sequence[ConfigIssue]) -> None:
        assert issues, "ConfigError needs at least one issue"
        self.issues: tuple[ConfigIssue, ...] = tuple(issues)
        super().__init__("\n".join(str(issue) for issue in self.issues))


def load_yaml_model(path: str | Path, model: type[M]) -> tuple[M, str]:
    """Read, parse and validate `path` as `model`. Returns (instance, text). Raises ConfigError."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        message = f"cannot read file: {exc.strerror or exc}"
        raise ConfigError([ConfigIssue(source, None, "", message)]) from exc
    except UnicodeDecodeError as exc:
        message = f"cannot read file: not UTF-8 text ({exc.reason} at byte {exc.start})"
        raise ConfigError([ConfigIssue(source, None, "", message)]) from exc
    return parse_yaml_model(text, model, source), text


def parse_yaml_model(text: str, model: type[M], source: str) -> M:
    """Parse and validate YAML `text` as `model`; `source` names the text in messages. Raises ConfigError."""
    root = _compose(text, source)
    # Before construction: SafeConstructor flattens `<<` merge keys into mapping nodes in place, after
    # which a legitimate override of a merged key would look like a duplicate.
    issues = list(_duplicate_key_issues(root, source))
    data = _construct(root, text, source, issues)
    if data is None:  # empty document: let all-default models load
        data = {}
    if not isinstance(data, dict):
        message = f"expected a mapping at the top level, found {_NODE_KINDS.get(type(root), 'another node')}"
        issues.append(ConfigIssue(source, _line(root), "", message))
        raise ConfigError(issues)
    try:
        instance = model.model_validate(data)
    except ValidationError as exc:
        issues.extend(_validation_issues(exc, root, source))
        raise ConfigError(sorted(issues, key=_issue_order)) from exc
    if issues:
        raise ConfigError(sorted(issues, key=_issue_order))
    return instance


def _compose(text: str, source: str) -> yaml.Node | None:
    """The node tree of the single document in `text` (None when it is empty); syntax errors raise."""
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise ConfigError([_yaml_error_issue(exc, text, source)]) from exc


def _construct(root: yaml.Node | None, text: str, source: str, issues: list[ConfigIssue]) -> Any:
    """Plain Python data for `root` (safe tags only); an unknown tag raises along with earlier `issues`."""
    if root is None:
        return None
    try:
        return yaml.constructor.SafeConstructor().construct_document(root)
    except yaml.YAMLError as exc:
        raise ConfigError([*issues, _yaml_error_issue(exc, text, source)]) from exc


def _yaml_error_issue(exc: yaml.YAMLError, text: str, source: str) -> ConfigIssue:
    """One issue for a syntax (or reader/constructor) error, at the line PyYAML points to."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        line = None if mark is None else mark.line + 1
        return ConfigIssue(source, line, "", _marked_error_message(exc))
    if isinstance(exc, yaml.reader.ReaderError):
        line = text.count("\n", 0, exc.position) + 1
        return ConfigIssue(source, line, "", f"unacceptable character #x{exc.character:04x}: {exc.reason}")
    return ConfigIssue(source, None, "", str(exc))


def _marked_error_message(exc: yaml.MarkedYAMLError) -> str:
    """`problem`, prefixed by the `context` it arose in (with that context's line when it differs)."""
    problem = exc.problem or "invalid YAML"
    if not exc.context:
        return problem
    context_mark, problem_mark = exc.context_mark, exc.problem_mark
    if context_mark is not None and (problem_mark is None or context_mark.line != problem_mark.line):
        return f"{exc.context} at line {context_mark.line + 1}, {problem}"
    return f"{exc.context}, {problem}"


def _duplicate_key_issues(root: yaml.Node | None, source: str) -> Iterator[ConfigIssue]:
    """One issue per key that repeats an earlier key of the same mapping (PyYAML keeps the last silently)."""
    for mapping, path in _mappings(root):
        first_line: dict[Hashable, int | None] = {}
        for key_node, _ in mapping.value:
            key = _scalar_key(key_node)
            if key is None:
                continue
            if key in first_line:
                message = f"duplicate key {key_node.value!r} (first at line {first_line[key]})"
                yield ConfigIssue(source, _line(key_node), _render_path((*path, key)), message)
            else:
                first_line[key] = _line(key_node)


def _mappings(root: yaml.Node | None) -> Iterator[tuple[yaml.MappingNode, tuple[Any, ...]]]:
    """Every mapping node under `root` with its path, each once (aliases can make the tree a graph)."""
    stack: list[tuple[yaml.Node | None, tuple[Any, ...]]] = [(root, ())]
    visited: set[int] = set()
    while stack:
        node, path = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        if isinstance(node, yaml.MappingNode):
            yield node, path
            stack.extend((value, (*path, _path_part(key))) for key, value in reversed(node.value))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, (*path, i)) for i, item in reversed(list(enumerate(node.value))))


def _scalar_key(key_node: yaml.Node) -> Hashable | None:
    """The Python value of a plain scalar key (`yes` and `true` are the same key); None for others."""
    if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
        return None
    value = yaml.constructor.SafeConstructor().construct_object(key_node)
    return value if isinstance(value, Hashable) else None


def _path_part(key_node: yaml.Node) -> Any:
    """How a key appears in a field path: its value, or its source text for merge (`<<`) and odd keys."""
    key = _scalar_key(key_node)
    if key is not None:
        return key
    return key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"


def _validation_issues(exc: ValidationError, root: yaml.Node | None, source: str) -> Iterator[ConfigIssue]:
    """One issue per pydantic error, at the line of the YAML node its `loc` leads to."""
    for error in exc.errors(include_url=False):
        loc = tuple(error["loc"])
        node = _node_at(root, loc, missing=error["type"] == "missing")
        yield ConfigIssue(source, _line(node), _render_path(loc), error["msg"])


def _node_at(root: yaml.Node | None, loc: tuple[Any, ...], missing: bool) -> yaml.Node | None:
    """The node to blame for an error at `loc`: a mapping entry's key node, or a list item's node.

    When `loc` leaves the YAML (pydantic adds union member names and "[key]" to it), the last node
    reached is blamed; for a `missing` field that is the parent mapping itself.
    """
    blamed, node = root, root
    for part in loc:
        found = _child(node, part)
        if found is None:
            if missing:
                blamed = node
            break
        blamed, node = found
    return blamed


def _child(node: yaml.Node | None, part: Any) -> tuple[yaml.Node, yaml.Node] | None:
    """(node to blame, node to descend into) for mapping key or list index `part`; None if absent."""
    if isinstance(node, yaml.MappingNode):
        # Last match wins, as in construction: merged (`<<`) entries were flattened in ahead of own keys.
        for key_node, value_node in reversed(node.value):
            if _scalar_key(key_node) == part:
                return key_node, value_node
    if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
        item = node.value[part]
        return item, item
    return None


def _line(node: yaml.Node | None) -> int | None:
    """1-based line where `node` starts, or None when there is no node (empty document)."""
    return None if node is None else node.start_mark.line + 1


def _render_path(loc: tuple[Any, ...]) -> str:
    """`("segments", 2, "k_max")` → `"segments[2].k_max"`; pydantic's `"[key]"` parts attach without a dot."""
    out = ""
    for part in loc:
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
        elif str(part).startswith("[") or not out:
            out += str(part)
        else:
            out += f".{part}"
    return out


def _issue_order(issue: ConfigIssue) -> tuple[int, str]:
    """Sort key: by line (unknown lines last), then field."""
    return (issue.line if issue.line is not None else 1 << 30, issue.field)
