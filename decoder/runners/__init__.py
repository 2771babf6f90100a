"""How one model step runs (the glossary's "forward pass"): one interface, one selector.

| runner (`--runner`) | pass | module |
|---|---|---|
| `native` | one call into the C kernel per pass (float32 Llama on an AVX2 CPU) | `native.py` (kernel: decoder/native) |
| `lean` | the model's own modules without transformers' per-call machinery | `lean.py` |
| `invariant` | the lean pass's model in fixed shapes: batch-invariant in any dtype | `invariant.py` |
| `graphs` | fixed-shape buckets, one CUDA graph each (eager elsewhere): batch-invariant in any dtype | `graphed.py` |
| `transformers` | transformers' forward and ``DynamicCache``, any causal LM | `hf.py` |
| `auto` | the first that applies: native, lean, transformers (CPU); graphs, lean, transformers (GPU) | `select.py` |

``select_pass`` (select.py) is the only reader of the runner setting; ``KVPool`` (pool.py) holds a model's
sequences and runs their passes; the Llama passes keep keys and values in ``SlotTensors`` (kv.py). The graphs pass's
parts: its buckets (buckets.py), graph manager (graph_manager.py) and fixed-shape attention (capacity_attention.py).
"""

from decoder.runners.base import ForwardPass, PassNotApplicable, RaggedRows
from decoder.runners.pool import KVPool, PooledSequence
from decoder.runners.select import select_pass

__all__ = ["ForwardPass", "KVPool", "PassNotApplicable", "PooledSequence", "RaggedRows", "select_pass"]
