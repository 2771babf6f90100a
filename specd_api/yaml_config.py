"""Load a YAML file into a pydantic model; every problem is reported with its file, line and field path.

The text is composed once into a node tree (each node carries its `start_mark`) and then constructed
into plain Python data with PyYAML's safe constructor. Duplicate keys are found on the node tree before
construction, and each pydantic error's `loc` is followed through the same tree to find its line.

A file is hostile until proven otherwise (`YamlLimits`): it is read no further than its size limit, composed
by a loader that counts nodes, aliases and depth as it goes, and its node graph is measured with every alias
expanded (memoised per node, so measuring costs the graph, not the expansion) before anything is constructed:
a few hundred bytes of nested merge keys (`<<: [*a, *a, ...]`) that would expand to gigabytes are refused in
milliseconds. An empty file (nothing but whitespace or comments) is refused: a file meaning "every default"
says so with `{}`. Messages quote at most a short piece of the file.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from specd_api.errors import SpecdError

M = TypeVar("M", bound=BaseModel)

_MERGE_TAG = "tag:yaml.org,2002:merge"
_NODE_KINDS = {yaml.MappingNode: "a mapping", yaml.SequenceNode: "a sequence", yaml.ScalarNode: "a scalar"}
QUOTE_CHARS = 64  # the most characters of the file's own text a message repeats
_MESSAGE_CHARS = 300  # the longest message or field path an issue carries
EMPTY_FILE = "the file is empty (no YAML document, only whitespace or comments); write {} to accept every default"


@dataclass(frozen=True)
class YamlLimits:
    """Bounds on one YAML file, each checked before the work it bounds."""

    max_bytes: int = 512 << 10  # the file, never read past this (PyYAML: up to ~3 s of CPU to compose 512 KiB)
    max_nodes: int = 100_000  # nodes with every alias and merge key expanded (1,000 policy rules: 5,000-15,000)
    max_aliases: int = 1_000  # alias uses (`*name`) in the text
    max_depth: int = 64  # nesting of mappings and sequences


DEFAULT_LIMITS = YamlLimits()


def quote(text: str, limit: int = QUOTE_CHARS) -> str:
    """`repr(text)`, cut after `limit` characters with its full length noted."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def _clip(text: str) -> str:
    return text if len(text) <= _MESSAGE_CHARS else text[: _MESSAGE_CHARS - 3] + "..."


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a config file, located well enough for a user to fix it."""

    file: str  # path as given
    line: int | None  # 1-based line of the offending key/value; None if unknown
    field: str  # dotted path, e.g. "segments[2].drafters.draft.k_max"; "" for the whole document
    message: str  # reason, e.g. "Input should be greater than or equal to 1"

    def __post_init__(self) -> None:
        """Field paths and messages can carry the file's own text (a key, a tag): never more than a line's worth."""
        object.__setattr__(self, "field", _clip(self.field))
        object.__setattr__(self, "message", _clip(self.message))

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


# The validation context's key for the folder of the file being read: a validator that resolves a relative path (a
# certificate, a token file) resolves it there, as every path in a config file is meant.
CONFIG_DIR = "config_dir"


def load_yaml_model(path: str | Path, model: type[M], limits: YamlLimits = DEFAULT_LIMITS) -> tuple[M, str]:
    """Read, parse and validate `path` as `model`. Returns (instance, text). Raises ConfigError."""
    text = read_yaml_text(path, limits)
    context = {CONFIG_DIR: Path(path).resolve().parent}
    return parse_yaml_model(text, model, str(path), limits, context), text


def read_yaml_text(path: str | Path, limits: YamlLimits = DEFAULT_LIMITS) -> str:
    """The file's text: at most `limits.max_bytes` are read, and they must be UTF-8. Raises ConfigError."""
    return _decode(_read_bytes(path, limits), str(path))


def read_stable_text(
    path: str | Path,
    limits: YamlLimits = DEFAULT_LIMITS,
    settle_seconds: float = 0.25,
    max_reads: int = 8,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """The file's text once two reads `settle_seconds` apart agree, so an editor's save in progress (written in
    pieces, not renamed into place) is not taken half-written. Raises ConfigError when the file cannot be read,
    is not UTF-8, or is still changing after `max_reads` reads."""
    source = str(path)
    previous = _read_bytes(path, limits)
    for _ in range(max_reads - 1):
        sleep(settle_seconds)
        current = _read_bytes(path, limits)
        if current == previous:
            return _decode(current, source)
        previous = current
    message = f"the file kept changing while it was read ({max_reads} reads {settle_seconds:g} s apart); not loaded"
    raise ConfigError([ConfigIssue(source, None, "", message)])


def read_regular_file(path: str | Path, max_bytes: int) -> bytes:
    """At most ``max_bytes`` of a regular file. Anything else (a FIFO, a device, a directory) raises OSError at once:
    it is opened without blocking and refused on what fstat says, so a FIFO at a config path cannot hang a reader."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a FIFO, a device or a directory)")
        with os.fdopen(os.dup(fd), "rb") as file:
            return file.read(max_bytes)
    finally:
        os.close(fd)


def _read_bytes(path: str | Path, limits: YamlLimits) -> bytes:
    source = str(path)
    try:
        data = read_regular_file(path, limits.max_bytes + 1)
    except OSError as exc:
        message = f"cannot read file: {exc.strerror or exc}"
        raise ConfigError([ConfigIssue(source, None, "", message)]) from exc
    if len(data) > limits.max_bytes:
        message = f"the file is larger than {limits.max_bytes} bytes (the limit); not read further"
        raise ConfigError([ConfigIssue(source, None, "", message)])
    return data


def _decode(data: bytes, source: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        message = f"not UTF-8 text at byte {exc.start} ({exc.reason})"
        raise ConfigError([ConfigIssue(source, line, "", message)]) from None


def parse_yaml_model(
    text: str, model: type[M], source: str, limits: YamlLimits = DEFAULT_LIMITS, context: dict[str, Any] | None = None
) -> M:
    """Parse and validate YAML `text` as `model`; `source` names the text in messages, `context` is pydantic's
    validation context (`CONFIG_DIR`: the folder relative paths are taken from). Raises ConfigError."""
    if len(text) > limits.max_bytes or len(text.encode("utf-8", "surrogatepass")) > limits.max_bytes:
        message = f"the text is larger than {limits.max_bytes} bytes (the limit)"
        raise ConfigError([ConfigIssue(source, None, "", message)])
    root = _compose(text, source, limits)
    if root is None:
        raise ConfigError([ConfigIssue(source, None, "", EMPTY_FILE)])
    _check_expansion(root, source, limits)
    # Before construction: SafeConstructor flattens `<<` merge keys into mapping nodes in place, after
    # which a legitimate override of a merged key would look like a duplicate.
    issues = list(_duplicate_key_issues(root, source))
    data = _construct(root, text, source, issues)
    if data is None:  # a document that is only `null` or `~`
        raise ConfigError([*issues, ConfigIssue(source, _line(root), "", EMPTY_FILE)])
    if not isinstance(data, dict):
        message = f"expected a mapping at the top level, found {_NODE_KINDS.get(type(root), 'another node')}"
        issues.append(ConfigIssue(source, _line(root), "", message))
        raise ConfigError(issues)
    try:
        instance = model.model_validate(data, context=context)
    except ValidationError as exc:
        issues.extend(_validation_issues(exc, root, source))
        raise ConfigError(sorted(issues, key=_issue_order)) from exc
    if issues:
        raise ConfigError(sorted(issues, key=_issue_order))
    return instance


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, counting as it composes: nodes, alias uses and depth past `limits` raise.

    Flow nesting (`[[[...`) is bounded in the scanner too: it reads ahead over a flow collection that might turn
    out to be a key, keeping a candidate per open level, so 4,000 levels cost it 2.6 s (libyaml: 100,000 levels,
    39 s) before the composer sees a node."""

    def __init__(self, text: str, limits: YamlLimits) -> None:
        super().__init__(text)
        self.limits = limits
        self.nodes = self.aliases = self.depth = 0

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:
        if self.flow_level >= self.limits.max_depth:
            problem = f"nested more than {self.limits.max_depth} levels deep (the limit)"
            raise yaml.scanner.ScannerError(None, None, problem, self.get_mark())
        super().fetch_flow_collection_start(TokenClass)

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event = self.peek_event()
        limits = self.limits
        if isinstance(event, yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > limits.max_aliases:
                raise _limit_error(f"more than {limits.max_aliases} aliases (*name) in one file (the limit)", event)
        else:
            self.nodes += 1
            if self.nodes > limits.max_nodes:
                raise _limit_error(f"more than {limits.max_nodes} nodes in one file (the limit)", event)
        self.depth += 1
        try:
            if self.depth > limits.max_depth:
                raise _limit_error(f"nested more than {limits.max_depth} levels deep (the limit)", event)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def _limit_error(problem: str, event: yaml.Event) -> yaml.composer.ComposerError:
    mark: Any = event.start_mark  # a yaml.error.Mark from the pure-Python parser this loader runs
    return yaml.composer.ComposerError(None, None, problem, mark)


def _compose(text: str, source: str, limits: YamlLimits) -> yaml.Node | None:
    """The node tree of the single document in `text` (None when it is empty); syntax errors raise."""
    try:
        loader = _BoundedLoader(text, limits)  # the reader refuses characters YAML does not allow (NUL) right here
    except yaml.YAMLError as exc:
        raise ConfigError([_yaml_error_issue(exc, text, source)]) from exc
    try:
        root: yaml.Node | None = loader.get_single_node()
        return root
    except yaml.YAMLError as exc:
        raise ConfigError([_yaml_error_issue(exc, text, source)]) from exc
    finally:
        loader.dispose()


def _check_expansion(root: yaml.Node, source: str, limits: YamlLimits) -> None:
    """Refuse a graph whose aliases (merge keys included) would expand past `limits.max_nodes` nodes, or that
    contains itself. Each distinct node's expanded size is computed once, children first (an alias is the same
    node object as its anchor), so this costs the composed graph, never the expansion."""
    size: dict[int, int] = {}  # id(node) -> nodes under it, itself included, every alias expanded
    open_nodes: set[int] = set()  # nodes whose children are being measured: meeting one again is a cycle
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, measured = stack.pop()
        key = id(node)
        if measured:
            open_nodes.discard(key)
            total = 1 + sum(size[id(child)] for child in _children(node))
            if total > limits.max_nodes:
                message = (
                    f"aliases expand this {_NODE_KINDS[type(node)][2:]} to more than {limits.max_nodes} nodes "
                    "(the limit); anchors and merge keys (<<) may repeat content, not multiply it"
                )
                raise ConfigError([ConfigIssue(source, _line(node), "", message)])
            size[key] = total
        elif key in open_nodes:
            message = "an alias refers to a collection that contains it (a recursive structure)"
            raise ConfigError([ConfigIssue(source, _line(node), "", message)])
        elif key not in size:
            open_nodes.add(key)
            stack.append((node, True))
            stack.extend((child, False) for child in _children(node) if id(child) not in size)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


class _SafeConstructor(yaml.constructor.SafeConstructor):
    """PyYAML's safe constructor, refusing a scalar its explicit tag cannot read (`!!int 0.6`, `!!bool maybe`,
    `!!timestamp soon`) with a ConstructorError at the scalar's line, as it refuses an unknown tag; PyYAML itself
    raises ValueError, KeyError or AttributeError from its conversion there."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            value = quote(node.value) if isinstance(node, yaml.ScalarNode) else _NODE_KINDS.get(type(node), "a node")
            problem = f"{value} is not a valid {quote(tag)} value"
            raise yaml.constructor.ConstructorError(None, None, problem, node.start_mark) from exc


def _construct(root: yaml.Node | None, text: str, source: str, issues: list[ConfigIssue]) -> Any:
    """Plain Python data for `root` (safe tags only); an unknown tag or a value its tag cannot read raises along
    with earlier `issues`."""
    if root is None:
        return None
    try:
        return _SafeConstructor().construct_document(root)
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
                message = f"duplicate key {quote(str(key_node.value))} (first at line {first_line[key]})"
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
    try:
        value = _SafeConstructor().construct_object(key_node)
    except yaml.YAMLError:
        return None  # a key its tag cannot read (`!!int x: 1`): construction reports it, at its line
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
        text = str(part)
        if len(text) > QUOTE_CHARS or not text.isprintable():  # a key is the file's own text: a control character
            text = quote(text)  # or a newline in it would break the one-line message (and a terminal, a log)
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
        elif text.startswith("[") or not out:
            out += text
        else:
            out += f".{text}"
    return out


def _issue_order(issue: ConfigIssue) -> tuple[int, str]:
    """Sort key: by line (unknown lines last), then field."""
    return (issue.line if issue.line is not None else 1 << 30, issue.field)
