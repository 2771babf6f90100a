"""Sampling modes, and the learning segment a request is judged by. Pure.

Greedy and sampled requests of one segment are different traffic to a speculator: sampling hot, a draft model's flat
distribution agrees with the target's where greedy it does not, and a sampled round costs more (every drafted token
is sampled, every verified position softmaxed). So the controller learns them apart: a segment's sampled requests are
counted, decided and tabled under the learning segment ``<segment>#sampled``, its greedy ones under the segment's own
name. ``#`` is never in a segment name a client can give (specd_api.segments), so no client segment collides with a
learning segment, and a segment's policy is its base name's (``base_segment``).
"""

from __future__ import annotations

from typing import Literal

from specd_api.segments import MAX_SEGMENT_LENGTH, valid_segment, validate_segment

Mode = Literal["greedy", "sampled"]
GREEDY: Mode = "greedy"
SAMPLED: Mode = "sampled"
MODES: tuple[Mode, ...] = (GREEDY, SAMPLED)
GREEDY_BELOW = 1e-5  # temperatures under this are treated as 0 (greedy): logits / T overflows, the argmax decides
SAMPLED_SUFFIX = "#sampled"
MAX_LEARNING_SEGMENT_LENGTH = MAX_SEGMENT_LENGTH + len(SAMPLED_SUFFIX)


def sampling_mode(temperature: float) -> Mode:
    """Greedy below GREEDY_BELOW (and for a temperature that is not a number), else sampled."""
    return SAMPLED if temperature >= GREEDY_BELOW else GREEDY


def learning_segment(segment: str, temperature: float) -> str:
    """The name a request of ``segment`` at ``temperature`` is learned and decided under."""
    return segment + SAMPLED_SUFFIX if sampling_mode(temperature) == SAMPLED else segment


def base_segment(name: str) -> str:
    """The client's segment of a learning segment (its policy, its suffix cache)."""
    return name.removesuffix(SAMPLED_SUFFIX)


def mode_of(name: str) -> Mode:
    """The sampling mode of a learning segment's requests."""
    return SAMPLED if name.endswith(SAMPLED_SUFFIX) else GREEDY


def valid_learning_segment(name: str) -> bool:
    """A client segment, or one with the sampled suffix."""
    return valid_segment(base_segment(name))


def validate_learning_segment(name: str) -> str:
    """``name`` if it is a segment or a learning segment; else ValueError naming the problem (the base's)."""
    validate_segment(base_segment(name))
    return name
