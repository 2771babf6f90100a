"""`specd distill`: train a draft to match its target's next-token distribution (KL on the target's logits).

Training, beside ``refmodels/`` (which pretrains the reference pair) and on top of the engine: it loads models and
measures α with ``decoder``; nothing in ``decoder`` imports it.
Shape comments use the engine's one notation (``decoder/__init__.py``: ``b`` rows, ``n`` tokens per row).

Files by job: ``schedules`` (the learning-rate schedule both trainers use, ``refmodels/train.py`` too),
``config`` (the validated run settings), ``data`` (documents, split, packing), ``batches`` (what each step trains
on), ``loss`` (KL and agreement), ``models`` (target, draft, saving), ``trainer`` (the loop), ``checkpoint``,
``evaluate`` (α, KL, agreement on held-out text), ``report``, ``progress``, ``pipeline`` (one run end to end) and
``cli``.
"""
