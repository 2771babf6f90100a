"""Capped tokenizing (decoder/capped_encoding.py): the ids equal the tokenizer's own under every cut and window, a
prompt past the cap is refused with a lower bound that is a true one, the model and the pre-tokenizer stop near the
cap however long the text, and a tokenizer the module cannot reproduce is tokenized whole."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from decoder.capped_encoding import (
    BATCH_CHARS,
    PART_CHARS,
    WINDOW_CHARS,
    CappedEncoder,
    PromptTooLong,
    TooLong,
    cut_at_hard_boundaries,
)
from decoder.tiny import build_tokenizer

REFERENCE = Path(__file__).resolve().parents[2] / "models" / "reference" / "target"
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def f(x):\n    return x ** 2  # squared\n\n",
    "数据库系统的设计与实现，第二版。日本語のテキスト。",
    "   spaces   and\ttabs\n\n\nnewlines ----==== 12345 67.89",
    "café naïve Zürich emoji 🙂🚀",
] * 20


@pytest.fixture(scope="module")
def reference() -> Any:
    return AutoTokenizer.from_pretrained(REFERENCE, local_files_only=True)


def _trained(model: Any, trainer: Any, **parts: Any) -> PreTrainedTokenizerFast:
    tok = Tokenizer(model)
    for name, value in parts.items():
        setattr(tok, name, value)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def llama2_style() -> PreTrainedTokenizerFast:
    """A sentencepiece-shaped BPE: "▁" for spaces by a normalizer, no pre-tokenizer (a text is one piece), a byte
    fallback for all 256 bytes (so no character is unknown, though unknowns would be fused), a BOS template."""
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens])
    tok = _trained(
        models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True), trainer,
        normalizer=normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
    )  # fmt: skip
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    return tok


def metaspace_first() -> PreTrainedTokenizerFast:
    """A Metaspace pre-tokenizer that marks only the text's first piece: a part after an added token is not marked,
    which the pre-tokenizer cannot be told when it is handed the part alone."""
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    return _trained(
        models.BPE(unk_token="<unk>"), trainer,
        pre_tokenizer=pre_tokenizers.Metaspace(prepend_scheme="first"), decoder=decoders.Metaspace(),
    )  # fmt: skip


def byte_level(ignore_merges: bool = False, add_prefix_space: bool = False) -> PreTrainedTokenizerFast:
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    return _trained(
        models.BPE(ignore_merges=ignore_merges), trainer,
        pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space),
    )  # fmt: skip


TOKENIZERS = {
    "reference": lambda: AutoTokenizer.from_pretrained(REFERENCE, local_files_only=True),
    "tiny": build_tokenizer,
    "llama2-style": llama2_style,
    "prefix-space": lambda: byte_level(add_prefix_space=True),
    "ignore-merges": lambda: byte_level(ignore_merges=True),
}
TEXT = st.lists(
    st.sampled_from([*"ab c\n\t  .-=#的数据日本🙂é1", "<|endoftext|>", "<s>", "</s>", " the", "ing", "    "]),
    max_size=40,
).map("".join)


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tokenizer(request: pytest.FixtureRequest) -> Any:
    return TOKENIZERS[request.param]()


def full(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def test_every_supported_tokenizer_is_capped(tokenizer: Any):
    assert CappedEncoder.of(tokenizer) is not None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT, part_chars=st.integers(1, 6), window=st.integers(1, 12))
def test_the_pieces_equal_the_tokenizers_encoding_under_every_cut_and_window(tokenizer, text, part_chars, window):
    encoder = CappedEncoder.of(tokenizer)
    assert encoder is not None
    used_window = window if encoder.window is not None else None
    assert encoder._uncapped(text, part_chars, used_window) == full(tokenizer, text)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT, cap=st.integers(1, 40))
def test_a_capped_encoding_is_the_encoding_or_a_true_lower_bound_past_the_cap(tokenizer, text, cap):
    encoder = CappedEncoder.of(tokenizer, part_chars=3, window=5)
    assert encoder is not None
    expected = full(tokenizer, text * 3)
    got = encoder.encode(text * 3, cap)
    if len(expected) <= cap:
        assert got == expected
    else:
        assert isinstance(got, TooLong) and cap < got.at_least <= len(expected), (got, len(expected))


def test_a_pre_tokenizer_that_marks_a_texts_start_reads_each_part_whole():
    """A byte-level pre-tokenizer adding a space before each part: a window starting mid-text would get one too."""
    encoder = CappedEncoder.of(byte_level(add_prefix_space=True))
    assert encoder is not None and encoder.window is None
    assert CappedEncoder.of(byte_level()).window is not None


class Counting:
    """Wraps a tokenizer stage, counting the characters handed to it."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.chars = inner, 0

    def pre_tokenize_str(self, text: str) -> Any:
        self.chars += len(text)
        return self.inner.pre_tokenize_str(text)

    def encode_batch(self, inputs: list[Any], **kwargs: Any) -> Any:
        self.chars += sum(len(x) if isinstance(x, str) else sum(map(len, x)) for x in inputs)
        return self.inner.encode_batch(inputs, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Stages:
    """The characters the model is handed (alone, or after the pre-tokenizer) and the pre-tokenizer alone."""

    def __init__(self, encoder: CappedEncoder) -> None:
        self.alone, self.pipeline = Counting(encoder._model_only), Counting(encoder._pipeline)
        self.pre = Counting(encoder._pre_tokenizer)
        encoder._model_only, encoder._pipeline, encoder._pre_tokenizer = self.alone, self.pipeline, self.pre

    @property
    def model(self) -> int:
        return self.alone.chars + self.pipeline.chars


_RNG = random.Random(0)
CJK = "".join(chr(_RNG.randint(0x4E00, 0x9FFF)) for _ in range(60_000))
PROSE = ("The quick brown fox jumps over the lazy dog; 1234 pack my box. " * 4_000)[:200_000]


@pytest.mark.parametrize("text", [CJK, PROSE], ids=["cjk", "prose"])
@pytest.mark.parametrize("cap", [300, 4_096])
def test_the_work_stops_near_the_cap_however_long_the_prompt(reference, text, cap):
    """One random-CJK run is a single pre-token of 180,000 byte characters; prose is 200,000 characters of short
    pieces. The model sees about as many characters as the cap's tokens span, the pre-tokenizer a window or two
    past them (the run: the whole, read once and 1/8 more)."""
    encoder = CappedEncoder.of(reference)
    assert encoder is not None
    stages = Stages(encoder)
    got = encoder.encode(text, cap)
    assert isinstance(got, TooLong) and got.at_least > cap
    ids = full(reference, text)
    assert len(ids) > 10 * cap
    spanned = len(reference.decode(ids[: cap + 1]))  # characters of text the first cap + 1 tokens hold
    mapped = len(text.encode("utf-8")) / len(text)  # byte characters per text character
    assert stages.model <= mapped * spanned + BATCH_CHARS + PART_CHARS + WINDOW_CHARS, (stages.model, spanned)
    assert stages.model < len(text.encode("utf-8")) / 4, stages.model  # the whole, in byte characters
    read = stages.pre.chars + stages.pipeline.chars  # the pre-tokenizer runs alone, or ahead of the model
    if text is PROSE:
        assert read <= spanned + 3 * WINDOW_CHARS, (read, spanned)
    else:
        assert read <= 1.25 * len(text), read


def test_a_prompt_within_its_cap_is_tokenized_in_one_call(reference):
    encoder = CappedEncoder.of(reference)
    assert encoder is not None
    stages = Stages(encoder)
    assert encoder.encode(PROSE[:1_000], 1_001) == full(reference, PROSE[:1_000])  # 1,000 bytes and one mark
    assert stages.model == stages.pre.chars == 0


def test_hard_boundaries_cut_only_where_no_entry_spans():
    pairs = frozenset({"ab", "bc"})
    assert list(cut_at_hard_boundaries("abcabcxyz", pairs, 2)) == ["abc", "abc", "xy", "z"]
    assert list(cut_at_hard_boundaries("abcabc", pairs, 1)) == ["abc", "abc"]
    assert list(cut_at_hard_boundaries("abababab", frozenset({"ab", "ba"}), 2)) == ["abababab"]
    assert "".join(cut_at_hard_boundaries("xyzxyzxyz", pairs, 4)) == "xyzxyzxyz"


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: _trained(models.WordPiece(unk_token="<unk>"), trainers.WordPieceTrainer(vocab_size=200,
                          special_tokens=["<unk>"]), pre_tokenizer=pre_tokenizers.Whitespace()), "WordPiece"),
        (lambda: _trained(models.BPE(dropout=0.5, unk_token="<unk>"), trainers.BpeTrainer(vocab_size=200,
                          special_tokens=["<unk>"])), "dropout"),
        (lambda: _trained(models.BPE(unk_token="<unk>", fuse_unk=True), trainers.BpeTrainer(vocab_size=200,
                          special_tokens=["<unk>"])), "fuses unknown"),
        (lambda: _trained(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True),
                          trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"])), "fuses unknown"),
        (metaspace_first, "is not reproduced"),
    ],
    ids=["wordpiece", "dropout", "fused-unknowns", "fused-unknowns-some-bytes-missing", "metaspace-first"],
)  # fmt: skip
def test_a_tokenizer_it_cannot_reproduce_is_tokenized_whole(make, reason, caplog):
    with caplog.at_level("INFO", logger="specd.decoder.tokenizing"):
        assert CappedEncoder.of(make()) is None
    assert reason in caplog.text


def test_an_added_token_that_strips_spaces_is_tokenized_whole():
    tok = byte_level()
    tok.add_tokens([AddedToken("<mark>", lstrip=True)])
    assert CappedEncoder.of(tok) is None


def test_the_engine_refuses_past_the_cap_with_or_without_the_capped_path(reference, monkeypatch):
    from decoder.engine import SpeculativeDecoder

    engine = SpeculativeDecoder.__new__(SpeculativeDecoder)
    engine.target = type("Target", (), {"tokenizer": reference})()
    text = PROSE[:5_000]
    n = len(full(reference, text))
    assert engine.encode(text, n) == full(reference, text) == engine.encode(text)
    with pytest.raises(PromptTooLong) as refused:
        engine.encode(text, n - 1)
    assert refused.value.cap == n - 1 and refused.value.at_least >= n
    engine.__dict__["_capped"] = None  # a tokenizer tokenized whole
    with pytest.raises(PromptTooLong) as whole:
        engine.encode(text, n - 1)
    assert whole.value.at_least == n


def test_the_benchmark_compares_both_on_each_text_and_cap(tmp_path):
    from benchmarks.capped_tokenizing import main

    out = tmp_path / "capped.json"
    assert main(["--chars", "20000", "--caps", "300,1000", "--runs", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["text"], r["cap"]) for r in rows] == [("cjk", 300), ("cjk", 1000), ("prose", 300), ("prose", 1000)]
    for row in rows:
        assert row["tokens"] > row["cap"] < row["counted_at_refusal"]
        assert row["ratio_min"] <= row["whole_over_capped"] <= row["ratio_max"]
