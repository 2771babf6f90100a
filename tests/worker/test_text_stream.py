"""TextStream: what streaming may send after each step, with the tiny byte-level BPE tokenizer (it splits
every non-ASCII character into byte tokens that decode to U+FFFD alone)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from decoder.request_stop import trim_stop_string
from decoder.worker.text_stream import TextStream

TEXT = "Grüße — 日本語 🙂 and STOP words, then more; naïve café."


@pytest.fixture(scope="module")
def decode(tokenizer):
    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))

    return decode


def ids_of(tokenizer, *pieces: str) -> list[int]:
    """Token ids of ``pieces`` encoded one by one: token boundaries fall at least between pieces."""
    return [i for piece in pieces for i in tokenizer(piece)["input_ids"]]


def run(stream: TextStream, ids: list[int], chunk_sizes: Sequence[int]) -> list[str]:
    """Push ``ids`` in chunks of the given sizes (cycled); the deltas, in order."""
    deltas, at, i = [], 0, 0
    while at < len(ids):
        size = chunk_sizes[i % len(chunk_sizes)]
        deltas.append(stream.push(ids[at : at + size]))
        at, i = at + size, i + 1
    return deltas


@pytest.mark.parametrize("chunk_sizes", [[1], [2, 1, 3], [4], [1000]], ids=["one", "mixed", "rounds-of-4", "all"])
def test_deltas_concatenate_to_the_final_text(tokenizer, decode, chunk_sizes):
    ids = tokenizer(TEXT)["input_ids"]
    assert "\ufffd" in "".join(decode([i]) for i in ids), "the text should split characters across tokens"
    stream = TextStream(decode, ())
    deltas = run(stream, ids, chunk_sizes)
    deltas.append(stream.finish(decode(ids)))
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas), "a partial character was sent"


def test_a_character_split_across_tokens_is_held_until_complete(tokenizer, decode):
    emoji = tokenizer("🙂")["input_ids"]
    assert len(emoji) == 4  # four byte tokens
    stream = TextStream(decode, ())
    assert stream.push(tokenizer("ok ")["input_ids"]) == "ok "
    for byte_token in emoji[:-1]:
        assert stream.push([byte_token]) == ""
    assert stream.push(emoji[-1:]) == "🙂"


def test_an_empty_step_sends_nothing(decode):
    stream = TextStream(decode, ())
    assert stream.push([]) == ""
    assert stream.finish("") == ""


@pytest.mark.parametrize(
    ("pieces", "stops", "expected", "why"),
    [
        (["abc ", "ST", "OP", " def"], ("STOP",), "abc ", "the stop string arrives in two tokens"),
        (["abc ", "S", "T", "O", "P"], ("STOP",), "abc ", "one character per token"),
        (["abc S", "TOP"], ("STOP",), "abc ", "the stop string starts inside a token"),
        (["abc ", "ST", "AR", " def"], ("STOP",), "abc STAR def", "a prefix that turns out not to be the stop"),
        (["x ", "EN", "D y ", "ST", "OP"], ("STOP", "END"), "x ", "the earlier of two stop strings"),
        (["日", "本", "ST", "OP"], ("STOP",), "日本", "multi-byte characters before the stop"),
        (["a", "\n\n", "b"], ("\n\n",), "a", "a whitespace stop string"),
    ],
)
def test_a_stop_string_split_across_tokens_is_never_sent(tokenizer, decode, pieces, stops, expected, why):
    ids = ids_of(tokenizer, *pieces)
    final = trim_stop_string(decode(ids), stops)  # what the engine reports as the finished text
    assert final == expected, why
    for chunk_sizes in ([1], [2], [3, 1]):
        stream = TextStream(decode, stops)
        sent = ""
        for delta in run(stream, ids, chunk_sizes):
            sent += delta
            assert expected.startswith(sent), (why, sent)  # never anything the final text does not keep
        assert sent + stream.finish(final) == expected, why


def test_random_texts_with_stop_strings_stream_exactly(tokenizer, decode):
    """Random text over an alphabet that makes near-misses of the stop strings common."""
    rng = random.Random(7)
    alphabet = ["ab", "a", "b", " ", "é", "日", "🙂", "\n", "ST", "O", "P", "STO"]
    stops = ("STOP", "b\n")
    for _ in range(60):
        pieces = [rng.choice(alphabet) for _ in range(rng.randint(1, 25))]
        ids = ids_of(tokenizer, *pieces)
        final = trim_stop_string(decode(ids), stops)
        stream = TextStream(decode, stops)
        sent = ""
        for delta in run(stream, ids, [rng.randint(1, 4)]):
            sent += delta
            assert final.startswith(sent), (pieces, sent)
        assert sent + stream.finish(final) == final, pieces
