"""`specd distill`: train a draft to match its target's next-token distribution (KL on the target's logits).

Files by job: ``config`` (the validated run settings), ``data`` (documents, split, packing), ``batches`` (what
each step trains on), ``loss`` (KL and agreement), ``models`` (target, draft, saving), ``trainer`` (the loop),
``checkpoint``, ``evaluate`` (α, KL, agreement on held-out text), ``report``, ``progress``, ``pipeline`` (one
run end to end) and ``cli``.
"""
