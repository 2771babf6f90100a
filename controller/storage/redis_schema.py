"""The Redis schema: every key name, hash field name and stored row the controller writes, encoded and decoded here
and nowhere else. Pure: store.py does the I/O, counts.py the counting.

Keys (``P`` is the configurable prefix, default ``specd``; the schema version is part of every key). Every key
carries a hash tag (``{...}``: Redis Cluster places a key by the text between its first braces), either its
segment's or the fixed tag ``{#global}`` (``#`` is never part of a segment name), so that each of store.py's Lua
scripts touches keys of one slot only and runs unchanged on one server or on a cluster:

    P:v1:seg:{S}:<bucket>           hash   counters of segment S in one time bucket (segment fields below)
    P:v1:report:{S}:<report_id>     string dedup marker of the part of a report counted under segment S (expires)
    P:v1:report:{#global}:<report_id>
                                    string dedup marker of the report's global part; its value is the segment each
                                           of the report's segments was counted as (the cap's verdict), so that a
                                           retry writes its segment parts where the first delivery decided
    P:v1:segments:{#global}         zset   segment -> last report time (the cap on distinct active segments;
                                           segments silent for a whole window are dropped from it)
    P:v1:changes:{#global}          zset   segment -> the number of the last change mark of its counts (the newest
                                           2 x (max segments + 1) kept)
    P:v1:change_state:{#global}     hash   the marks' epoch (made by the first mark: a new one says the marks
                                           were lost), seq (the last mark's number), trimmed (the newest one dropped)
    P:v1:cost:{#global}:<bucket>    hash   measured costs over all segments (cost fields below)
    P:v1:samples:{#global}          list   recent per-aggregate feature rows for the prior model (capped; sample rows)
    P:v1:prior                      string the prior model's coefficients as JSON (never pickle)

In key names, ``{S}`` (the segment's name) and ``{#global}`` are written with their braces: they are the hash tags;
``<...>`` stands for a value (in field names, ``{...}`` does). ``bucket`` = floor(unix time / bucket_seconds).

Segment fields (a segment bucket hash):

    k|{drafter}|{K}|{rounds,proposed,accepted,tokens,draft_s,verify_s}   served rounds that ran at K
    p|{drafter}|{position}|{offered,proposed,verified,accepted}          served rounds, per draft position
    q|{drafter}|{position}|{offered,proposed,verified,accepted}          counterfactually scored rounds, the same
    cal|{drafter}|{bin}        requests whose realised / expected speedup fell in that bin (timing_histogram.py)
    st|{batch bucket}|{bin}    requests whose plain rounds (n = 0) took that many seconds each
    sp|{drafter}|{batch bucket}|{bin}
                               requests that speculated with that drafter, by seconds per token emitted (every
                               round's seconds over every token): what a plan realised, read against st| (realised.py)
    updated                    the time of the last report counted in the hash

Cost fields (a cost bucket hash), of greedy rounds; those of sampled rounds have the tag with an ``s`` appended
(``es|``, ``ws|``, ``hes|``, ``hws|``): a sampled round costs more (specd_api.modes), and each mode's costs are its own:

    e|{drafter}|{batch bucket}|{s,n}    drafting seconds / tokens drafted
    w|{n}|{batch bucket}|{s,r}          verify seconds / rounds that verified exactly n drafts
    he|{drafter}|{batch bucket}|{bin}   requests by seconds per drafted token (timing_histogram.py: the costs are
    hw|{n}|{batch bucket}|{bin}         requests by seconds per round verifying n      the histograms' medians)

Unknown names. A field this module does not know (another schema's) and a field name that does not parse
(hand-edited or corrupt data, a draft position or K past any round's, a bin no timing falls in) decode to None and
are ignored: stored data never breaks a read.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from controller.decision.timing_histogram import MAX_BIN, MIN_BIN
from specd_api.checks import MAX_K
from specd_api.modes import GREEDY, MODES, SAMPLED, Mode

VERSION = "v1"
GLOBAL_TAG = "#global"  # the hash tag of the keys every report touches; '#' is never in a segment name


@dataclass(frozen=True)
class Keys:
    """The key names under one prefix."""

    prefix: str

    def _key(self, *parts: str | int) -> str:
        return ":".join((self.prefix, VERSION, *map(str, parts)))

    def segment_bucket(self, segment: str, bucket: int) -> str:
        return self._key("seg", f"{{{segment}}}", bucket)

    def report(self, report_id: str, segment: str | None = None) -> str:
        """The dedup marker of ``report_id``'s part counted under ``segment``, or of its global part (None)."""
        return self._key("report", f"{{{GLOBAL_TAG if segment is None else segment}}}", report_id)

    def segments(self) -> str:
        return self._global("segments")

    def changes(self) -> str:
        return self._global("changes")

    def change_state(self) -> str:
        return self._global("change_state")

    def cost_bucket(self, bucket: int | str) -> str:
        return self._global("cost", bucket)

    def samples(self) -> str:
        return self._global("samples")

    def prior(self) -> str:
        return self._key("prior")

    def _global(self, name: str, *parts: str | int) -> str:
        return self._key(name, f"{{{GLOBAL_TAG}}}", *parts)


# --- segment fields ---------------------------------------------------------------------------------

KCounter = Literal["rounds", "proposed", "accepted", "tokens", "draft_s", "verify_s"]
PositionCounter = Literal["offered", "proposed", "verified", "accepted"]
K_COUNTERS: dict[str, KCounter] = {c: c for c in ("rounds", "proposed", "accepted", "tokens", "draft_s", "verify_s")}
POSITION_COUNTERS: dict[str, PositionCounter] = {c: c for c in ("offered", "proposed", "verified", "accepted")}
K_LEVEL = "k"
SERVED, COUNTERFACTUAL = "p", "q"  # position fields of served rounds, and of counterfactually scored ones
CALIBRATION = "cal"
PLAIN_STEP = "st"
REALISED = "sp"
UPDATED = "updated"


class KField(NamedTuple):
    """``k|{drafter}|{K}|{counter}``"""

    drafter: str
    k: int
    counter: KCounter


class PositionField(NamedTuple):
    """``p|{drafter}|{position}|{counter}``, or ``q|...`` for counterfactual rounds"""

    drafter: str
    position: int
    counter: PositionCounter
    counterfactual: bool


class CalibrationField(NamedTuple):
    """``cal|{drafter}|{bin}``"""

    drafter: str
    bin: int


class PlainStepField(NamedTuple):
    """``st|{batch bucket}|{bin}``"""

    batch_bucket: int
    bin: int


class RealisedField(NamedTuple):
    """``sp|{drafter}|{batch bucket}|{bin}``"""

    drafter: str
    batch_bucket: int
    bin: int


class UpdatedField(NamedTuple):
    """The ``updated`` field: the time of the last report counted in the hash."""

    name: str = UPDATED


UPDATED_FIELD = UpdatedField()
SegmentField = KField | PositionField | CalibrationField | PlainStepField | RealisedField | UpdatedField


def k_field(drafter: str, k: int, counter: KCounter) -> str:
    return f"{K_LEVEL}|{drafter}|{k}|{counter}"


def position_field(drafter: str, position: int, counter: PositionCounter, counterfactual: bool = False) -> str:
    return f"{COUNTERFACTUAL if counterfactual else SERVED}|{drafter}|{position}|{counter}"


# The names one report's increments are written under, per (drafter, K) and per (drafter, position, served or
# scored): built once each, not per aggregate. Drafters are validated names and K and positions below MAX_K, so the
# tables stay small; the caches are bounded all the same.
_NAME_TABLES = 2**12


@functools.lru_cache(maxsize=_NAME_TABLES)
def k_fields(drafter: str, k: int) -> tuple[str, ...]:
    """``k_field(drafter, k, c)`` for each counter c of ``K_COUNTERS``, in its order."""
    return tuple(k_field(drafter, k, c) for c in K_COUNTERS.values())


@functools.lru_cache(maxsize=_NAME_TABLES)
def position_fields(drafter: str, position: int, counterfactual: bool = False) -> tuple[str, ...]:
    """``position_field(drafter, position, c, counterfactual)`` for each counter c of ``POSITION_COUNTERS``, in its
    order (offered, proposed, verified, accepted)."""
    return tuple(position_field(drafter, position, c, counterfactual) for c in POSITION_COUNTERS.values())


def calibration_field(drafter: str, b: int) -> str:
    return f"{CALIBRATION}|{drafter}|{b}"


def plain_step_field(batch_bucket: int, b: int) -> str:
    return f"{PLAIN_STEP}|{batch_bucket}|{b}"


def realised_field(drafter: str, batch_bucket: int, b: int) -> str:
    return f"{REALISED}|{drafter}|{batch_bucket}|{b}"


def field_name(f: SegmentField) -> str:
    """The name a worker's report writes ``f`` under: one name per counter (``segment_field`` also reads "01" as 1)."""
    if isinstance(f, KField):
        return k_field(f.drafter, f.k, f.counter)
    if isinstance(f, PositionField):
        return position_field(f.drafter, f.position, f.counter, f.counterfactual)
    if isinstance(f, CalibrationField):
        return calibration_field(f.drafter, f.bin)
    if isinstance(f, PlainStepField):
        return plain_step_field(f.batch_bucket, f.bin)
    if isinstance(f, RealisedField):
        return realised_field(f.drafter, f.batch_bucket, f.bin)
    return UPDATED


# A refresh parses every field of every bucket of the window, and the same few thousand names recur in all of them:
# each name is parsed once (the fields are immutable), in a bounded cache (names nobody writes cannot grow it).
_PARSED_NAMES = 2**14


@functools.lru_cache(maxsize=_PARSED_NAMES)
def segment_field(name: str) -> SegmentField | None:
    """What a segment hash field counts; None for a field to ignore (module docstring)."""
    parts = name.split("|")
    try:
        if parts[0] == K_LEVEL and len(parts) == 4 and (k_counter := K_COUNTERS.get(parts[3])):
            k = int(parts[2])
            # no round has such a K: a corrupt field (it would size every table read from it)
            return KField(parts[1], k, k_counter) if 0 <= k <= MAX_K else None
        if parts[0] in (SERVED, COUNTERFACTUAL) and len(parts) == 4 and (counter := POSITION_COUNTERS.get(parts[3])):
            i = int(parts[2])
            # a draft position past any K: corrupt (position 3,000,000 costs 7.7 s a read)
            return PositionField(parts[1], i, counter, parts[0] == COUNTERFACTUAL) if 0 <= i < MAX_K else None
        if parts[0] in (CALIBRATION, PLAIN_STEP) and len(parts) == 3:
            b = int(parts[2])
            if not MIN_BIN <= b <= MAX_BIN:
                return None  # no real observation lies there
            return CalibrationField(parts[1], b) if parts[0] == CALIBRATION else PlainStepField(int(parts[1]), b)
        if parts[0] == REALISED and len(parts) == 4:
            b = int(parts[3])
            return RealisedField(parts[1], int(parts[2]), b) if MIN_BIN <= b <= MAX_BIN else None
    except ValueError:
        return None  # a corrupt field name
    return UPDATED_FIELD if name == UPDATED else None  # else a field of a newer schema


def first_position(fields: Mapping[str, float]) -> list[tuple[str, float, float]]:
    """(drafter, accepted, verified) at draft position 0 in one segment bucket hash, served and counterfactual
    together, for the drafters that verified any."""
    totals: dict[str, list[float]] = {}
    for name, value in fields.items():
        f = segment_field(name)
        if isinstance(f, PositionField) and f.position == 0 and f.counter in ("accepted", "verified"):
            entry = totals.setdefault(f.drafter, [0.0, 0.0])
            entry[0 if f.counter == "accepted" else 1] += value if math.isfinite(value) and value > 0 else 0.0
    return [(d, a, v) for d, (a, v) in sorted(totals.items()) if v > 0]


# --- cost fields ------------------------------------------------------------------------------------

DRAFT_COST, VERIFY_COST = "e", "w"
DRAFT_HIST, VERIFY_HIST = "he", "hw"
SAMPLED_TAG = "s"  # appended to a cost field's tag for the rounds of sampled requests
_COST_TAGS: dict[str, tuple[str, Mode]] = {
    tag + (SAMPLED_TAG if mode == SAMPLED else ""): (tag, mode)
    for tag in (DRAFT_COST, VERIFY_COST, DRAFT_HIST, VERIFY_HIST)
    for mode in MODES
}


def _cost_tag(tag: str, mode: Mode) -> str:
    return tag + SAMPLED_TAG if mode == SAMPLED else tag


DraftQuantity = Literal["s", "n"]  # seconds, tokens drafted
VerifyQuantity = Literal["s", "r"]  # seconds, rounds
_DRAFT_QUANTITIES: dict[str, DraftQuantity] = {"s": "s", "n": "n"}
_VERIFY_QUANTITIES: dict[str, VerifyQuantity] = {"s": "s", "r": "r"}


class DraftCostField(NamedTuple):
    """``e|{drafter}|{batch bucket}|{s,n}``"""

    drafter: str
    batch_bucket: int
    quantity: DraftQuantity
    mode: Mode = GREEDY  # the sampling mode of the rounds timed


class VerifyCostField(NamedTuple):
    """``w|{n}|{batch bucket}|{s,r}``"""

    n: int  # drafts verified in the round
    batch_bucket: int
    quantity: VerifyQuantity
    mode: Mode = GREEDY  # the sampling mode of the rounds timed


class DraftHistField(NamedTuple):
    """``he|{drafter}|{batch bucket}|{bin}``"""

    drafter: str
    batch_bucket: int
    bin: int
    mode: Mode = GREEDY  # the sampling mode of the rounds timed


class VerifyHistField(NamedTuple):
    """``hw|{n}|{batch bucket}|{bin}``"""

    n: int
    batch_bucket: int
    bin: int
    mode: Mode = GREEDY  # the sampling mode of the rounds timed


CostField = DraftCostField | VerifyCostField | DraftHistField | VerifyHistField


def draft_cost_field(drafter: str, batch_bucket: int, quantity: DraftQuantity, mode: Mode = GREEDY) -> str:
    return f"{_cost_tag(DRAFT_COST, mode)}|{drafter}|{batch_bucket}|{quantity}"


def verify_cost_field(n: int, batch_bucket: int, quantity: VerifyQuantity, mode: Mode = GREEDY) -> str:
    return f"{_cost_tag(VERIFY_COST, mode)}|{n}|{batch_bucket}|{quantity}"


def draft_hist_field(drafter: str, batch_bucket: int, b: int, mode: Mode = GREEDY) -> str:
    return f"{_cost_tag(DRAFT_HIST, mode)}|{drafter}|{batch_bucket}|{b}"


def verify_hist_field(n: int, batch_bucket: int, b: int, mode: Mode = GREEDY) -> str:
    return f"{_cost_tag(VERIFY_HIST, mode)}|{n}|{batch_bucket}|{b}"


@functools.lru_cache(maxsize=_PARSED_NAMES)
def cost_field(name: str) -> CostField | None:
    """What a cost hash field counts; None for a field to ignore (module docstring)."""
    parts = name.split("|")
    if len(parts) != 4 or parts[0] not in _COST_TAGS:
        return None  # another schema's field
    kind, mode = _COST_TAGS[parts[0]]
    try:
        if kind in (DRAFT_HIST, VERIFY_HIST):
            b = int(parts[3])
            if not MIN_BIN <= b <= MAX_BIN:
                return None  # no real timing lies there: a corrupt field
            if kind == DRAFT_HIST:
                return DraftHistField(parts[1], int(parts[2]), b, mode)
            n = int(parts[1])
            return VerifyHistField(n, int(parts[2]), b, mode) if 0 <= n <= MAX_K else None
        if kind == DRAFT_COST and (drafted := _DRAFT_QUANTITIES.get(parts[3])):
            return DraftCostField(parts[1], int(parts[2]), drafted, mode)
        if kind == VERIFY_COST and (verified := _VERIFY_QUANTITIES.get(parts[3])):
            n = int(parts[1])
            return VerifyCostField(n, int(parts[2]), verified, mode) if 0 <= n <= MAX_K else None
    except ValueError:
        return None  # a corrupt field name
    return None  # another schema's field


# --- sample rows ------------------------------------------------------------------------------------

SAMPLE_NUMBERS = {
    "temperature": 100.0,
    "prompt_tokens": 1e9,
    "self_repetition": 1.0,
    "verified": 1e12,
    "accepted": 1e12,
}


def encode_sample(
    drafter: str,
    temperature: float,
    prompt_tokens: int,
    self_repetition: float,
    verified: int,
    accepted: int,
    at: float,
) -> str:
    """One training row for the prior: request features and the per-token acceptance outcome."""
    return json.dumps(
        {
            "drafter": drafter,
            "temperature": temperature,
            "prompt_tokens": prompt_tokens,
            "self_repetition": self_repetition,
            "verified": verified,
            "accepted": accepted,
            "at": at,
        }
    )


def stored_json(raw: object) -> object | None:
    """A stored value read as JSON (a sample row, the prior's document), or None when it is not JSON: not text, not
    UTF-8, not JSON, or nested deeper than the parser recurses (3,000 brackets raise RecursionError, which no reader
    expects: None keeps the controller starting and every refresh going)."""
    try:
        return json.loads(raw)  # type: ignore[arg-type]
    except (ValueError, TypeError, UnicodeDecodeError, RecursionError):
        return None


def sample_row(raw: object) -> dict[str, Any] | None:
    """One stored training row as the prior reads it, or None when it is not one."""
    row = stored_json(raw)
    if not isinstance(row, dict) or not isinstance(row.get("drafter"), str):
        return None
    for name, high in SAMPLE_NUMBERS.items():
        value = row.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not (0 <= value <= high):
            return None  # NaN fails the comparison too
    if row["accepted"] > row["verified"]:
        return None
    return row
