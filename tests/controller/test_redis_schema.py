"""The Redis schema (storage.redis_schema): the names written are the stored format, byte for byte, and every name
written reads back as what was written. Each row's literal is a name data already in Redis has."""

from __future__ import annotations

import pytest

from controller.storage import redis_schema as schema
from controller.storage.redis_schema import Keys


@pytest.mark.parametrize(
    ("name", "written", "read"),
    [
        ("k|draft|3|rounds", schema.k_field("draft", 3, "rounds"), schema.KField("draft", 3, "rounds")),
        ("p|draft|0|verified", schema.position_field("draft", 0, "verified"),
         schema.PositionField("draft", 0, "verified", False)),
        ("q|prompt_lookup|7|offered", schema.position_field("prompt_lookup", 7, "offered", counterfactual=True),
         schema.PositionField("prompt_lookup", 7, "offered", True)),
        ("cal|suffix|-3", schema.calibration_field("suffix", -3), schema.CalibrationField("suffix", -3)),
        ("st|4|-160", schema.plain_step_field(4, -160), schema.PlainStepField(4, -160)),
        ("updated", schema.UPDATED, schema.UPDATED_FIELD),
    ],
)  # fmt: skip
def test_segment_fields_are_written_and_read_back(name, written, read):
    assert written == name
    assert schema.segment_field(name) == read


@pytest.mark.parametrize(
    ("name", "written", "read"),
    [
        ("e|draft|2|s", schema.draft_cost_field("draft", 2, "s"), schema.DraftCostField("draft", 2, "s")),
        ("w|0|1|r", schema.verify_cost_field(0, 1, "r"), schema.VerifyCostField(0, 1, "r")),
        ("he|chain|8|-200", schema.draft_hist_field("chain", 8, -200), schema.DraftHistField("chain", 8, -200)),
        ("hw|4|1|-150", schema.verify_hist_field(4, 1, -150), schema.VerifyHistField(4, 1, -150)),
    ],
)
def test_cost_fields_are_written_and_read_back(name, written, read):
    assert written == name
    assert schema.cost_field(name) == read


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("k|draft|65|rounds", "no round has K 65: it would size every table read from it"),
        ("p|draft|64|accepted", "position 64 is past any K"),
        ("p|draft|x|accepted", "not a number"),
        ("p|draft|0|rejected", "not a counter of the schema"),
        ("k|draft|3", "too short"),
        ("cal|draft|99999999", "no timing lies in that bin"),
        ("st|one|-160", "not a batch bucket"),
        ("x|draft|3|rounds", "a newer schema's field"),
    ],
)
def test_segment_fields_that_are_not_read(name, why):
    assert schema.segment_field(name) is None, why


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("d|draft|1|s", "a tag of another schema"),
        ("v|3|1|s", "a tag of another schema"),
        ("w|65|1|s", "no round verified 65 drafts"),
        ("hw|4|1|99999999", "no timing lies in that bin"),
        ("e|draft|1|r", "not a drafting quantity"),
        ("e|draft|one|s", "not a batch bucket"),
    ],
)
def test_cost_fields_that_are_not_read(name, why):
    assert schema.cost_field(name) is None, why


def test_first_position_reads_served_and_scored_position_0():
    fields = {"p|draft|0|accepted": 3.0, "p|draft|0|verified": 4.0, "q|draft|0|accepted": 1.0,
              "q|draft|0|verified": 2.0, "p|draft|1|verified": 9.0, "p|suffix|0|accepted": 0.0,
              "p|suffix|0|verified": float("nan"), "k|draft|3|rounds": 5.0}  # fmt: skip
    assert schema.first_position(fields) == [("draft", 4.0, 6.0)], "position 1, K fields and unverified drafters: out"


def test_key_names():
    keys = Keys("specd")
    assert keys.segment_bucket("chat:eu", 7) == "specd:v1:seg:{chat:eu}:7"
    assert keys.report("r1") == "specd:v1:report:{#global}:r1"
    assert keys.report("r1", "chat") == "specd:v1:report:{chat}:r1"
    assert (keys.segments(), keys.cost_bucket(7), keys.samples(), keys.prior()) == (
        "specd:v1:segments:{#global}", "specd:v1:cost:{#global}:7", "specd:v1:samples:{#global}", "specd:v1:prior",
    )  # fmt: skip
