"""Names the command line offers, kept free of heavy imports so `specd --help` and the controller's client
commands start without loading torch."""

from specd_api.plan import DRAFTER_NAMES

__all__ = ["DRAFTER_NAMES", "DTYPE_NAMES", "RUNNER_NAMES"]

DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")
RUNNER_NAMES = ("auto", "transformers")
