"""The decode engine: models, drafters, the round (draft → verify → accept → roll back), the forward passes, and the
worker (``decoder/worker/``) that serves it. docs/ARCHITECTURE.md has the path of a request through it.

Shapes: every shape comment in ``decoder/`` (and in ``distill/``) names its dimensions with these, written
``# [b, n, vocab]``; a module points here instead of declaring its own.

- ``b``: sequences (rows) in one pass or one training batch; ``_i`` names row i's own size (``n_i``, ``t_i``)
- ``n``: the tokens one row runs in a pass (its new tokens; in training, each row's sequence length)
- ``w``: the widest row of a ragged pass (the other rows padded to it)
- ``r``: the real tokens of a pass, all rows together (``sum(n_i)``); ``p``: ``r`` padded to whole tiles
- ``tile``: one tile's rows (the invariant pass's ``TILE``)
- ``t``: a context's length (prompt plus emitted tokens)
- ``k``: the tokens a round drafted (``num_drafted``, at most its K), so verification runs ``k + 1``
- ``end``: the positions a query attends to (the cache up to and including the pass's last token)
- ``vocab``, ``hidden``, ``layers``, ``slots``, ``capacity``: the logits' width, the model's width, its layers, the
  KV pool's sequences and positions per sequence
- ``heads``, ``kv``, ``d``: query heads, key-value heads, head size
- a count of its own with no letter here is spelled out (``num_tokens``, ``num_blocks``, ``prompt_len``)
"""
