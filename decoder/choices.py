"""Names the command line offers, kept free of heavy imports so `specd --help` and the controller's client
commands start without loading torch."""

DRAFTER_NAMES = ("draft", "prompt_lookup", "none")
DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")
RUNNER_NAMES = ("auto", "transformers")
