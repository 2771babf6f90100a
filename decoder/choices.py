"""Names the command line offers, kept free of heavy imports so `specd --help` and the controller's client
commands start without loading torch."""

from specd_api.plan import DRAFTER_NAMES

__all__ = ["DRAFTER_NAMES", "DTYPE_NAMES", "MAX_BRANCHES", "RUNNER_NAMES"]

# auto: float32 on a CPU (the native pass then reads bfloat16-exact weights at half the bytes, and computes in
# float32: exact and the fastest there); bfloat16 on a GPU that has it
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16", "float64")
# auto: on a CPU the native pass where it applies (decoder/native), else the lean PyTorch one, else transformers'; on
# a GPU the graphs pass, else lean, else transformers'. native: the native pass or an error; lean: the lean PyTorch
# pass (Llama); invariant: the lean pass in fixed shapes, batch-invariant in any dtype; graphs: fixed-shape buckets
# captured as CUDA graphs on a GPU (an eager stand-in elsewhere), batch-invariant in any dtype; transformers: always
# theirs. decoder.runners.select_pass is the only reader
RUNNER_NAMES = ("auto", "native", "lean", "invariant", "graphs", "transformers")
# prompt lookup's matches one round may verify together as a tree (decoder/drafters/prompt_lookup.py)
MAX_BRANCHES = 8
