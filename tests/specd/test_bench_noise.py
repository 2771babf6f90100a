"""`specd bench --noise stall:P:MS`: parsed once, refused in one line naming what is wrong."""

from __future__ import annotations

import pytest

from specd.bench.noise import StallNoise, parse_noise
from specd.cli import build_parser, main


@pytest.mark.parametrize(
    ("text", "says", "why"),
    [
        ("stall:1.5:100", "must be in [0, 1], got 1.5", "a share above 1"),
        ("stall:-0.1:100", "must be in [0, 1], got -0.1", "a negative share"),
        ("stall:x:1", "P must be a number, got 'x'", "not a number"),
        ("stall:0.1:ms", "MS must be a number, got 'ms'", "not a number"),
        ("stall:0.1:-5", "MS must be >= 0, got -5", "a negative stall"),
        ("stall:nan:10", "P must be finite", "nan compares false with every bound"),
        ("stall:0.1", "is not stall:P:MS", "a part missing"),
        ("stall:0.1:1:2", "is not stall:P:MS", "a part too many"),
        ("foo:0.1:1", "unknown noise 'foo'", "the one kind is stall"),
        ("", "unknown noise ''", "empty"),
    ],
)
def test_bad_noise_specs_are_refused_in_one_line(tmp_path, capsys, text, says, why):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--out", str(tmp_path / "out"), "--noise", text])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, why
    assert "argument --noise:" in err and says in err, (why, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_a_good_noise_spec_reaches_the_options():
    args = build_parser().parse_args(["bench", "--out", "x", "--noise", "stall:0.25:150"])
    assert args.noise == StallNoise(0.25, 150.0)
    assert args.noise.worker_setting(seed=3) == {"stall_share": 0.25, "stall_ms": 150.0, "seed": 3}
    assert build_parser().parse_args(["bench", "--out", "x"]).noise is None
    assert parse_noise("stall:0:0") == StallNoise(0.0, 0.0) and parse_noise("stall:1:2.5") == StallNoise(1.0, 2.5)
