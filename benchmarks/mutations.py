"""The mutation check: plant named single-line bugs in core logic and see whether the tests notice.

Each mutation replaces one exact line fragment in one file of a temporary copy of the repository, then runs the tests
that guard that logic against the copy's code (``PYTHONPATH`` points at the copy, so the editable install of the
checkout is not what gets imported). A mutation is *caught* when a test fails, *missed* when they all pass. A
mutation whose original fragment is no longer found (or found twice) is *stale*: the code moved, and the list here
must follow it. Before any mutation, the same tests run on the unmutated copy and must pass, or nothing could be
told.

    python benchmarks/mutations.py                 # every mutation
    python benchmarks/mutations.py --only bonus-token-position --only residual
    python benchmarks/mutations.py --list
    python benchmarks/mutations.py --json out.json

The last line of the output is ``mutations: N caught, M missed`` (and ``, S stale`` when any are; ``, K skipped`` for
mutations of a native build this CPU cannot run, whose tests skip here). The exit status is 0 when every mutation was
caught or skipped, 1 when one was missed or stale, 2 when the baseline failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Big or machine-local paths the copy links to instead of copying (read-only for the tests).
LINKED = ("models",)
IGNORED = (".git", ".venv", ".cache", ".mypy_cache", ".ruff_cache", ".pytest_cache", "__pycache__", "*.egg-info",
           "dist", "build", ".gpu", *LINKED)  # fmt: skip
TIMEOUT_S = 900


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    original: str  # must occur exactly once in the file
    mutant: str
    tests: tuple[str, ...]  # pytest node ids or files, relative to the repository root
    why: str  # the bug it stands for
    cpu_flags: frozenset[str] = frozenset()  # what the CPU must report for its tests to run (else: skipped)


DISTRIBUTION = ("tests/decoder/test_distribution.py", "tests/decoder/test_batch_distribution.py")
GREEDY = ("tests/decoder/test_exactness.py", "tests/decoder/test_independent_reference.py")
# tests/worker/test_costs.py guards the cost path too, but it times real passes: it belongs on a quiet machine, and
# this check must give the same verdicts on a busy one.
COSTS = ("tests/controller/test_simulation.py", "tests/controller/test_decide.py")
ROBUST = ("tests/controller/test_robust_costs.py",)
NATIVE = ("tests/decoder/test_native.py",)
TABLES = "tests/controller/test_decision_tables.py"
EPOCHS = "tests/controller/test_table_epochs.py"
TREE = ("tests/decoder/test_tree.py",)
TREE_PASS = ("tests/decoder/test_tree_pass.py",)
TREE_ROUNDS = ("tests/decoder/test_tree_rounds.py",)
FEATURES = ("tests/decoder/test_feature_tap.py",)
EAGLE = ("tests/decoder/test_eagle.py",)
HEAD_TRAINING = ("tests/distill/test_head_training.py",)
BF16_DOT = frozenset({"avx512_bf16", "avx512bw", "avx512vl"})  # the avx512bf16 build's tests skip without these

MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "residual",
        "decoder/acceptance.py",
        "residual = (p - q).clamp_min(0.0)",
        "residual = p.clamp_min(0.0)",
        DISTRIBUTION,
        "after a rejection, sample from p instead of norm(max(0, p - q))",
    ),
    Mutation(
        "bonus-token-position",
        "decoder/acceptance.py",
        "next_probs = target_probs[k]  #",
        "next_probs = target_probs[k - 1]  #",
        DISTRIBUTION,
        "after a fully accepted round, the bonus token is drawn from p at position K-1 instead of K",
    ),
    Mutation(
        "greedy-accepts-one-extra",
        "decoder/acceptance.py",
        "num_accepted = int(mismatch[0, 0]) if mismatch.numel() else k",
        "num_accepted = min(int(mismatch[0, 0]) + 1, k) if mismatch.numel() else k",
        GREEDY,
        "greedy keeps the first mismatching draft token too",
    ),
    Mutation(
        "tree-row-sees-the-row-before",
        "decoder/tree.py",
        "sees[node + 1] |= sees[parent + 1]",
        "sees[node + 1] |= sees[node]",
        TREE,
        "a tree's row sees the row before it (a chain's mask) instead of its parent's: siblings see each other",
    ),
    Mutation(
        "tree-path-through-the-node-before",
        "decoder/tree.py",
        "paths.append((*(paths[parent] if parent != ROOT else ()), node))",
        "paths.append((*(paths[node - 1] if parent != ROOT else ()), node))",
        (*TREE, *TREE_PASS),
        "a tree node's path runs through the node before it, not its parent",
    ),
    Mutation(
        "tree-position-by-index",
        "decoder/tree.py",
        "root_position + len(p) for p in self._paths",
        "root_position + 1 + i for i, p in enumerate(self._paths)",
        TREE,
        "a tree's node is placed at its index below the root, not at its depth",
    ),
    Mutation(
        "tree-kept-rows-off-by-one",
        "decoder/tree.py",
        "return [0, *(step + 1 for step in path)]",
        "return [0, *(step for step in path)]",
        TREE,
        "the accepted path keeps the cache rows of the node before each accepted one",
    ),
    Mutation(
        "tree-greedy-takes-the-first-child",
        "decoder/tree.py",
        "(child for child in tree.children(node) if tree.tokens[child] == wanted)",
        "(child for child in tree.children(node))",
        TREE,
        "greedy goes down the first child whatever the target's argmax",
    ),
    Mutation(
        "tree-sampling-reads-the-roots-row",
        "decoder/tree.py",
        "residual = target_probs[node + 1]",
        "residual = target_probs[0]",
        TREE,
        "every node's children are tested against the target's distribution at the root",
    ),
    Mutation(
        "tree-sampling-ignores-q",
        "decoder/tree.py",
        "if u * q_token < float(residual[token]):",
        "if u < float(residual[token]):",
        TREE,
        "a child drawn from q is kept with probability r(x), not min(1, r(x) / q(x))",
    ),
    Mutation(
        "tree-residual-restarts-per-sibling",
        "decoder/tree.py",
        "residual = residual_distribution(residual, q, token)",
        "residual = residual_distribution(target_probs[node + 1], q, token)",
        TREE,
        "after a second rejected sibling the residual forgets the first: a rejected token gets its mass back",
    ),
    Mutation(
        "tree-parent-may-follow-its-child",
        "decoder/tree.py",
        "if not ROOT <= parent < node:",
        "if not ROOT <= parent <= node:",
        TREE,
        "a node may name itself as its parent",
    ),
    Mutation(
        "tree-lean-rows-at-their-entries",
        "decoder/runners/lean.py",
        "positions, mask, causal = tree.positions(start, x.device)[None],",
        "positions, mask, causal = torch.arange(start, end, device=x.device)[None],",
        TREE_PASS,
        "the lean pass places a tree's tokens at their cache entries, not at the root's position plus their depth",
    ),
    Mutation(
        "tree-lean-one-row-causal",
        "decoder/runners/lean.py",
        "tree.positions(start, x.device)[None], tree.visible(start, x.device), False",
        "tree.positions(start, x.device)[None], torch.ones(n, end, dtype=torch.bool).tril(start), False",
        TREE_PASS,
        "the lean pass lets a tree's tokens see every earlier row (a chain's mask): siblings see each other",
    ),
    Mutation(
        "tree-lean-ragged-causal",
        "decoder/runners/lean.py",
        "mask[row, 0, :n, first : first + n] = tree.attention_mask(device)",
        "pass",
        TREE_PASS,
        "in a ragged pass a tree's rows keep the chain's mask",
    ),
    Mutation(
        "tree-lean-ragged-positions",
        "decoder/runners/lean.py",
        "positions[row, :n] = tree.positions(first, device)",
        "pass",
        TREE_PASS,
        "in a ragged pass a tree's rows keep their cache entries as positions",
    ),
    Mutation(
        "tree-transformers-positions",
        "decoder/runners/hf.py",
        '"position_ids": tree.positions(start, self.device)[None],',
        "",
        TREE_PASS,
        "transformers' pass gives a tree's tokens the positions of consecutive entries",
    ),
    Mutation(
        "tree-keep-forgets-the-root-entry",
        "decoder/runners/kv.py",
        "source = torch.tensor(rows, device=self.device) + start",
        "source = torch.tensor(rows, device=self.device)",
        TREE_PASS,
        "keeping a path copies entries counted from the slot's start, not from the tree's root",
    ),
    Mutation(
        "tree-transformers-keep-forgets-the-root-entry",
        "decoder/runners/hf.py",
        "source = torch.tensor(rows, device=layer.keys.device) + start",
        "source = torch.tensor(rows, device=layer.keys.device)",
        TREE_PASS,
        "transformers' caches keep a path counted from the slot's start, not from the tree's root",
    ),
    Mutation(
        "tree-keep-leaves-the-whole-tree",
        "decoder/runners/pool.py",
        "self.pool.lengths[self.slot] = root_entry + len(rows)",
        "self.pool.lengths[self.slot] = root_entry + rows[-1] + 1",
        TREE_PASS,
        "after keeping a path the slot's length still covers the rows of the branches beside it",
    ),
    Mutation(
        "tree-native-root-unseen",
        "decoder/native/llama_step.c",
        "x->ctx = start + 1;",
        "x->ctx = start;",
        TREE_PASS,
        "the native kernel's tree rows do not see the root's entry",
    ),
    Mutation(
        "tree-native-positions-by-entry",
        "decoder/native/llama_step.c",
        "x->pos = start + depth[t];",
        "x->pos = start + i;",
        TREE_PASS,
        "the native kernel places a tree's tokens at their entries, not at their depths",
    ),
    Mutation(
        "tree-native-path-of-the-row-before",
        "decoder/native/llama_step.c",
        "for (int64_t at = i, j = depth[t] - 1; j >= 0; at = parents[t - i + at], j--)",
        "for (int64_t at = i, j = depth[t] - 1; j >= 0; at = at - 1, j--)",
        TREE_PASS,
        "the native kernel's tree row sees the rows just before it (a chain's) instead of its ancestors",
    ),
    Mutation(
        "tree-offered-counts-the-path-only",
        "decoder/tree.py",
        "return len(path) + bool(tree.children(path[-1] if path else ROOT))",
        "return len(path)",
        TREE,
        "a tree round's verified positions leave out the rejected children below the path's last node",
    ),
    Mutation(
        "tree-branches-never-merge",
        "decoder/tree.py",
        "child = below.get((node, token))",
        "child = None",
        TREE_ROUNDS,
        "prompt lookup's matches are not merged where they share a prefix: siblings repeat a token",
    ),
    Mutation(
        "tree-lookup-keeps-one-match-per-ngram",
        "decoder/drafters/prompt_lookup.py",
        "del starts[self.config.branches :]",
        "del starts[1:]",
        TREE_ROUNDS,
        "prompt lookup remembers only the latest match of an n-gram: no tree from one n-gram's matches",
    ),
    Mutation(
        "lean-taps-after-the-layer",
        "decoder/runners/lean.py",
        "tapped[i] = x[0]  # [n, hidden] the states entering layer i",
        "tapped[i] = layer.input_layernorm(x)[0]  # [n, hidden] the states entering layer i",
        FEATURES,
        "a one-row lean pass hands the layer's normed input, not the states entering it",
    ),
    Mutation(
        "ragged-lean-taps-padding",
        "decoder/runners/lean.py",
        "rows.tap.fill([states[row, :n] for row, n in enumerate(counts)])",
        "rows.tap.fill([states[row, -n:] for row, n in enumerate(counts)])",
        FEATURES,
        "a ragged lean pass hands a short row its padding's states",
    ),
    Mutation(
        "invariant-taps-the-wrong-layer",
        "decoder/runners/invariant.py",
        "tapped[i] = x[:real]  # [r, hidden] the states entering layer i",
        "tapped[i + 1] = x[:real]  # [r, hidden] the states entering layer i",
        FEATURES,
        "the invariant pass numbers its states one layer off (vLLM's numbering broken)",
    ),
    Mutation(
        "native-taps-into-the-wrong-slot",
        "decoder/native/llama_step.c",
        "memcpy(tap->out + ((int64_t)t * tap->count + j) * hidden,",
        "memcpy(tap->out + ((int64_t)t * tap->count + (tap->count - 1 - j)) * hidden,",
        FEATURES,
        "the kernel writes the tapped layers side by side in reverse order",
    ),
    Mutation(
        "transformers-taps-after-the-norm",
        "decoder/runners/hf.py",
        "torch.cat([out.hidden_states[layer][0] for layer in rows.tap.layers], dim=-1)",
        "torch.cat([out.hidden_states[layer + 1][0] for layer in rows.tap.layers], dim=-1)",
        FEATURES,
        "transformers' pass hands the states one layer later than asked",
    ),
    Mutation(
        "pool-taps-a-layer-past-the-model",
        "decoder/runners/pool.py",
        "any(not 0 <= layer < layers for layer in tap.layers)",
        "any(not 0 <= layer <= layers for layer in tap.layers)",
        FEATURES,
        "a tap of a layer past the model's last is passed to the pass",
    ),
    Mutation(
        "eagle-observes-the-bonus-row",
        "decoder/engine.py",
        "rows = range(verdict.num_accepted + 1) if draft.tree is None",
        "rows = range(verdict.num_accepted + 2) if draft.tree is None",
        EAGLE,
        "the head is handed the states of a rejected draft token's row as an accepted one's",
    ),
    Mutation(
        "eagle-misses-the-roots-states",
        "decoder/engine.py",
        "            self.drafter.observe(states[list(rows)])",
        "            self.drafter.observe(states[list(rows)][1:])",
        EAGLE,
        "the head is not handed the states of the round's first token (the last round's bonus)",
    ),
    Mutation(
        "eagle-skips-the-prompts-states",
        "decoder/engine.py",
        "            self.drafter.observe(tap.rows[0])  # every prompt token's states",
        "            pass",
        EAGLE,
        "the head starts with no states of the prompt",
    ),
    Mutation(
        "eagle-keeps-its-drafted-entries",
        "decoder/drafters/eagle.py",
        "self.fed = min(self.fed, self.known)",
        "self.fed = self.known",
        EAGLE,
        "rollback keeps the entries built from the head's own output as if the target's states built them",
    ),
    Mutation(
        "eagle-feeds-its-entries-from-the-wrong-token",
        "decoder/drafters/eagle.py",
        "out, logits = self.runner.feed(self._states[start : t - 1], context[start + 1 : t].to(device))",
        "out, logits = self.runner.feed(self._states[start : t - 1], context[start : t - 1].to(device))",
        EAGLE + HEAD_TRAINING,
        "entry p joins token p's states with token p instead of token p + 1",
    ),
    Mutation(
        "eagle-drafts-from-the-normed-output",
        "decoder/drafters/eagle.py",
        "                out, logits = self.runner.step(out, token.to(device))",
        "                out, logits = self.runner.step(self.head.norm(out), token.to(device))",
        EAGLE + HEAD_TRAINING,
        "drafting feeds back the head's normed output, not its layer's output",
    ),
    Mutation(
        "native-head-skips-the-fc-bias",
        "decoder/native/llama_step.c",
        "for (int i = 0; i < hidden; i++) residual[(int64_t)t * hidden + i] += m->fc_bias[i];",
        "for (int i = 0; i < hidden; i++) residual[(int64_t)t * hidden + i] += 0.0f;",
        EAGLE,
        "the native head projects the target's states without fc's bias",
    ),
    Mutation(
        "native-head-attends-one-entry-short",
        "decoder/native/llama_step.c",
        "m->keys + base, m->values + base, start + t + 1,",
        "m->keys + base, m->values + base, start + t,",
        EAGLE,
        "the native head's entry does not see itself",
    ),
    Mutation(
        "native-head-ignores-norm-before-residual",
        "decoder/native/llama_step.c",
        "if (m->norm_before_residual) memcpy(res, row + hidden, sizeof(float) * hidden);",
        "(void)res;",
        EAGLE,
        "a head trained with norm_before_residual runs natively with the un-normed residual",
    ),
    Mutation(
        "native-head-keeps-stale-weights",
        "decoder/heads/runner.py",
        "if held is None or held[0] != signature:",
        "if held is None:",
        EAGLE,
        "a head whose weights changed (in training) drafts from its first packed copy",
    ),
    Mutation(
        "segment-view-offers-every-drafter",
        "controller/decision/core.py",
        "return tuple(d for d in DRAFTERS if d in self._offered) or tuple(d for d in DRAFTERS if not runs_head(d))",
        "return DRAFTERS",
        ("tests/controller/test_offered_drafters.py",),
        "a segment's view decides among drafters no worker offered (eagle without a head)",
    ),
    Mutation(
        "native-head-keeps-its-first-cache",
        "decoder/heads/runner.py",
        "            self.cache.reserve(needed)\n            self._bind()",
        "            self.cache.reserve(needed)",
        EAGLE,
        "the kernel keeps writing into the head's first cache after it grew",
    ),
    Mutation(
        "head-maps-draft-ids-unshifted",
        "decoder/heads/model.py",
        "return torch.arange(self.shape.draft_vocab, device=self.d2t.device) + self.d2t",
        "return torch.arange(self.shape.draft_vocab, device=self.d2t.device)",
        EAGLE + HEAD_TRAINING,
        "the head's draft vocabulary maps onto the target's first ids, not its own (d2t ignored)",
    ),
    Mutation(
        "head-refused-by-nothing",
        "decoder/heads/layout.py",
        "    if wanted != have:",
        "    if False:",
        EAGLE,
        "a head trained for another verifier loads",
    ),
    Mutation(
        "ttt-step-sees-its-own-position",
        "distill/head_training.py",
        "visible = entry[None, :] <= entry[:, None] - step",
        "visible = entry[None, :] <= entry[:, None]",
        HEAD_TRAINING,
        "training-time test lets drafting step s see the target's states up to its own position",
    ),
    Mutation(
        "ttt-feeds-the-same-entry",
        "distill/head_training.py",
        "fused = shift(out, 1, dim=1)  # step s + 1's entry p reads this step's p - 1",
        "fused = out",
        HEAD_TRAINING,
        "training-time test feeds entry p its own output, not the previous entry's",
    ),
    Mutation(
        "head-loss-counts-unreached-entries",
        "distill/head_training.py",
        "per_entry = (p * (p_log - q_log)).sum(-1)[:, step:]  # [b, m - step]",
        "per_entry = (p * (p_log - q_log)).sum(-1)  # [b, m - step]",
        HEAD_TRAINING,
        "the loss of step s counts entries it has no drafting chain for",
    ),
    Mutation(
        "tree-round-rolled-back-as-a-chain",
        "decoder/engine.py",
        "self.target.keep_path(length - 1, draft.tree.kept_rows(path.path))",
        "self.target.truncate(length + verdict.num_accepted)",
        TREE_ROUNDS,
        "a tree round keeps the cache's first entries, not its accepted path's",
    ),
    Mutation(
        "tree-batch-verified-as-chains",
        "decoder/batch_engine.py",
        "logits = self.target_pool.forward_many(rows, trees=[d.tree for d in drafts], tap=tap)",
        "logits = self.target_pool.forward_many(rows, tap=tap)",
        TREE_ROUNDS,
        "the batch engine verifies a tree's nodes as one chain",
    ),
    Mutation(
        "tree-round-accepted-as-a-chain",
        "decoder/engine.py",
        "        if draft.tree is None:\n            verdict = self._accept(",
        "        if True:\n            verdict = self._accept(",
        TREE_ROUNDS,
        "a tree round's nodes are accepted as one chain's prefix",
    ),
    Mutation(
        "tree-invariant-path-of-the-row-before",
        "decoder/runners/invariant.py",
        "tuple(start + 1 + m for m in tree.path_to(node))",
        "tuple(start + 1 + m for m in range(len(tree.path_to(node))))",
        TREE_PASS,
        "the invariant pass's tree token sees the rows just before it (a chain's), not its ancestors'",
    ),
    Mutation(
        "tree-invariant-writes-at-positions",
        "decoder/runners/invariant.py",
        "entry_index = torch.tensor(entry_of, device=device)",
        "entry_index = torch.tensor(position_of, device=device)",
        TREE_PASS,
        "the invariant pass writes a tree's keys and values at their positions: siblings overwrite each other",
    ),
    Mutation(
        "tree-chain-pass-takes-a-tree",
        "decoder/runners/pool.py",
        "if not self.forward_pass.trees:",
        "if False:",
        TREE_PASS,
        "a pass that runs chains only is given a tree's rows and verifies them as a chain",
    ),
    Mutation(
        "draft-rollback-stale-token",
        "decoder/drafters/draft_model.py",
        "self.seq.truncate(keep)",
        "self.seq.truncate(min(keep + 1, self.seq.length))",
        ("tests/decoder/test_kv_rollback.py", *GREEDY),
        "the draft's KV cache keeps the entry of one rejected token after a rollback (output stays exact; only a "
        "test of the cache itself can see it)",
    ),
    Mutation(
        "batch-threshold-strict",
        "specd_api/plan.py",
        "return batch_size <= max_batch_size",
        "return batch_size < max_batch_size",
        ("tests/specd_api/test_plan.py", "tests/specd_api/test_round_policy.py", "tests/controller/test_service.py"),
        "speculation switched off at max_batch_size instead of above it",
    ),
    Mutation(
        "batch-threshold-from-the-worker",
        "specd_api/plan.py",
        "    if plan.max_batch_size is None:\n        plan = replace(plan, max_batch_size=max_batch_size)",
        "    plan = replace(plan, max_batch_size=max_batch_size)",
        ("tests/specd_api/test_plan.py", "tests/worker/test_scheduler.py"),
        "the worker's speculation_max_batch overrides the policy's batch threshold carried in the plan (two "
        "thresholds again: a policy lower than the worker's is not applied as the batch grows)",
    ),
    Mutation(
        "dedup-off",
        "controller/storage/store.py",
        "if redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) == false then",
        "if false then",
        ("tests/controller/test_store.py",),
        "a retried report (same report_id) is counted again",
    ),
    Mutation(
        "dedup-ttl-1s",
        "controller/storage/store.py",
        "if redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) == false then",
        "if redis.call('SET', KEYS[1], '1', 'NX', 'EX', 1) == false then",
        ("tests/controller/test_store.py",),
        "the dedup marker expires after 1 s, so a retry after a short outage counts twice",
    ),
    Mutation(
        "learned-c-x2.5",
        "controller/decision/cost_model.py",
        "c = pick(t) / t0",
        "c = 2.5 * pick(t) / t0",
        COSTS,
        "the learned draft cost ratio c is 2.5 times what the worker measured",
    ),
    Mutation(
        "verify-slope-ignored",
        "controller/decision/cost_model.py",
        "points = {0: 1.0} | {n: t / t0 for n, t in seconds.items()}",
        "points = {0: 1.0} | {n: 1.0 for n, t in seconds.items()}",
        COSTS,
        "v(n) is taken as 1 whatever verifying n drafts cost",
    ),
    Mutation(
        "costs-mean-of-sums",
        "controller/decision/cost_model.py",
        "if total(hist) >= MIN_REQUESTS:\n            verify[n], rounds[n] = dict(hist), r",
        "if False:\n            verify[n], rounds[n] = dict(hist), r",
        ROBUST,
        "v(n) is the mean of summed timings again, so one stalled request sets it",
    ),
    Mutation(
        "extrapolate-at-gpu-slope",
        "controller/decision/cost_model.py",
        "slope = max((points[largest] - points[0]) / largest, DEFAULT_VERIFY_SLOPE) if largest else "
        "DEFAULT_VERIFY_SLOPE",
        "slope = DEFAULT_VERIFY_SLOPE",
        ROBUST,
        "a K longer than any measured is priced at the GPU's slope, so long K look almost free on a CPU",
    ),
    Mutation(
        "verify-table-toward-the-largest",
        "controller/decision/cost_model.py",
        "            hi = measured[i + 1]",
        "            hi = measured[-1]",
        ROBUST,
        "v(n) between measured points is drawn toward the largest measured n, not the nearest one above",
    ),
    Mutation(
        "probe-draws-ignore-the-drawn-c",
        "controller/decision/decide.py",
        "                drawn[d] = best_arm(estimate, rates, *bounds[d], drawn_costs, c)",
        "                drawn[d] = best_arm(estimate, rates, *bounds[d], drawn_costs)",
        (*ROBUST, *COSTS),
        "a draw of the costs moves v(n) but not the drafter's c: a cost measured by few requests is taken as certain",
    ),
    Mutation(
        "cost-draw-is-a-point",
        "controller/decision/cost_model.py",
        "        if self.timings is None:\n            return self",
        "        if True:\n            return self",
        ROBUST,
        "exploration draws α but takes the costs as certain, so no draw can overturn a cost",
    ),
    Mutation(
        "posterior-drawn-every-decide",
        "controller/decision/decide.py",
        "    if gate < settings.exploration_rate:",
        "    if draws() and gate < settings.exploration_rate:",
        ("tests/controller/test_decide.py",),
        "every Decide draws the posterior and the costs, though only exploration_rate of them can use the draw",
    ),
    Mutation(
        "mean-arm-kept-across-cost-models",
        "controller/decision/decide.py",
        "    key = (k_min, k_max, costs.verify_table(k_max))",
        "    key = (k_min, k_max)",
        ("tests/controller/test_decide.py",),
        "a cached estimate keeps the K it chose under the old v(n) after a refresh moved the cost model",
    ),
    Mutation(
        "rates-fast-path-passes-nan",
        "specd_api/speedup.py",
        "and math.isfinite(sum(head))",
        "and True",
        ("tests/specd_api/test_speedup.py",),
        "a rate list within [0, 1] but for a NaN skips the clamp: the NaN reaches the curve, and every K ties",
    ),
    Mutation(
        "probe-floor-off",
        "controller/decision/decide.py",
        "if exploit.speculates and floor_rate > 0:",
        "if False:",
        ROBUST,
        "a drafter the segment settled against is never probed again",
    ),
    Mutation(
        "realised-ignores-drafting",
        "controller/decision/counts.py",
        "tokens, seconds = self.tokens_emitted, self.draft_seconds + self.verify_seconds",
        "tokens, seconds = self.tokens_emitted, self.verify_seconds",
        ROBUST,
        "calibration reads a request's realised speedup without its drafting time",
    ),
    Mutation(
        "wrong-type-bucket-stops-all",
        "controller/storage/store.py",
        "pipe.execute(raise_on_error=False)",
        "pipe.execute()",
        ("tests/controller/test_stored_data.py",),
        "one segment's bucket of the wrong Redis type stops learning for every segment",
    ),
    Mutation(
        "corrupt-position-read",
        "controller/storage/redis_schema.py",
        "if 0 <= i < MAX_K else None",
        "if 0 <= i else None",
        ("tests/controller/test_stored_data.py",),
        "a stored field naming draft position 3,000,000 sizes every table read from it",
    ),
    Mutation(
        "unreadable-prior-raises",
        "controller/storage/store.py",
        '        if not isinstance(document, dict):\n            self.skipped.add(key, "not a JSON object")\n'
        "            return None",
        "        if not isinstance(document, dict):\n            raise ValueError(key)",
        ("tests/controller/test_stored_data.py",),
        "a stored prior that is not a JSON object stops the controller (a crash loop under systemd)",
    ),
    Mutation(
        "client-segments-unbudgeted",
        "decoder/worker/client_segments.py",
        "            if bounds.max_names and (",
        "            if False and (",
        ("tests/worker/test_client_segments.py",),
        "a client naming a new segment per request fills the controller's segment cap: later new segments learn "
        "only as _overflow for an hour",
    ),
    Mutation(
        "client-segments-one-host-takes-all",
        "decoder/worker/client_segments.py",
        "if bounds.max_names and (free <= kept or mine >= bounds.max_names_per_host):",
        "if bounds.max_names and free <= kept:",
        ("tests/worker/test_client_segments.py",),
        "one client's flood of names takes every place this worker holds: other clients' new names get none",
    ),
    Mutation(
        "client-segments-never-given-back",
        "decoder/worker/client_segments.py",
        "            if now - last < self.bounds.window_seconds:",
        "            if True:",
        ("tests/worker/test_client_segments.py",),
        "a client-named segment nobody names any more keeps its place for good: new names get none",
    ),
    Mutation(
        "client-segment-names-unchecked",
        "decoder/worker/client_segments.py",
        "        if name not in self._always and not self._names.fullmatch(name):",
        "        if not name:",
        ("tests/worker/test_client_segments.py",),
        "client_segments.names is read but never applied: any name a client makes up is taken",
    ),
    Mutation(
        "skipped-entries-not-on-metrics",
        "controller/serving/metrics_endpoint.py",
        "value=self.controller.learner.store.skipped.count)",
        "value=0)",
        (
            "tests/controller/test_metrics_endpoint.py::test_stored_entries_the_controller_skips_are_counted_and_logged_once",
        ),
        "stored entries the controller skips are logged but never counted where an operator's alerts look",
    ),
    Mutation(
        "report-fails-on-a-wrong-type-cost-bucket",
        "controller/storage/store.py",
        "claim(KEYS[3], 'hash')\n",
        "",
        ("tests/controller/test_stored_data.py::test_reports_over_keys_of_the_wrong_type_are_stored_not_journaled",),
        "one cost bucket of another type fails every report with WRONGTYPE: all journaled, every Decide stale",
    ),
    Mutation(
        "report-fails-on-a-field-of-no-number",
        "controller/storage/store.py",
        "  local sum = redis.pcall('HINCRBYFLOAT', key, field, increment)",
        "  local sum = redis.call('HINCRBYFLOAT', key, field, increment)",
        ("tests/controller/test_fuzz_stored.py",),
        "a field holding no number fails its segment's part after the dedup marker is set: the part is lost, its "
        "retry a duplicate",
    ),
    Mutation(
        "secret-file-read-blocking",
        "specd_api/security.py",
        "        data = read_regular_file(path, MAX_FILE_BYTES + 1)",
        "        data = path.read_bytes()[: MAX_FILE_BYTES + 1]",
        ("tests/controller/test_auth.py::test_bad_security_settings_name_file_line_field_and_reason",),
        "a FIFO at a token, certificate or key path blocks the start for good, before the process listens",
    ),
    Mutation(
        "socket-path-in-characters",
        "controller/storage/redis_conn.py",
        "    return len(os.fsencode(path.resolve()))",
        "    return len(str(path.resolve()))",
        ("tests/controller/test_policy_limits.py",),
        "a state dir of few characters but many bytes passes the socket-path check: the embedded Redis cannot start",
    ),
    Mutation(
        "policy-integer-past-int32",
        "controller/decision/policy.py",
        '        4, ge=1, le=MAX_INT32, description="shorter requests are never speculated"',
        '        4, ge=1, description="shorter requests are never speculated"',
        ("tests/controller/test_policy_limits.py",),
        "min_new_tokens: 2**31 passes the policy check, then every WatchDecisions fails (the table's int32 field)",
    ),
    Mutation(
        "waiting-calls-shared-by-every-host",
        "controller/serving/request_wait.py",
        "        counted = waiting.total < limits.max_waiting and waiting.of(host) < limits.max_waiting_per_host",
        "        counted = waiting.total < limits.max_waiting",
        ("tests/controller/test_request_wait.py::test_one_hosts_waiting_calls_leave_another_hosts_their_full_wait",),
        "one host's waiting health checks take every place: another host's report over a slow link is refused "
        "after 0.1 s",
    ),
    Mutation(
        "worker-connections-shared-by-every-host",
        "decoder/worker/connections.py",
        "        if self.per_host and held >= self.per_host:",
        "        if False:",
        ("tests/worker/test_hostile_clients.py::test_one_hosts_connections_leave_other_hosts_served",),
        "one host's idle connections take every place of max_connections: every other client's request gets 503",
    ),
    Mutation(
        "health-watch-streams-unbounded-per-host",
        "controller/serving/health_streams.py",
        "        if mine >= self.per_host:",
        "        if False:",
        ("tests/controller/test_host_share.py",),
        "one client without a token opens health Watch streams without bound: 10,000 of them grew the controller "
        "by 200 MB",
    ),
    Mutation(
        "worker-logs-every-closed-connection",
        "specd_api/sparse_log.py",
        "            if now - self._last < self.every_s:",
        "            if False:",
        (
            "tests/worker/test_hostile_clients.py::test_half_sent_requests_do_not_hold_the_stop_nor_log_tracebacks",
            "tests/controller/test_auth.py::test_refusals_are_logged_at_most_once_per_interval",
        ),
        "a line per connection a client left half-sent: thousands of connections, thousands of lines",
    ),
    Mutation(
        "change-marks-reset-under-the-old-epoch",
        "controller/storage/store.py",
        "  redis.call('HSET', KEYS[2], 'epoch', ARGV[2] .. ':' .. now[1] .. '.' .. now[2])",
        "  redis.call('HSET', KEYS[2], 'epoch', ARGV[2])",
        ("tests/controller/test_stored_data.py::test_unreadable_change_marks_start_again_under_a_new_epoch",),
        "unreadable change marks start again under the writer's usual epoch: readers skip the marks 1..N and keep "
        "stale counts",
    ),
    Mutation(
        "ipv6-client-is-every-address",
        "specd_api/host_counts.py",
        "            return str(ipaddress.IPv6Network((ip, IPV6_HOST_PREFIX), strict=False))",
        "            return str(ip)",
        ("tests/specd_api/test_host_counts.py",),
        "an IPv6 client is as many hosts as its subnet has addresses: every per-host share is no bound for it",
    ),
    Mutation(
        "stored-json-recursion-escapes",
        "controller/storage/redis_schema.py",
        "    except (ValueError, TypeError, UnicodeDecodeError, RecursionError):",
        "    except (ValueError, TypeError, UnicodeDecodeError):",
        ("tests/controller/test_stored_data.py",),
        "a stored prior or sample row nested 3,000 deep raises RecursionError: the controller cannot start, and at "
        "run time every refresh fails",
    ),
    Mutation(
        "prior-overflow-escapes",
        "controller/decision/prior.py",
        "        except (KeyError, TypeError, AttributeError, OverflowError) as e:",
        "        except (KeyError, TypeError, AttributeError) as e:",
        ("tests/controller/test_stored_data.py", "tests/controller/test_fuzz_stored.py"),
        'a stored prior with "tokens": Infinity raises OverflowError through the refresh: the controller cannot start',
    ),
    Mutation(
        "bucket-counters-not-made-consistent",
        "controller/decision/counts.py",
        "            consistent(counters, table == K_TABLE)\n",
        "",
        ("tests/controller/test_fuzz_stored.py", "tests/controller/test_window_recount.py"),
        "a corrupt bucket with more proposals than offers gives a rate above 1 and a Beta with negative failures",
    ),
    Mutation(
        "clean-bucket-not-made-consistent",
        "controller/decision/counts.py",
        "        consistent(counters, table == K_TABLE)\n        for name, slot in names:\n",
        "        for name, slot in names:\n",
        ("tests/controller/test_window_recount.py", "tests/controller/test_fuzz_stored.py"),
        "a corrupt bucket's counters summed over the window before they are cut down: its excess counts",
    ),
    Mutation(
        "clean-bucket-sums-two-names-apart",
        "controller/decision/counts.py",
        "canonical = schema.field_name(f)",
        "canonical = name",
        ("tests/controller/test_window_recount.py",),
        "two names of one counter summed apart over the window: other sums than the buckets one by one",
    ),
    Mutation(
        "clean-bucket-keeps-unusable-numbers",
        "controller/decision/counts.py",
        "cleaned[canonical] = cleaned.get(canonical, 0.0) + _number(value)",
        "cleaned[canonical] = cleaned.get(canonical, 0.0) + value",
        ("tests/controller/test_window_recount.py",),
        "a NaN or negative counter summed over the window: every rate of the segment NaN",
    ),
    Mutation(
        "recount-reads-every-bucket-again",
        "controller/storage/store.py",
        "counts.add_buckets((f, weights[b]) for b, f in read if regime is None or b >= regime)",
        "[counts.add_fields(f, weights[b]) for b, f in read if regime is None or b >= regime]",
        ("tests/controller/test_window_recount.py",),
        "a decay step reads every field name of every bucket again: seconds of CPU a step at 1,000 segments",
    ),
    Mutation(
        "kept-buckets-copied",
        "controller/storage/store.py",
        "        return BucketFields(self.buckets[lo:hi], self.fields[lo:hi])",
        "        return BucketFields(self.buckets[lo:hi], tuple(dict(f) for f in self.fields[lo:hi]))",
        ("tests/controller/test_window_recount.py",),
        "every refresh copies 60,000 buckets' fields at 1,000 segments, and their counts are rebuilt",
    ),
    Mutation(
        "series-keeps-expired-entries",
        "controller/storage/store.py",
        "still = [e for e in entries if e[0] in kept]",
        "still = list(entries)",
        ("tests/controller/test_scale_reads.py",),
        "a bucket that left the window stays in the drift test's series",
    ),
    Mutation(
        "series-grows-the-previous-snapshots-list",
        "controller/storage/store.py",
        "entries = series[drafter] = list(entries)  # previous's list is previous's",
        "pass  # previous's list is previous's",
        ("tests/controller/test_window_recount.py",),
        "a refresh appends to the earlier snapshot's series in place: the drift watch takes it for unmoved",
    ),
    Mutation(
        "costs-version-moves-with-every-cost",
        "controller/decision/learner.py",
        "moved = costs_moved(self._versioned_costs, model)",
        "moved = costs_moved(self._versioned_costs, model, 0.0)",
        ("tests/controller/test_cost_versions.py",),
        "every decay step's small move of a weighted median rebuilds every decision table",
    ),
    Mutation(
        "costs-compared-with-the-previous-model",
        "controller/decision/learner.py",
        "            self.costs_version += 1\n            self._versioned_costs = model\n",
        "            self.costs_version += 1\n        self._versioned_costs = model\n",
        ("tests/controller/test_cost_versions.py",),
        "small cost moves never add up: a cost that drifts 0.5 % a step never reaches the tables",
    ),
    Mutation(
        "costs-moved-ignores-verification",
        "controller/decision/cost_model.py",
        "pairs = [(old.step_seconds, new.step_seconds), *zip(old.verify, new.verify, strict=True)]",
        "pairs = [(old.step_seconds, new.step_seconds)]",
        ("tests/controller/test_cost_versions.py",),
        "a v(n) that moved leaves the tables on the old verification costs",
    ),
    Mutation(
        "stored-count-unbounded",
        "controller/decision/counts.py",
        "    return x if 0 <= x <= MAX_STORED_COUNT else 0.0  # NaN fails the comparison",
        "    return x if 0 <= x < math.inf else 0.0",
        ("tests/controller/test_fuzz_stored.py",),
        "stored counters of 1e308 add up to inf and make the segment's posteriors NaN",
    ),
    Mutation(
        "top-p-keeps-no-token",
        "decoder/sampling.py",
        "    drop_sorted[:, 0] = False",
        "    pass",
        ("tests/decoder/test_sampling.py",),
        "a top_p under float32's smallest number drops every token: the sampler raises in the decode thread",
    ),
    Mutation(
        "temperature-overflows-the-logits",
        "decoder/sampling.py",
        "    return torch.where(torch.isposinf(logits), 0.0, logits - top)",
        "    return logits",
        ("tests/decoder/test_fuzz_sampling.py",),
        "logits near a float16/bfloat16 model's range over a temperature of 1e-5 overflow to inf: the row is NaN and "
        "the sampler raises",
    ),
    Mutation(
        "top-p-mask-in-sorted-order",
        "decoder/sampling.py",
        "    drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_idx, drop_sorted)",
        "    drop = drop_sorted",
        ("tests/decoder/test_fuzz_sampling.py",),
        "the nucleus mask is applied by rank instead of by token: it drops whichever tokens sit at those indices",
    ),
    Mutation(
        "decode-fault-not-confined",
        "decoder/worker/scheduler.py",
        "        emitted = self._round(sessions)",
        "        emitted = self.engine.step(sessions)",
        ("tests/worker/test_scheduler.py",),
        "an exception in one sequence's round ends the decode loop, and every request after it gets 503",
    ),
    Mutation(
        "calibration-not-applied",
        "controller/decision/decide.py",
        "belief = posterior(value * estimate.calibration, estimate.realised)",
        "belief = posterior(value, estimate.realised)",
        ROBUST,
        "decisions ignore what the segment's requests realised against the model",
    ),
    Mutation(
        "transformers-runner-runs-lean",
        "decoder/runners/select.py",
        '    "transformers": TransformersPass,  # any causal LM',
        '    "transformers": LeanPass.create,',
        ("tests/decoder/test_runners.py", "tests/decoder/test_lean.py"),
        "runner: transformers silently runs the lean pass: the README's runner table is false",
    ),
    Mutation(
        "calibration-from-one-request",
        "controller/decision/decide.py",
        "CALIBRATION_MIN_REQUESTS = 3.0",
        "CALIBRATION_MIN_REQUESTS = 0.5",
        (*ROBUST, "tests/controller/test_simulation.py"),
        "one stalled first request sets a new segment's calibration and switches a modest drafter off",
    ),
    Mutation(
        "calibration-on-every-aggregate",
        "specd_client/reports.py",
        "**(_request_totals(groups.values(), expected_speedup, drafter_prefill_seconds) if key == carrier else {}),",
        '**(_request_totals([g], expected_speedup, drafter_prefill_seconds) if key[0] != "none" and carrier else {}),',
        ("tests/controller/test_client.py",),
        "each K the round policy ran is a calibration observation: a one-round tail's 0.5x drags a segment's median "
        "down",
    ),
    Mutation(
        "calibration-not-from-the-fleet",
        "controller/decision/core.py",
        "calibration=calibration_factor(median(calibration), total(calibration), toward=fleet),",
        "calibration=calibration_factor(median(calibration), total(calibration)),",
        ("tests/controller/test_calibration_service.py",),
        "a new segment's calibration starts at 1 whatever the fleet's requests realised (cold segments over-promised)",
    ),
    Mutation(
        "fleet-acceptance-pools-modes",
        "controller/decision/learner.py",
        "kept = [c for name, c in self._snapshot.segments.items() if mode_of(name) == mode]",
        "kept = [c for name, c in self._snapshot.segments.items()]",
        ("tests/controller/test_fleet_figures.py",),
        "the fleet's acceptance pools greedy and sampled segments: new sampled traffic is promised greedy's speedup",
    ),
    Mutation(
        "fleet-alpha-ignores-the-request-mode",
        "controller/decision/core.py",
        "self.fleet_alpha(d, s.prior_alpha, settings.prior_strength, mode)",
        "self.fleet_alpha(d, s.prior_alpha, settings.prior_strength)",
        ("tests/controller/test_fleet_figures.py",),
        "a new sampled segment starts from the greedy fleet's acceptance",
    ),
    Mutation(
        "calibration-ignores-request-totals",
        "controller/decision/counts.py",
        "if self.request_tokens_emitted and self.request_seconds > 0:",
        "if False:",
        ("tests/controller/test_robust_costs.py",),
        "calibration reads the carrier's own K's rounds, not the request's: rounds that stopped drafting never count",
    ),
    Mutation(
        "suffix-segment-share-ignored",
        "decoder/drafters/suffix_cache.py",
        "while self.segment_bytes(segment) > self.segment_cap:",
        "while self.segment_bytes(segment) > self.config.cache_bytes:",
        ("tests/decoder/test_suffix.py",),
        "one segment's outputs may fill the whole suffix cache and evict every other segment's",
    ),
    Mutation(
        "always-largest-k",
        "controller/decision/decide.py",
        "k, value = best_k(curve, k_min)",
        "k, value = k_max, curve[k_max - 1]",
        COSTS,
        "the controller always plans the largest K allowed",
    ),
    Mutation(
        "counterfactual-off-by-one",
        "decoder/counterfactual.py",
        "if token != generated[done + i]:",
        "if token != generated[done + i - 1]:",
        ("tests/decoder/test_counterfactual.py",),
        "prompt lookup's replayed proposal is scored against the previous emitted token",
    ),
    Mutation(
        "suffix-replay-other-segment",
        "decoder/engine.py",
        "            plan = Plan(name, k, segment=segment)\n",
        "            plan = Plan(name, k)\n",
        ("tests/decoder/test_counterfactual.py",),
        "suffix decoding's counterfactual replay reads the unnamed segment's earlier outputs instead of the request's "
        "segment's, so its scores are not what serving it would have accepted",
    ),
    Mutation(
        "suffix-scored-after-sharing",
        "decoder/worker/service.py",
        "            self._report(request, stats, generated, ks)\n            if shares:\n"
        "                self._share(request.segment, generated)\n",
        "            if shares:\n                self._share(request.segment, generated)\n"
        "            self._report(request, stats, generated, ks)\n",
        ("tests/worker/test_counterfactual_scoring.py",),
        "the worker shares a request's output with the suffix cache before scoring suffix decoding over it: the replay "
        "proposes the very tokens it is scored against, and the controller learns an acceptance no request would see",
    ),
    Mutation(
        "tally-without-prefix-rule",
        "specd_api/position_tally.py",
        "verified = min(drafted, accepted + 1)  #",
        "verified = drafted  #",
        ("tests/specd_api/test_position_tally.py", "tests/decoder/test_counterfactual.py"),
        "every proposed position counts as verified, also those after the first rejection (acceptance is a prefix: "
        "they were never checked), so per-position acceptance is underestimated past the first position",
    ),
    Mutation(
        "bench-pooled-totals",
        "specd/bench/measure.py",
        "    return figure(paired(samples, arm, baseline, segment), seed, means)",
        "    pooled = ratio(rate(by(samples, arm, segment)), rate(by(samples, baseline, segment)))\n"
        "    return Figure(pooled, (pooled, pooled), pooled, (pooled, pooled), 0)",
        ("tests/specd/test_bench_measure.py",),
        "the bench's arm figures are pooled totals again instead of paired medians, so one stall sets a segment's",
    ),
    Mutation(
        "chain-never-falls-back",
        "decoder/drafters/chain.py",
        "return found if found.num_tokens > 0 else self.model.propose(context, k)",
        "return found",
        ("tests/decoder/test_chain.py",),
        "the chain proposes nothing when prompt lookup finds no match instead of the draft model's tokens (output "
        "stays exact; only a test of the proposals can see it)",
    ),
    Mutation(
        "dot-pairs-split-in-halves",
        "decoder/native/llama.py",
        "panels = weight.reshape(padded // PANEL, PANEL, width // 2, 2).to(torch.bfloat16)",
        "panels = weight.reshape(padded // PANEL, PANEL, 2, width // 2).transpose(2, 3).to(torch.bfloat16)",
        NATIVE,
        "the bf16 dot-product panels pair input i with i + in/2 instead of 2q with 2q + 1 (every product wrong)",
        BF16_DOT,
    ),
    Mutation(
        "dot-odd-panel-dropped",
        "decoder/native/llama_step.c",
        "    if (panels % 2) {\n#pragma omp single",
        "    if (0) {\n#pragma omp single",
        NATIVE,
        "the multi-token bf16 product forgets the last panel when a matrix has an odd number of them",
        BF16_DOT,
    ),
    Mutation(
        "dot-tile-skips-a-row",
        "decoder/native/llama_step.c",
        "for (int p = 0; p < panels / 2 * 2; p += 2)\n        for (int t = 0; t < rows; t += DP_TILE) {",
        "for (int p = 0; p < panels / 2 * 2; p += 2)\n        for (int t = 0; t < rows; t += DP_TILE + 1) {",
        NATIVE,
        "tiles of the multi-token bf16 product step one row too far: a verification of more than 12 tokens "
        "leaves a row unwritten",
        BF16_DOT,
    ),
    Mutation(
        "best-build-not-chosen",
        "decoder/native/build.py",
        "for isa in reversed(ISAS):",
        "for isa in ISAS:",
        NATIVE,
        "the worst build that works (AVX2) runs where the CPU has AVX512-BF16",
        BF16_DOT,
    ),
    Mutation(
        "every-refresh-moves-every-segment",
        "controller/decision/learner.py",
        "moved = _changed_segments(self._snapshot, snapshot)",
        "moved = set(snapshot.segments)",
        (TABLES,),
        "a refresh counts every segment as changed, read again or not: every refresh recomputes every decision table",
    ),
    Mutation(
        "first-streams-build-together",
        "controller/serving/table_publisher.py",
        "        with self._build_lock:\n            with self._cond:\n                if drafters in self._tables:",
        "        with threading.Lock():\n            with self._cond:\n                if drafters in self._tables:",
        (TABLES,),
        "streams opened together before any table exists each build every table (a controller restart, with every "
        "worker reconnecting, costs N builds)",
    ),
    Mutation(
        "graph-tiles",
        "decoder/runners/graphed.py",
        "    return by_tiles(step, rows, TILE)",
        "    return step(slice(0, rows))",
        ("tests/decoder/test_graph_pass.py",),
        "the graphs pass runs its row-wise steps on all of a bucket's rows in one call: a GPU picks the product's "
        "kernel by the row count, so a token's bits would depend on its bucket",
    ),
    Mutation(
        "graph-padding-slot",
        "decoder/runners/graphed.py",
        "        self._staging[ROW_SLOTS, :n] = self.scratch",
        "        self._staging[ROW_SLOTS, :n] = 0",
        ("tests/decoder/test_graph_pass.py",),
        "rows padded up to a bucket write their keys and values into slot 0, a live sequence's, not the scratch slot",
    ),
    Mutation(
        "graph-attention-slot",
        "decoder/runners/capacity_attention.py",
        "keys.index_select(0, seq_slots[b : b + 1])[0],  # [kv, C, d]",
        "keys.index_select(0, seq_slots[:1])[0],  # [kv, C, d]",
        ("tests/decoder/test_graph_pass.py",),
        "every sequence of a batched step attends to the first sequence's keys (right at batch 1 only)",
    ),
    Mutation(
        "set-acceptance-rate-inverted",
        "benchmarks/set_acceptance.py",
        "keep = torch.rand(n, generator=generator, dtype=torch.float64) < alpha",
        "keep = torch.rand(n, generator=generator, dtype=torch.float64) >= alpha",
        ("tests/decoder/test_set_acceptance.py",),
        "the cost studies' drafter corrupts at rate α instead of 1 - α: every speedup curve is drawn at the wrong α",
    ),
    Mutation(
        "set-acceptance-proposes-the-drafts-own",
        "benchmarks/set_acceptance.py",
        "return self.proposals[position : position + 1], None",
        "return logits.argmax(dim=-1), None",
        ("tests/decoder/test_set_acceptance.py",),
        "the set-acceptance drafter proposes the draft model's own tokens: its α is the draft's, not the set one",
    ),
    Mutation(
        "interceptor-wraps-every-call",
        "controller/serving/grpc_server.py",
        "        if kept is not None and kept[0] is handler:",
        "        if False:",
        ("tests/controller/test_interceptors.py",),
        "every call builds its interceptors' handlers anew: a burst of calls costs the event loop more per call",
    ),
    Mutation(
        "refusal-runs-the-chain",
        "controller/serving/auth.py",
        "        streaming = self._streaming.get(method)",
        "        streaming = None",
        ("tests/controller/test_interceptors.py",),
        "a refused call runs every interceptor behind the token check before it is refused",
    ),
    Mutation(
        "journal-view-takes-off-unshown",
        "controller/storage/journaled_view.py",
        "        if not shown:\n            return\n        if shown > 1:  # journaled twice",
        "        if not shown:\n            pass\n        if shown > 1:  # journaled twice",
        ("tests/controller/test_journaled_view.py",),
        "a previous run's replayed report, never shown, is taken off the view: this run's journaled counts vanish",
    ),
    Mutation(
        "daemon-does-not-freeze-start-up",
        "controller/server.py",
        "        freeze_startup_heap()  # the modules, the policy, the prior, the first snapshot\n",
        "        pass\n",
        ("tests/controller/test_interceptors.py",),
        "start-up's objects stay in the collector's reach: every full collection walks them (50-60 ms stalls)",
    ),
    Mutation(
        "worker-does-not-freeze-start-up",
        "decoder/worker/process.py",
        "        freeze_startup_heap()  # the models, the tokenizer, the modules: a full collection walked them"
        " for 0.2 s\n",
        "        pass\n",
        ("tests/worker/test_budgets.py",),
        "the worker's models and modules stay in the collector's reach: a full collection held the interpreter 0.2 s "
        "and every request on the event loop waited",
    ),
    Mutation(
        "worker-answers-with-nagle",
        "decoder/worker/connections.py",
        "        answer_without_delay(transport)\n",
        "",
        ("tests/worker/test_hostile_clients.py",),
        "accepted connections keep Nagle's algorithm: each response's body waits for the client's delayed ACK (40 ms)",
    ),
    Mutation(
        "table-build-unpaced",
        "controller/serving/table_publisher.py",
        "        for segment in self.controller.learner.segments():\n            pace()\n",
        "        for segment in self.controller.learner.segments():\n",
        ("tests/controller/test_scale_reads.py",),
        "a decay step's rebuild of every table holds the interpreter: Decide's p99 across it 28 ms, not 5",
    ),
    Mutation(
        "refresh-read-unpaced",
        "controller/storage/store.py",
        "            pace()  # between round trips: the interpreter to whoever waits for it\n",
        "",
        ("tests/controller/test_scale_reads.py",),
        "a refresh's bucket reads hold the interpreter from one round trip to the next (~100 ms at 1,000 segments "
        "reported in the last minute): Decide's p99 21-27 ms",
    ),
    Mutation(
        "table-rebuild-wakes-every-stream",
        "controller/serving/table_publisher.py",
        "                if moved:\n",
        "                if True:\n",
        ("tests/controller/test_scale_reads.py",),
        "every refresh wakes every stream's thread to find nothing moved: 256 threads take the interpreter in turn",
    ),
    Mutation(
        "refresh-keeps-a-reported-segment",
        "controller/storage/store.py",
        "                and s not in changed",
        "                and True",
        ("tests/controller/test_scale_reads.py",),
        "a refresh keeps every segment's counts within a decay step, reports or not: new telemetry waits for the step",
    ),
    Mutation(
        "decide-not-urgent",
        "controller/service.py",
        '        with URGENT.serving(), self._span("Decide", context) as span:',
        '        with self._span("Decide", context) as span:',
        ("tests/controller/test_pacing.py",),
        "bulk work takes the interpreter back while a Decide is served: a reporter doubles another client's p50",
    ),
    Mutation(
        "pacer-ignores-urgent",
        "controller/pacing.py",
        "        if self.urgency.pending:",
        "        if False:",
        ("tests/controller/test_pacing.py",),
        "a pacer sleeps on its clock only: bulk work runs through a Decide",
    ),
    Mutation(
        "pacer-waits-on-its-own-call",
        "controller/pacing.py",
        '        return self._count > getattr(self._here, "serving", 0)',
        "        return self._count > 0",
        ("tests/controller/test_pacing.py",),
        "a paced loop inside an urgent call waits for itself: 20 ms at every pace",
    ),
    Mutation(
        "change-message-made-per-stream",
        "controller/serving/table_publisher.py",
        "        with self._delta_lock:\n",
        "        if True:\n",
        ("tests/controller/test_scale_reads.py",),
        "streams woken together each make the change message: 256 copies of ~700 tables at a decay step",
    ),
    Mutation(
        "change-message-serialized-per-stream",
        "controller/serving/table_publisher.py",
        "            return next((data for _, made, data in self._deltas.values() if made is message), message)",
        "            return message",
        ("tests/controller/test_scale_reads.py",),
        "every stream serializes the shared change message itself: 256 encodings of ~700 tables at a decay step",
    ),
    Mutation(
        "stream-bytes-serialized-again",
        "controller/serving/grpc_server.py",
        "        return response if type(response) is bytes else encode(response)",
        "        return encode(response)",
        ("tests/controller/test_decision_tables.py",),
        "a stream message sent as bytes is handed to the message serializer: every change message fails the stream",
    ),
    Mutation(
        "report-budget-no-hold",
        "controller/serving/request_wait.py",
        "                if hold is not None and (seconds := hold(host)) > 0:",
        "                if False and hold is not None and (seconds := hold(host)) > 0:",
        ("tests/controller/test_report_budget.py",),
        "a client over its report budget is read and parsed at once, then refused: it sends 130 reports a second",
    ),
    Mutation(
        "posteriors-per-bucket",
        "controller/decision/core.py",
        "        kept = self._posteriors.get(key)",
        "        kept = None",
        ("tests/controller/test_scale_reads.py",),
        "a decision table computes each drafter's posteriors once per batch bucket: five times at every decay step",
    ),
    Mutation(
        "daemon-keeps-the-switch-interval",
        "controller/server.py",
        "        sys.setswitchinterval(SWITCH_INTERVAL_S)\n",
        "        pass\n",
        ("tests/controller/test_interceptors.py",),
        "a Decide waits up to 5 ms at each thread crossing behind a report's unpaced stretches",
    ),
    Mutation(
        "table-decay-epochs-in-phase",
        "controller/serving/table_publisher.py",
        "    phase = zlib.crc32(segment.encode()) / 2**32 * TABLE_DECAY_STEPS",
        "    phase = 0",
        (EPOCHS,),
        "every segment's decay epoch turns at the same step: every TABLE_DECAY_STEPS steps, every table at once",
    ),
    Mutation(
        "table-follows-decay-at-once",
        "controller/serving/table_publisher.py",
        "            if old is not None and old.key.hard == key.hard and old.epoch == epoch:",
        "            if False:",
        (EPOCHS,),
        "a decay step (or prior refit) recomputes every table: 1-2 s of CPU a step at 1,000 segments",
    ),
    Mutation(
        "table-epochs-turn-at-steps-only",
        "controller/decision/learner.py",
        "        return self.decay_steps + min(max((snapshot.taken_at - snapshot.decay_at) / step, 0.0), 0.999999)",
        "        return float(self.decay_steps)",
        (EPOCHS,),
        "the tables a decay step moves are recomputed together at the step (a quarter of 1,000: a burst of CPU)",
    ),
    Mutation(
        "unmoved-table-keeps-its-old-epoch",
        "controller/serving/table_publisher.py",
        "tables[segment] = replace(old, quick=quick, epoch=epoch)  # the same bytes",
        "tables[segment] = replace(old, quick=quick)  # the same bytes",
        (EPOCHS,),
        "an epoch that turned before a decay step's move recomputes its table at the step: the burst again",
    ),
    Mutation(
        "hysteresis-memory-per-segment",
        "controller/decision/core.py",
        "    return f\"{segment}|{','.join(drafter_set(drafters))}\"",
        "    return segment",
        (EPOCHS,),
        "two drafter sets' tables move each other's memory: every table of both recomputed at every refresh",
    ),
    Mutation(
        "hysteresis-memory-in-request-order",
        "controller/decision/policy.py",
        '    return tuple(sorted({d for d in drafters if d != "none"}))',
        '    return tuple(d for d in drafters if d != "none")',
        (EPOCHS,),
        "a worker listing its drafters in another order (or with none) keeps another memory than its set's table",
    ),
    Mutation(
        "drafter-sets-uncapped",
        "controller/serving/table_publisher.py",
        "            refused = self.refusal(host) or self._set_refusal(drafters, host)",
        "            refused = self.refusal(host)",
        ("tests/controller/test_host_share.py",),
        "one host's streams, each of another drafter set, multiply the tables' work (31 sets: 16 % -> 81 % of a core)",
    ),
    Mutation(
        "drafter-sets-per-host-uncapped",
        "controller/serving/table_publisher.py",
        "        if len(own) >= self.max_drafter_sets_per_host:",
        "        if False:",
        ("tests/controller/test_host_share.py",),
        "one host takes every max_drafter_sets place: another host's workers of a new set get no stream",
    ),
    Mutation(
        "kept-drafter-set-refused",
        "controller/serving/table_publisher.py",
        "        if self._watchers.get(drafters, 0) <= 0 and len(self._watchers) >= self.max_drafter_sets:",
        "        if len(self._watchers) >= self.max_drafter_sets:",
        ("tests/controller/test_host_share.py",),
        "a worker of the fleet's set is refused its stream once the sets are full: it costs nothing new",
    ),
    Mutation(
        "host-drafter-sets-never-given-back",
        "controller/serving/table_publisher.py",
        "            own[drafters] -= 1\n",
        "            pass\n",
        ("tests/controller/test_host_share.py",),
        "a host's drafter-set places stay taken after its streams close: its workers are refused for good",
    ),
    Mutation(
        "table-never-follows-decay",
        "controller/serving/table_publisher.py",
        "    return math.floor((controller.learner.decay_position + phase) / TABLE_DECAY_STEPS)",
        "    return 0",
        (EPOCHS,),
        "a table whose segment gets no report never follows its counts' decay (nor the prior's refits)",
    ),
    Mutation(
        "table-sent-whatever-the-change",
        "controller/serving/table_publisher.py",
        "            if old is not None and not material_change(old.table, table):",
        "            if False:",
        (EPOCHS,),
        "a table recomputed by decimals is sent to every stream again (~70 % of 1,000 tables at a decay step)",
    ),
    Mutation(
        "table-tolerance-against-the-last-computed",
        "controller/serving/table_publisher.py",
        "                tables[segment] = BuiltTable(old.table, old.data, key, quick, epoch)",
        "                tables[segment] = BuiltTable(table, old.data, key, quick, epoch)",
        (EPOCHS,),
        "moves below the tolerance never add up: a table drifting by decimals is never sent",
    ),
    Mutation(
        "tables-within-tolerance-dropped",
        "controller/serving/table_publisher.py",
        "                        self._tables[drafters] = replace(before, tables=tables)",
        "                        pass",
        (EPOCHS,),
        "tables recomputed within the tolerances are dropped with their new keys: every refresh recomputes them again",
    ),
    Mutation(
        "table-change-ignores-plan-fields",
        "controller/serving/table_change.py",
        "            if _plain(a, field) != _plain(b, field):",
        "            if False:",
        ("tests/controller/test_table_change.py",),
        "a plan whose drafter or K changed counts as within the tolerances: workers keep the old plan",
    ),
    Mutation(
        "table-change-probe-shares-ignored",
        "controller/serving/table_change.py",
        "        if not abs(a.probability - b.probability) <= PROBE_SHARE_TOLERANCE:  # (NaN: a change)",
        "        if False:",
        ("tests/controller/test_table_change.py",),
        "a probe's share moved by 0.1 (or a probe appeared) is never sent: workers explore at the old rate",
    ),
    Mutation(
        "shared-posterior-draws-not-kept",
        "controller/decision/decide.py",
        "        drawn = self._rates.get(key)",
        "        drawn = None",
        ("tests/controller/test_decide.py",),
        "a table's buckets each sample every posterior again: most of a table's build, five times over",
    ),
    Mutation(
        "one-gate-for-a-tables-decisions",
        "controller/decision/decide.py",
        "    gate = rng.random() if shared is None else shared[0].gates[shared[1]]",
        "    gate = rng.random() if shared is None else shared[0].gates[0]",
        ("tests/controller/test_decide.py",),
        "every decision of a table explores or none does: its probe shares are 0 or all, not the rate",
    ),
    Mutation(
        "shared-draws-keyed-by-drafter-alone",
        "controller/decision/decide.py",
        "        key = (index, estimate.drafter, estimate.conditional, estimate.proposal)",
        "        key = (index, estimate.drafter)",
        ("tests/controller/test_decide.py",),
        "two posteriors of one drafter in a table get one draw: the second's shares are the first's",
    ),
    Mutation(
        "table-buckets-draw-their-own",
        "controller/serving/table_publisher.py",
        "remember=bucket == 1, shared=shared, pace=pace)",
        "remember=bucket == 1, pace=pace)",
        (EPOCHS,),
        "each bucket samples every posterior again: a table's build costs half as much again",
    ),
    Mutation(
        "demo-tables-are-a-fallback",
        "specd/demo/driver.py",
        'CONTROLLER_SOURCES = ("controller", "table")',
        'CONTROLLER_SOURCES = ("controller",)',
        ("tests/test_demo.py",),
        "the demo marks a decision from the controller's tables as the worker's fallback",
    ),
    Mutation(
        "demo-request-plan-is-a-fallback",
        "specd/demo/view.py",
        "    return REQUEST_MARK if source == REQUEST_SOURCE else FALLBACK_MARK",
        "    return FALLBACK_MARK",
        ("tests/test_demo.py",),
        "the demo says the controller did not answer where a seeded request fixed its own plan",
    ),
    Mutation(
        "decay-moves-the-data-version",
        "controller/decision/learner.py",
        "        decayed = {s for s in moved if _decayed_only(self._snapshot, snapshot, s)}",
        "        decayed: set[str] = set()",
        (EPOCHS,),
        "a decay step counts as new data: every table is recomputed at every step",
    ),
    Mutation(
        "report-counts-as-decay-only",
        "controller/decision/learner.py",
        "    return bool(kept) and earlier.ends_with(kept)",
        "    return bool(kept)",
        (EPOCHS,),
        "a report on a segment counts as its decay only: its table waits for its epoch (minutes) to show it",
    ),
    Mutation(
        "a-bucket-leaving-is-new-data",
        "controller/decision/learner.py",
        "    return bool(kept) and earlier.ends_with(kept)",
        "    return kept == earlier",
        (EPOCHS,),
        "with the window full, every segment's oldest bucket leaves at every step: all 1,000 tables recomputed",
    ),
    Mutation(
        "the-last-bucket-leaving-is-ageing",
        "controller/decision/learner.py",
        "    return bool(kept) and earlier.ends_with(kept)",
        "    return earlier.ends_with(kept)",
        (EPOCHS,),
        "a segment whose last bucket left keeps its table until its epoch: no counts behind it",
    ),
    Mutation(
        "a-new-bucket-is-ageing",
        "controller/decision/learner.py",
        "    return bool(kept) and earlier.ends_with(kept)",
        "    return bool(kept) and len(kept) <= len(earlier)",
        (EPOCHS,),
        "a report in a new bucket at a step counts as ageing: its table waits for its epoch to show it",
    ),
    Mutation(
        "a-report-in-a-kept-bucket-is-ageing",
        "controller/storage/store.py",
        "            and (self.fields[len(self.fields) - n :] == last.fields)",
        "            and True",
        (EPOCHS,),
        "a report into a bucket the window keeps, at a step, counts as ageing: its table waits for its epoch",
    ),
    Mutation(
        "refresh-builds-hold-the-interpreter-a-table",
        "controller/serving/table_publisher.py",
        "            table = segment_table(self.controller, segment, drafters, pace=pace)",
        "            table = segment_table(self.controller, segment, drafters, pace=no_pause if previous else pace)",
        (EPOCHS,),
        "a decay step's table builds run 5-15 ms between pauses: Decide waits at each thread crossing (p99 2.8x)",
    ),
    Mutation(
        "first-build-holds-the-interpreter-a-table",
        "controller/serving/table_publisher.py",
        "            table = segment_table(self.controller, segment, drafters, pace=pace)",
        "            table = segment_table(self.controller, segment, drafters, pace=pace if previous else no_pause)",
        (EPOCHS,),
        "a client's streams of new drafter sets hold every Decide over their first builds (2.4-3.3x)",
    ),
    Mutation(
        "table-draws-unpaced",
        "controller/decision/core.py",
        "            pace()\n            drawn = deliberation.draw(",
        "            drawn = deliberation.draw(",
        (EPOCHS,),
        "a table's draws never give the interpreter back: the refresh's pacer is called between tables only",
    ),
    Mutation(
        "heartbeat-never-sent",
        "controller/serving/grpc_server.py",
        "            beating = responses if isinstance(responses, Beating) else None",
        "            beating = None",
        ("tests/controller/test_scale_reads.py",),
        "no heartbeat is sent from the serving loop: a quiet stream says nothing, and its worker takes it for dead",
    ),
    Mutation(
        "stream-holds-its-last-message",
        "controller/serving/grpc_server.py",
        "                del response, pending",
        "                pass",
        ("tests/controller/test_scale_reads.py",),
        "a stream holds its last message until its next: every stream's first (every table) between changes",
    ),
    Mutation(
        "stream-handler-result-left-open",
        "controller/serving/grpc_server.py",
        "                step.add_done_callback(_result_closer)",
        "                pass",
        ("tests/controller/test_scale_reads.py",),
        "a WatchDecisions call cancelled while its handler ran leaves its watcher counted: max_watchers slots leak",
    ),
    Mutation(
        "beat-before-the-first-message",
        "controller/serving/table_publisher.py",
        "            self._making = True\n            first = p._first_tables(drafters)",
        "            first = p._first_tables(drafters)",
        ("tests/controller/test_scale_reads.py",),
        "a heartbeat goes out before a stream's first message: a reconnected worker takes its old tables as fresh",
    ),
    Mutation(
        "beat-before-a-made-change",
        "controller/serving/table_publisher.py",
        "        self._making = True  # a message is on its way: no heartbeat goes before it",
        "        pass",
        ("tests/controller/test_scale_reads.py",),
        "a heartbeat goes out between a change being made and sent: the new staleness or policy before the tables",
    ),
    Mutation(
        "beat-wait-holds-the-step",
        "controller/serving/grpc_server.py",
        "                    await asyncio.wait((pending,), timeout=beating.beat_in(time.monotonic()))",
        "                    kept = await asyncio.wait((pending,), timeout=beating.beat_in(time.monotonic()))",
        ("tests/controller/test_scale_reads.py",),
        "the heartbeat wait keeps the step it waited on: a stream's last message held through the next wait",
    ),
    Mutation(
        "table-change-probe-that-comes-ignored",
        "controller/serving/table_change.py",
        "    if held_probes.keys() != new_probes.keys():",
        "    if False:",
        ("tests/controller/test_table_change.py",),
        "a rare probe that comes or goes is no change: a worker whose table lacks the floor's probe never probes",
    ),
    Mutation(
        "decay-steps-counted-once-a-refresh",
        "controller/decision/learner.py",
        "    return max(round((after - before) / step_seconds), 1) if step_seconds > 0 else 1",
        "    return 1",
        (EPOCHS,),
        "decay steps missed by failed refreshes are not counted: tables follow decay later than TABLE_DECAY_STEPS",
    ),
    Mutation(
        "heartbeat-before-a-pending-change",
        "controller/serving/table_publisher.py",
        "        if now is not None and now.version != seen.version:\n            return None",
        "        if False:\n            return None",
        ("tests/controller/test_scale_reads.py",),
        "a heartbeat goes out while a change is on its way: it says the new staleness or policy before the tables",
    ),
    Mutation(
        "heartbeats-grow-with-streams",
        "controller/serving/table_publisher.py",
        "        return max(self._heartbeat_floor, self._streams / MAX_HEARTBEATS_PER_SECOND)",
        "        return self._heartbeat_floor",
        ("tests/controller/test_scale_reads.py",),
        "every stream beats every 5 refreshes whatever their number: the heartbeats' CPU grows with the streams",
    ),
    Mutation(
        "heartbeat-period-never-shrinks",
        "controller/serving/table_publisher.py",
        "            self._streams -= 1\n",
        "\n",
        ("tests/controller/test_scale_reads.py",),
        "closed streams still count: once a fleet restarted, the period stays long and dead streams go unseen longer",
    ),
    Mutation(
        "heartbeat-phase-shared",
        "controller/serving/table_publisher.py",
        "        self._phase = random.uniform(0.0, publisher.heartbeat_seconds)",
        "        self._phase = 0.0",
        ("tests/controller/test_scale_reads.py",),
        "every stream beats on the same grid: 256 streams wake together every period",
    ),
    Mutation(
        "mark-before-parts",
        "controller/storage/store.py",
        "        self._ingest_segments(calls)\n        self._mark_changed(list(parts))",
        "        self._mark_changed(list(parts))\n        self._ingest_segments(calls)",
        ("tests/controller/test_scale_reads.py",),
        "a report's change mark is written before its parts: a refresh between the two never reads them",
    ),
    Mutation(
        "refresh-trusts-lost-marks",
        "controller/storage/store.py",
        "            if before is not None and before.epoch == now.epoch and int(trimmed) <= before.seq <= now.seq:",
        "            if before is not None:",
        ("tests/controller/test_scale_reads.py",),
        "marks flushed or trimmed past the last one seen are trusted: a report then is never read until a decay step",
    ),
    Mutation(
        "refresh-rereads-every-marked-segment-for-a-margin",
        "controller/storage/store.py",
        "        changed = self._changed if previous.marks is not None and previous.marks == self._marks_from else"
        " None",
        "        changed = None",
        ("tests/controller/test_scale_reads.py",),
        "every recent segment is read at every refresh (the cost the marks removed: ~5 % of a core at 1,000 segments)",
    ),
    Mutation(
        "active-set-never-reread",
        "controller/storage/store.py",
        "            if active == in_window and self.bucket(now) == self.bucket(self._reported_read_at):",
        "            if self.bucket(now) == self.bucket(self._reported_read_at):",
        (
            "tests/controller/test_scale_reads.py",
            "tests/controller/test_store.py",
            "tests/controller/test_stored_data.py",
        ),
        "the active segments are read once: a segment first reported later is never learned (until the bucket moves)",
    ),
    Mutation(
        "refresh-reads-no-late-write",
        "controller/storage/store.py",
        "        fresh_from = max(first, self.bucket(min(previous.taken_at, self.clock()) - margin))",
        "        fresh_from = max(first, self.bucket(min(previous.taken_at, self.clock())))",
        ("tests/controller/test_scale_reads.py",),
        "a reported segment is read from the previous read's bucket on: a replica whose clock is behind writes unseen",
    ),
    Mutation(
        "increments-offer-every-position",
        "controller/storage/report_increments.py",
        "        rounds_at_k[a.k] += a.rounds",
        "        rounds_at_k[width] += a.rounds",
        ("tests/controller/test_report_increments.py",),
        "a report's summed position counts offer every position up to its widest K to every aggregate's rounds",
    ),
    Mutation(
        "bulk-check-skips-the-prefix-rule",
        "specd_api/checks.py",
        "        and all(map(operator.le, verified_at[1:], accepted_at))",
        "        and True",
        ("tests/specd_api/test_checks_in_bulk.py",),
        "the bulk position check lets through a position verified more often than the one before it was accepted",
    ),
    Mutation(
        "bulk-check-no-seconds-bound",
        "specd_api/checks.py",
        "        and all(map(operator.le, by_seconds, map(",
        "        and any(map(operator.le, by_seconds, map(",
        ("tests/specd_api/test_checks_in_bulk.py", "tests/controller/test_service.py"),
        "the bulk timing check lets through seconds without rounds, and a per-n time past the bound, into the costs",
    ),
    Mutation(
        "request-wait-no-deadline",
        "controller/serving/request_wait.py",
        "asyncio.timeout(limits.wait_seconds if counted else OVER_CAP_WAIT_SECONDS)",
        "asyncio.timeout(None if counted else OVER_CAP_WAIT_SECONDS)",
        ("tests/controller/test_request_wait.py",),
        "a call that never sends its request message waits for it for good, holding its memory",
    ),
    Mutation(
        "request-wait-no-cap",
        "controller/serving/request_wait.py",
        "counted = waiting.total < limits.max_waiting and",
        "counted = True and",
        ("tests/controller/test_request_wait.py",),
        "any number of calls wait for their request message: only the connections bound their memory",
    ),
    Mutation(
        "report-budget-no-refill",
        "controller/serving/report_budget.py",
        "                bucket.tokens = min(self.burst, bucket.tokens + max(now - bucket.updated, 0.0) * self.rate)",
        "                bucket.tokens = min(self.burst, bucket.tokens)",
        ("tests/controller/test_report_budget.py",),
        "a peer's report budget never refills: once spent, its worker's reports are refused for good",
    ),
    Mutation(
        "report-budget-charged-before-size-check",
        "controller/service.py",
        "        if self.budget is None or len(segments) > MAX_AGGREGATES:",
        "        if self.budget is None:",
        ("tests/controller/test_report_budget.py",),
        "a report past the size bound is charged to the budget: RESOURCE_EXHAUSTED (retried forever) instead of "
        "INVALID_ARGUMENT",
    ),
    Mutation(
        "unseen-segments-keyed-by-name",
        "controller/decision/core.py",
        "        named = UNSEEN if counts.empty else request.segment",
        "        named = request.segment",
        ("tests/controller/test_made_up_segments.py",),
        "every made-up segment gets cache entries of its own: 6.5x a learned Decide's work, and a client naming a new "
        "segment per call pushes the learned segments' estimates out",
    ),
    Mutation(
        "unseen-segment-plan-remembered",
        "controller/decision/core.py",
        " and self.learner.counted(request.segment):",
        ":",
        ("tests/controller/test_made_up_segments.py",),
        "a segment nobody reported is remembered for hysteresis: a flood of made-up names evicts another client's "
        "learned plans",
    ),
    Mutation(
        "host-shares-off",
        "controller/serving/request_wait.py",
        "            async with self.shares.turn(peer_host(context.peer())):",
        "            async with contextlib.nullcontext():",
        ("tests/controller/test_host_share.py",),
        "one host's flood runs as many calls at once as it sends: another host's Decide gets a sliver of the "
        "interpreter",
    ),
    Mutation(
        "host-share-one-too-many",
        "controller/serving/host_share.py",
        "        if self._running.get(host, 0) < self.per_host:",
        "        if self._running.get(host, 0) <= self.per_host:",
        ("tests/controller/test_host_share.py",),
        "a host runs one call more than its share",
    ),
    Mutation(
        "host-share-turn-lost-on-cancel",
        "controller/serving/host_share.py",
        "                    self._release(host)  # handed the turn as it was cancelled: pass it on",
        "                    pass",
        ("tests/controller/test_host_share.py",),
        "a turn handed to a call cancelled at that moment is lost: after a few deadlines the host's calls wait forever",
    ),
    Mutation(
        "watchers-per-host-unchecked",
        "controller/serving/table_publisher.py",
        "        if self._per_host.get(host, 0) >= self.max_watchers_per_host:",
        "        if False:",
        ("tests/controller/test_host_share.py",),
        "one client host opens every WatchDecisions slot: no other host's worker gets a stream",
    ),
    Mutation(
        "stream-cap-refused-in-the-pool",
        "controller/serving/request_wait.py",
        "        if gate is not None and (refused := gate(host)) is not None:",
        "        if False:",
        ("tests/controller/test_host_share.py",),
        "a burst of WatchDecisions streams over their caps is refused each from a pool thread, not on the event loop",
    ),
    Mutation(
        "journal-entry-under-the-lock",
        "controller/decision/learner.py",
        "        data, counts = entry(report_id, aggregates), report_counts(aggregates)\n        with self._lock:\n",
        "        with self._lock:\n"
        "            data, counts = entry(report_id, aggregates), report_counts(aggregates)\n",
        ("tests/controller/test_redis_outage.py",),
        "a journaled report is encoded and counted under the lock every Decide reads under",
    ),
    Mutation(
        "replayed-counts-under-the-lock",
        "controller/decision/learner.py",
        "            counts = report_counts(aggregates)\n            with self._lock:\n",
        "            with self._lock:\n                counts = report_counts(aggregates)\n",
        ("tests/controller/test_redis_outage.py",),
        "a replayed report's counts are made under the lock every Decide reads under",
    ),
    Mutation(
        "journal-written-under-the-lock",
        "controller/decision/learner.py",
        "        try:\n            self.journal.append_entry(data)\n",
        "        try:\n            with self._lock:\n                self.journal.append_entry(data)\n",
        ("tests/controller/test_redis_outage.py",),
        "a journaled report's write and fsync hold the lock every Decide reads under",
    ),
    Mutation(
        "journaled-view-cleared-mid-write",
        "controller/decision/learner.py",
        "journal_empty=not len(self.journal) and not self._appending, replayed=replayed",
        "journal_empty=not len(self.journal), replayed=replayed",
        ("tests/controller/test_redis_outage.py",),
        "a refresh while a report is being written to the journal takes it off the view: missed until replayed",
    ),
    Mutation(
        "withdrawn-segment-left-behind",
        "controller/storage/journaled_view.py",
        "            if self._naming[segment] > 0:",
        "            if True:",
        ("tests/controller/test_redis_outage.py", "tests/controller/test_journaled_view.py"),
        "a report refused by a full journal leaves its new segment counted (zeros), and a replayed one's stays",
    ),
    Mutation(
        "decide-hops-to-the-pool",
        "controller/server.py",
        "ON_LOOP = frozenset({DECIDE})",
        "ON_LOOP: frozenset[str] = frozenset()",
        ("tests/controller/test_host_share.py",),
        "Decide hops to the pool and back: two waits for the interpreter beside any bulk work",
    ),
    Mutation(
        "decide-abort-on-the-loop-lost",
        "controller/serving/request_wait.py",
        "                    await context.abort(aborted.code, aborted.details)\n",
        "                    await context.abort(grpc.StatusCode.UNKNOWN, aborted.details)\n",
        ("tests/controller/test_host_share.py",),
        "a Decide refused on the event loop ends with another status than the one its handler gave",
    ),
    Mutation(
        "fleet-figures-left-to-decide",
        "controller/decision/learner.py",
        "                        self._fleet[(figure, drafter, mode, version)] = compute(tables, drafter)\n",
        "                        pass\n",
        ("tests/controller/test_fleet_figures.py",),
        "the first Decide after each move of the learner computes the fleet's figures, on the event loop",
    ),
    Mutation(
        "report-process-not-niced",
        "controller/serving/report_process.py",
        "    os.nice(nice)\n",
        "    os.nice(0)\n",
        ("tests/controller/test_report_process.py",),
        "the report process competes with the daemon's threads for the cores at the same priority",
    ),
    Mutation(
        "report-process-jumps-the-backlog",
        "controller/service.py",
        "or not self.reports.ready or len(learner.journal) or learner.stale:",
        "or not self.reports.ready or learner.stale:",
        ("tests/controller/test_report_process.py",),
        "a report is stored by the child ahead of the journal's backlog: out of order",
    ),
    Mutation(
        "report-process-never-replaced",
        "controller/serving/report_process.py",
        "        broken.shutdown(wait=False, cancel_futures=True)\n        self.start()\n",
        "        broken.shutdown(wait=False, cancel_futures=True)\n",
        ("tests/controller/test_report_process.py",),
        "a report process that died is not replaced: the daemon does every report again, for good",
    ),
    Mutation(
        "report-steps-by-batch-size",
        "controller/serving/report_process.py",
        "        key = (segment, batch_bucket(batch_size))\n",
        "        key = (segment, batch_size)\n",
        ("tests/controller/test_report_process.py",),
        "the child reads realised speedups at no step time for a batch size off a bucket's edge",
    ),
    Mutation(
        "report-process-redis-error-acknowledged",
        "controller/serving/report_process.py",
        "        result = _store.ingest(report_id, aggregates, step_seconds)\n    except redis.RedisError as e:\n"
        '        return f"{type(e).__name__}: {e}"\n',
        "        result = _store.ingest(report_id, aggregates, step_seconds)\n    except redis.RedisError as e:\n"
        "        return Stored(report_id, 0, False)\n",
        ("tests/controller/test_report_process.py",),
        "a report Redis refused in the child is acknowledged, never journaled: lost",
    ),
    Mutation(
        "report-process-outlives-its-daemon",
        "controller/serving/report_process.py",
        "    while os.getppid() == parent:\n",
        "    while True:\n",
        ("tests/controller/test_daemon.py",),
        "a killed daemon's report process lives on, holding its Redis connection, outside systemd",
    ),
    Mutation(
        "report-process-asked-while-stale",
        "controller/service.py",
        "or len(learner.journal) or learner.stale:",
        "or len(learner.journal):",
        ("tests/controller/test_report_process.py",),
        "while Redis is known to be down every report waits for the child's Redis timeout, then the daemon's",
    ),
    Mutation(
        "report-process-waited-for-forever",
        "controller/serving/report_process.py",
        "            outcome: Stored | Invalid | str = call.result(ANSWER_SECONDS)\n",
        "            outcome: Stored | Invalid | str = call.result()\n",
        ("tests/controller/test_report_process.py",),
        "a stopped child, or reports queued behind a slow Redis, hold every report until the worker gives up",
    ),
    Mutation(
        "late-report-done-in-the-daemon",
        "controller/serving/report_process.py",
        "            self._kill_if_stuck(pool)\n            return Held(holder[1])\n",
        "            return None\n",
        ("tests/controller/test_report_process.py",),
        "a report queued behind heavy ones is validated and stored in the daemon's interpreter, beside Decide",
    ),
    Mutation(
        "held-report-sent-again-on-retry",
        "controller/serving/report_process.py",
        "            call = self._held.get(holder)\n",
        "            call = None\n",
        ("tests/controller/test_report_process.py",),
        "each retry of a held report queues another copy of its work in the child",
    ),
    Mutation(
        "held-report-retry-charged-again",
        "controller/service.py",
        "            if self.reports is None or not self.reports.holds(holder):",
        "            if True:",
        ("tests/controller/test_report_process.py",),
        "a worker retrying a report the child holds spends its budget again for no new work",
    ),
    Mutation(
        "stuck-report-process-never-replaced",
        "controller/serving/report_process.py",
        "            if quiet < STUCK_SECONDS:\n",
        "            if True:\n",
        ("tests/controller/test_report_process.py",),
        "a stopped report process holds every report for good: the workers' buffers fill and drop",
    ),
    Mutation(
        "late-refit-done-in-the-daemon",
        "controller/serving/report_process.py",
        "            return Refitting()\n",
        "            return None\n",
        ("tests/controller/test_report_process.py",),
        "a refit queued behind reports runs scikit-learn in the daemon, at its priority, beside Decide",
    ),
    Mutation(
        "stuck-refit-child-never-replaced",
        "controller/serving/report_process.py",
        "            self._kill_if_stuck(pool)\n            return Refitting()\n",
        "            return Refitting()\n",
        ("tests/controller/test_report_process.py",),
        "a child wedged on a refit holds every later refit and report until the daemon restarts",
    ),
    Mutation(
        "refit-queued-again-behind-itself",
        "controller/serving/report_process.py",
        "            if call is None or call.done():\n",
        "            if True:\n",
        ("tests/controller/test_report_process.py",),
        "each due time queues another refit behind the one the child has not done: refits pile up",
    ),
    Mutation(
        "drift-skips-a-series-a-report-moved",
        "controller/decision/drift_watch.py",
        "if quiet is not None and quiet[0] is series and quiet[1] == start:",
        "if quiet is not None and quiet[1] == start:",
        ("tests/controller/test_drift.py",),
        "a segment found quiet once is never tested again: drift after it goes unseen",
    ),
    Mutation(
        "drift-skips-a-moved-regime",
        "controller/decision/drift_watch.py",
        "if quiet is not None and quiet[0] is series and quiet[1] == start:",
        "if quiet is not None and quiet[0] is series:",
        ("tests/controller/test_drift.py",),
        "a regime that moved is not tested from its new start until a report arrives",
    ),
    Mutation(
        "report-process-failed-start-not-retried",
        "controller/serving/report_process.py",
        "            retry.start()\n",
        "",
        ("tests/controller/test_report_process.py",),
        "a child that could not start once leaves every report to the daemon for good",
    ),
    Mutation(
        "report-parsed-whole-in-the-daemon",
        "controller/service.py",
        "answer = self.reports.ingest(request.data, report_steps(request.head, learner.step_seconds), holder)",
        "answer = self.reports.ingest(\n            request.message().SerializeToString(), "
        "report_steps(request.head, learner.step_seconds), holder\n        )",
        ("tests/controller/test_report_process.py",),
        "the daemon parses and serializes 1 MiB again for every report the child stores (2.7 ms of its interpreter)",
    ),
    Mutation(
        "report-rest-unparsable-in-the-child-is-unknown",
        "controller/serving/report_process.py",
        "    except DecodeError as e:  # its head parsed in the daemon, the rest does not\n"
        "        return Invalid(undecodable(METHOD, e))\n",
        "",
        ("tests/controller/test_report_process.py",),
        "a report whose drafter name is not UTF-8 is answered UNKNOWN (a server error) instead of INVALID_ARGUMENT",
    ),
    Mutation(
        "report-rest-unparsable-in-the-daemon-is-unknown",
        "controller/service.py",
        "        except DecodeError as e:  # its head parsed (on the loop), the rest does not\n"
        "            self._invalid(span, context, ValueError(undecodable(METHOD, e)))\n",
        "",
        ("tests/controller/test_report_process.py",),
        "a report whose rest does not parse, kept by the daemon (a backlog), is answered UNKNOWN",
    ),
    Mutation(
        "report-rounds-needs-the-head-deserializer",
        "controller/service.py",
        "        if isinstance(request, pb.ReportRoundsRequest):\n            request = ReceivedReport.of(request)\n",
        "",
        ("tests/controller/test_tracing.py",),
        "a server that registers the servicer as generated answers every report UNKNOWN",
    ),
    Mutation(
        "report-head-drops-a-field",
        "controller/serving/report_head.py",
        'kept = {aggregate.name: ("segment", "batch_size", "temperature", "start_up_timings"),',
        'kept = {aggregate.name: ("segment", "temperature", "start_up_timings"),',
        ("tests/controller/test_report_process.py",),
        "every aggregate's batch size reads 0 in the head: the child's step times are looked up at no bucket",
    ),
    Mutation(
        "withdrawn-after-replay-taken-off-twice",
        "controller/storage/journaled_view.py",
        "        if not shown:\n            return\n        if shown > 1:\n"
        "            self._shown[report_id] = shown - 1\n        self._take_off(",
        "        if shown > 1:\n            self._shown[report_id] = shown - 1\n        self._take_off(",
        ("tests/controller/test_journaled_view.py",),
        "a report withdrawn after a replay took it off is taken off again: another report's counts are lost",
    ),
    Mutation(
        "replayed-sum-names-nothing",
        "controller/storage/journaled_view.py",
        "            naming.update(part.segments.keys())\n",
        "",
        ("tests/controller/test_journaled_view.py",),
        "replayed reports taken off as one sum leave their segments named: zeros kept, or a segment dropped",
    ),
    Mutation(
        "watchers-per-host-never-released",
        "controller/serving/table_publisher.py",
        "            self._per_host[host] -= 1\n",
        "\n",
        ("tests/controller/test_host_share.py",),
        "a host's closed streams still count against it: after a few restarts its workers are refused for good",
    ),
    Mutation(
        "first-message-per-stream",
        "controller/serving/table_publisher.py",
        "            if made is not None and made[0][0] is tables and made[0][1:] == key:",
        "            if False:",
        ("tests/controller/test_scale_reads.py",),
        "every new stream makes and serializes its own first message: a fleet's restart copies every table once per "
        "stream",
    ),
    Mutation(
        "first-message-period-rounded-down",
        "controller/serving/table_publisher.py",
        "        period = math.ceil(self.heartbeat_seconds / quantum - 1e-9) * quantum",
        "        period = math.floor(self.heartbeat_seconds / quantum + 1e-9) * quantum",
        ("tests/controller/test_scale_reads.py",),
        "a shared first message names a period shorter than the stream's heartbeats: its worker may call a live "
        "stream dead",
    ),
    Mutation(
        "first-message-keeps-old-header",
        "controller/serving/table_publisher.py",
        "self.controller.policies.current.version, self.controller.learner.stale, self._built_unix, period)",
        "period,)",
        ("tests/controller/test_scale_reads.py",),
        "a new stream's first message keeps the policy version and staleness of the streams before it",
    ),
    Mutation(
        "drift-alarms-walk-every-segment",
        "controller/decision/drift_watch.py",
        "        own = self._alarms.get(segment)\n",
        "        own = {d: a for s, by in sorted(self._alarms.items()) if s == segment for d, a in by.items()}\n",
        ("tests/controller/test_drift.py",),
        "every Decide sorts every segment's drift alarms to find its own: 176 us a Decide at 2,000 alarms",
    ),
    Mutation(
        "drift-alarms-unordered",
        "controller/decision/drift_watch.py",
        "        return [a for _, a in sorted(own.items())] if own else []",
        "        return list(own.values()) if own else []",
        ("tests/controller/test_drift.py",),
        "a segment's alarms come in the order they were raised, not by drafter: the Decide span's events move",
    ),
    Mutation(
        "drafter-list-unbounded",
        "specd_api/checks.py",
        "    if len(names) > MAX_DRAFTERS_LISTED:",
        "    if False:",
        ("tests/controller/test_service.py",),
        "a Decide's drafters list is bounded only by the message size: 120,000 names take 27 ms of the interpreter "
        "in one handler",
    ),
    Mutation(
        "costs-ignore-the-sampling-mode",
        "controller/decision/counts.py",
        "        return sampling_mode(self.temperature)\n",
        '        return "greedy"\n',
        ("tests/controller/test_modes_service.py",),
        "a sampled request's rounds are timed into the greedy costs: sampled requests are priced as if drafting were "
        "cheap (a drafted token costs 3x greedy's when sampled)",
    ),
    Mutation(
        "cost-model-ignores-the-mode",
        "controller/decision/cost_model.py",
        "        if (mode, bucket) in self.buckets:\n            return self.buckets[(mode, bucket)]\n",
        '        if ("greedy", bucket) in self.buckets:\n            return self.buckets[("greedy", bucket)]\n',
        ("tests/controller/test_modes_service.py",),
        "a decision for a sampled request reads the greedy costs",
    ),
    Mutation(
        "modes-learned-together",
        "specd_api/modes.py",
        "    return segment + SAMPLED_SUFFIX if sampling_mode(temperature) == SAMPLED else segment",
        "    return segment",
        ("tests/controller/test_modes_service.py", "tests/specd_api/test_modes.py"),
        "greedy and sampled requests of a segment pool their acceptance, costs and realised speedups",
    ),
    Mutation(
        "chain-has-its-own-cost",
        "specd_api/speedup.py",
        "    return DRAFT_MODEL if runs_draft_model(drafter) else drafter",
        "    return drafter",
        ("tests/controller/test_realised.py",),
        "a chain escapes the draft model's cost and calibration: an arm with almost no rounds of its own wins on "
        "its prior",
    ),
    Mutation(
        "chain-pays-the-draft-on-every-round",
        "specd_api/speedup.py",
        "    return max(draft_model_c, 0.0) * (1.0 - hit) if math.isfinite(draft_model_c) else 0.0",
        "    return max(draft_model_c, 0.0) if math.isfinite(draft_model_c) else 0.0",
        ("tests/controller/test_realised.py",),
        "a chain is priced as if the draft model drafted the rounds prompt lookup serves",
    ),
    Mutation(
        "ranked-by-the-prior-alone",
        "controller/decision/decide.py",
        "        return self.lower if self.lower > 0 else self.speedup",
        "        return self.speedup",
        ("tests/controller/test_realised.py",),
        "arms ranked by their expected speedup: an arm seen only through its prior beats a measured one",
    ),
    Mutation(
        "realised-ignored",
        "controller/decision/decide.py",
        "    belief = posterior(value * estimate.calibration, estimate.realised)",
        "    belief = posterior(value * estimate.calibration, None)",
        ("tests/controller/test_realised.py",),
        "what a plan realised in the segment never enters its expected speedup: the model alone decides",
    ),
    Mutation(
        "realised-at-the-fleets-reference",
        "controller/decision/learner.py",
        "        return plain_reference(own, self.costs_at(batch_size, segment).step_seconds)",
        "        return self.costs_at(batch_size, segment).step_seconds",
        ("tests/controller/test_modes_service.py",),
        "a request's realised speedup is stored at the fleet's plain step while decisions read it at the segment's: "
        "expected and realised speedups use different references",
    ),
    Mutation(
        "realised-reference-switches-at-a-count",
        "controller/decision/realised.py",
        "    weight = REFERENCE_PRIOR_REQUESTS\n",
        "    weight = 0.0 if n >= 3 else 1e9\n",
        ("tests/controller/test_realised.py",),
        "the reference jumps from the fleet's plain step to the segment's own at three requests",
    ),
    Mutation(
        "realised-certain-from-identical-timings",
        "controller/decision/realised.py",
        "    plan_se = 1.2533 * max(spread, REQUEST_LOG_SD) / math.sqrt(n)",
        "    plan_se = 1.2533 * spread / math.sqrt(n)",
        ("tests/controller/test_realised.py",),
        "a few requests that happened to take the same time make a plan's realised speedup certain",
    ),
    Mutation(
        "refit-in-the-daemon",
        "controller/decision/learner.py",
        "        if elsewhere is not None:\n            done = elsewhere(self.store.config.samples_max)",
        "        if False:\n            done = elsewhere(self.store.config.samples_max)",
        ("tests/controller/test_report_process.py",),
        "the prior's refit (seconds of scikit-learn) runs in the daemon at normal priority, beside the decodes",
    ),
    Mutation(
        "first-token-waits-for-the-drafter",
        "decoder/engine.py",
        "        emitted = self._emit([verdict.next_token])\n",
        "        self.ready_drafter()\n        emitted = self._emit([verdict.next_token])\n",
        ("tests/decoder/test_first_token.py",),
        "the drafter prefills before the first token goes out: a streaming user waits for the draft model's prefill",
    ),
    Mutation(
        "first-token-held-for-the-first-round",
        "decoder/worker/scheduler.py",
        "            job.on_tokens(list(job.session.generated))\n",
        "            pass\n",
        ("tests/worker/test_scheduler.py",),
        "the prefill's token is handed over with the first round's: the first token waits for a whole round",
    ),
    Mutation(
        "plain-rounds-ignored",
        "specd_api/round_policy.py",
        "        if not self.speculates_at(batch_size) or self.plain_round():",
        "        if not self.speculates_at(batch_size):",
        ("tests/specd_api/test_round_policy.py",),
        "the worker drafts from the first round where the plan asked for a plain one: the segment's own plain step "
        "is never measured, and its realised speedups are read at the fleet's",
    ),
    Mutation(
        "plain-round-right-after-the-prefill",
        "specd_api/round_policy.py",
        "PLAIN_ROUNDS_FROM = 4\n",
        "PLAIN_ROUNDS_FROM = 0\n",
        ("tests/specd_api/test_round_policy.py",),
        "the plain round is the first after the prefill, 20-60 % slower than a steady step: the segment's reference "
        "is inflated and every plan's realised speedup with it",
    ),
    Mutation(
        "plain-round-counted-as-a-probe-round",
        "specd_api/round_policy.py",
        "    if ceiling <= 0 or not plan.adaptive or drafting_rounds(plan, observed) < plan.probe_rounds:",
        "    if ceiling <= 0 or not plan.adaptive or observed.rounds < plan.probe_rounds:",
        ("tests/specd_api/test_round_policy.py",),
        "a probe that timed a plain round runs one round fewer at its K: it learns less than it was sent for",
    ),
    Mutation(
        "plain-rounds-never-asked",
        "controller/decision/decide.py",
        "            plain_rounds=PLAIN_ROUNDS if estimate.reference_requests < REFERENCE_REQUESTS else 0,",
        "            plain_rounds=0,",
        ("tests/controller/test_realised.py",),
        "a segment that always speculates never times its own plain step",
    ),
    Mutation(
        "background-work-beside-the-decode",
        "decoder/worker/service.py",
        "                self.scheduler.wait_idle(BACKGROUND_DEFER_SECONDS)\n",
        "                pass\n",
        ("tests/worker/test_suffix_cache.py",),
        "scoring, reporting and sharing run as soon as a request is answered, beside the other sequences' decodes "
        "(a busy Python thread beside a decode on two cores makes it 2.5x slower)",
    ),
    Mutation(
        "reports-sent-beside-the-decode",
        "specd_client/client.py",
        "            if self._quiet is not None and not self._closing.is_set():\n",
        "            if False:\n",
        ("tests/controller/test_client.py",),
        "the reporter sends (and the controller works on) reports while the worker decodes",
    ),
    Mutation(
        "idle-while-a-job-waits",
        "decoder/worker/scheduler.py",
        "not (self._queue or self._active or self._opening)",
        "not self._active",
        ("tests/worker/test_scheduler.py",),
        "the decode loop counts as idle while a request waits to be prefilled",
    ),
    Mutation(
        "scored-drafters-never-measured",
        "controller/decision/decide.py",
        "    measurable = tuple(d for d in bounds if d in probeable or estimates[d].realised is None)",
        "    measurable = probeable",
        ("tests/controller/test_realised.py",),
        "a drafter scored counterfactually is never probed, so what it realises is never measured: it can win only "
        "on its prior, well clear of every measured arm",
    ),
    Mutation(
        "attention-sees-its-own-position-not",
        "decoder/runners/piece_attention.py",
        "        visible = (pos[None, :] <= query_pos[:, None]) & in_range[None, :]",
        "        visible = (pos[None, :] < query_pos[:, None]) & in_range[None, :]",
        ("tests/decoder/test_piece_attention.py::test_it_computes_attention_over_each_sequences_own_length",),
        "the pieces attention hides a query's own position from it",
    ),
    Mutation(
        "pieces-folded-without-rescaling",
        "decoder/runners/piece_attention.py",
        "        acc = acc * mine[:, None] + acc_p * theirs[:, None]",
        "        acc = acc + acc_p * theirs[:, None]",
        ("tests/decoder/test_piece_attention.py::test_it_computes_attention_over_each_sequences_own_length",),
        "a sequence's pieces are folded without rescaling the running sum to the new maximum",
    ),
    Mutation(
        "sequence-length-from-its-first-row",
        "decoder/runners/piece_attention.py",
        "    return token, real, query_pos, tl.max(query_pos, axis=0) + 1",
        "    return token, real, query_pos, tl.load(pos_ptr + b * width) + 1",
        ("tests/decoder/test_piece_attention.py::test_it_computes_attention_over_each_sequences_own_length",),
        "a verification's later rows see no position past its first row's",
    ),
    Mutation(
        "query-head-read-from-the-wrong-group",
        "decoder/runners/piece_attention.py",
        "    q_rows = (b * width + token).to(tl.int64) * stride_qr + (h * GROUP + offs_m % GROUP) * stride_qh",
        "    q_rows = (b * width + token).to(tl.int64) * stride_qr + ((offs_m % GROUP) * KV + h) * stride_qh",
        ("tests/decoder/test_piece_attention.py::test_it_computes_attention_over_each_sequences_own_length",),
        "query heads paired with key-value heads interleaved instead of in groups (transformers' repeat_kv)",
    ),
    Mutation(
        "pieces-aligned-to-the-sequences-end",
        "decoder/runners/piece_attention.py",
        "    start = piece * PIECE_SIZE\n",
        "    start = piece * PIECE_SIZE - (PIECE_SIZE - length % PIECE_SIZE) % PIECE_SIZE\n",
        ("tests/decoder/test_piece_attention.py::test_a_querys_bits_do_not_depend_on_what_shares_the_step",),
        "pieces split from the sequence's end: a query's reduction order then moves with the step's length (a token "
        "verified among K+1 gets other bits than decoded alone)",
    ),
    Mutation(
        "triton-forms-on-a-cpu-by-default",
        "decoder/runners/graphed.py",
        'return fast if device.type == "cuda" and not triton_missing and not compiled else slow',
        "return fast if not triton_missing and not compiled else slow",
        (
            "tests/decoder/test_graph_triton.py::"
            "test_the_settings_are_validated_and_auto_picks_the_triton_forms_on_a_gpu_only",
        ),
        "auto picks the Triton forms on a CPU, where they run only under the interpreter",
    ),
    Mutation(
        "greedy-argmax-copied-per-sequence",
        "decoder/batch_engine.py",
        "        argmaxes = greedy_argmaxes([s.params.is_greedy for s in sessions], logits)\n",
        "        argmaxes = [None] * len(sessions)\n",
        ("tests/decoder/test_batching.py",),
        "each greedy sequence copies its argmaxes to the host on its own: one host synchronisation per sequence "
        "and step on a GPU",
    ),
    Mutation(
        "batched-argmaxes-handed-to-the-wrong-sequence",
        "decoder/batch_engine.py",
        "    return [next(together) if g else None for g in greedy]",
        "    return [*reversed([next(together) if g else None for g in greedy])]",
        ("tests/decoder/test_batching.py",),
        "the argmaxes taken together reach the sequences in the wrong order",
    ),
    Mutation(
        "linear-tiles-read-across",
        "decoder/runners/row_kernels.py",
        "    pid_m = pid % row_tiles  # row tiles fastest",
        "    pid_m = pid // tl.cdiv(n_out, BLOCK_N)  # row tiles fastest",
        ("tests/decoder/test_row_kernels.py",),
        "the matrix product's programs map to the wrong row tiles: outputs of other rows, or none",
    ),
    Mutation(
        "linear-bias-dropped",
        "decoder/runners/row_kernels.py",
        "        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]",
        "        acc += 0.0",
        ("tests/decoder/test_row_kernels.py",),
        "the Triton matrix product ignores a projection's bias",
    ),
    Mutation(
        "rms-norm-mean-over-the-padded-block",
        "decoder/runners/row_kernels.py",
        "    variance = tl.sum(x * x, axis=1) / width",
        "    variance = tl.sum(x * x, axis=1) / BLOCK",
        ("tests/decoder/test_row_kernels.py",),
        "RMSNorm divides by the power-of-two block, not the hidden size (wrong for a hidden size like 72 or 5632)",
    ),
    Mutation(
        "tiles-form-runs-all-rows-at-once",
        "decoder/runners/graphed.py",
        '        return tiles(step, rows) if self.rows == "tiles" else step(slice(0, rows))',
        "        return step(slice(0, rows))",
        ("tests/decoder/test_graph_pass.py",),
        "the PyTorch form's row-wise steps run over all rows in one call: PyTorch picks its GEMM by the row count, "
        "and a token's bits change with the batch",
    ),
    Mutation(
        "a-failed-kernel-check-still-serves",
        "decoder/runners/graphed.py",
        "            return FORMS[what][1]\n",
        "            return form\n",
        ("tests/decoder/test_graph_triton.py::test_auto_serves_with_a_triton_form_only_where_its_check_passes",),
        "auto serves with Triton kernels that failed their start-up check on this machine",
    ),
    Mutation(
        "grouped-weight-written-over-the-first",
        "decoder/runners/row_kernels.py",
        "        w_ptr, b_ptr, n_out, first_col, tile = w1_ptr, b1_ptr, n1, n0, pid_n - tiles0",
        "        w_ptr, b_ptr, n_out, first_col, tile = w1_ptr, b1_ptr, n1, 0, pid_n - tiles0",
        ("tests/decoder/test_row_kernels.py",),
        "a group's second weight (k of q, k, v; up of gate, up) writes its outputs over the first's",
    ),
    Mutation(
        "rotary-half-turned-the-wrong-way",
        "decoder/runners/row_kernels.py",
        "    sign = tl.where(offs_d < D // 2, -1.0, 1.0)",
        "    sign = tl.where(offs_d < D // 2, 1.0, -1.0)",
        ("tests/decoder/test_row_kernels.py",),
        "the fused rotary embedding rotates by minus the angle (rotate_half's signs swapped)",
    ),
    Mutation(
        "fused-cache-write-skips-the-values",
        "decoder/runners/row_kernels.py",
        "    tl.store(v_at + offs_d, v, mask=kv_ok)",
        "    tl.store(v_at + offs_d, v, mask=kv_ok & (offs_d < 0))",
        ("tests/decoder/test_row_kernels.py",),
        "the fused projection writes the keys to the cache but not the values",
    ),
    Mutation(
        "held-report-unmarked",
        "controller/service.py",
        '            context.set_trailing_metadata(((REPORT_HELD, "1"),))\n',
        "",
        (
            "tests/controller/test_report_process.py::test_a_report_the_child_holds_past_its_answer_time_stays_the_childs",
            "tests/controller/test_report_process.py::test_the_client_counts_a_held_report_apart_from_a_failed_send",
        ),
        "a report the controller holds is answered as a plain UNAVAILABLE: workers count a busy controller as a "
        "down one",
    ),
    Mutation(
        "client-counts-a-held-report-as-a-failure",
        "specd_client/client.py",
        "            if code == grpc.StatusCode.UNAVAILABLE and _held(e):",
        "            if code == grpc.StatusCode.UNAVAILABLE and _held(e) and False:",
        ("tests/controller/test_report_process.py::test_the_client_counts_a_held_report_apart_from_a_failed_send",),
        "the client counts the attempts a busy controller held as send failures",
    ),
    Mutation(
        "calibration-skipped-for-a-controller",
        "decoder/worker/service.py",
        "            if cfg.controller.address is None:",
        "            if cfg.controller.address is not None:",
        ("tests/worker/test_runner.py::test_the_worker_calibrates_its_costs_only_for_a_controller",),
        "the worker skips its start-up cost calibration where a controller waits for it (a cold controller then "
        "prices K with the literature's costs) and runs it where nobody will read it",
    ),
    Mutation(
        "rotary-programs-overlap-their-rows",
        "decoder/runners/row_kernels.py",
        "    offs_r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)\n    r_ok = offs_r < rows\n",
        "    offs_r = tl.program_id(0).to(tl.int64) + tl.arange(0, ROWS)\n    r_ok = offs_r < rows\n",
        ("tests/decoder/test_row_kernels.py",),
        "the fused rotary embedding's programs of several rows each start one row after the last: rows past the "
        "first program's are never rotated nor written",
    ),
    Mutation(
        "request-features-drop-top-k",
        "specd_api/request_features.py",
        "top_k=self.top_k)",
        "top_k=0)",
        ("tests/specd_api/test_request_features.py",),
        "a request feature never reaches its field of the DecideRequest",
    ),
    Mutation(
        "aggregate-drops-a-field-as-sent",
        "controller/serving/validation.py",
        "AS_SENT = tuple(f.name for f in fields(Aggregate) if f.name not in READ_HERE)",
        "AS_SENT = tuple(f.name for f in fields(Aggregate) if f.name not in READ_HERE | {'expected_speedup'})",
        ("tests/controller/test_aggregate_from_proto.py",),
        "a field of the report is left at its default instead of read from the message",
    ),
    Mutation(
        "served-rounds-without-per-n-timings",
        "specd_api/checks.py",
        '        if rounds:\n            raise ValueError("rounds_by_drafted: served',
        '        if False:\n            raise ValueError("rounds_by_drafted: served',
        ("tests/controller/test_aggregate_from_proto.py",),
        "served rounds without their per-n timings are stored as if none drafted anything",
    ),
    Mutation(
        "fallback-under-the-workers-threshold",
        "specd_api/plan.py",
        "    if last is not None and last.max_batch_size is not None:\n        max_batch_size = last.max_batch_size",
        "    if False:\n        max_batch_size = last.max_batch_size",
        ("tests/specd_api/test_plan.py",),
        "a fallback to the segment's last plan is checked against the worker's threshold, not the plan's own",
    ),
    Mutation(
        "residual-left-out-of-the-epilogue",
        "decoder/runners/row_kernels.py",
        "        out = round_to(r.to(tl.float32) + out.to(tl.float32), y_ptr.dtype.element_ty)",
        "        out = round_to(out.to(tl.float32), y_ptr.dtype.element_ty)",
        ("tests/decoder/test_row_kernels.py",),
        "the fused residual add loses the residual: a layer's output is its projection alone",
    ),
    Mutation(
        "named-plans-without-the-workers-threshold",
        "decoder/worker/service.py",
        "plan = runnable(request.plan, self.engine.drafters, self.cfg.speculation_max_batch)",
        "plan = runnable(request.plan, self.engine.drafters, None)",
        ("tests/worker/test_batching.py",),
        "a request that names its drafter and K speculates in any batch: its plan never gets the worker's threshold",
    ),
    Mutation(
        "gated-without-silu",
        "decoder/runners/row_kernels.py",
        "    silu = round_to(gate / (1.0 + tl.exp(-gate)), dt).to(tl.float32)",
        "    silu = gate",
        ("tests/decoder/test_row_kernels.py",),
        "the fused MLP input multiplies the gate by up without its SiLU",
    ),
    Mutation(
        "totals-teach-costs",
        "controller/storage/report_increments.py",
        "if a.counterfactual or a.totals_only or not a.rounds:",
        "if a.counterfactual or not a.rounds:",
        ("tests/controller/test_totals.py",),
        "an engine's request totals learned as drafting costs: their draft seconds are 0, so drafting looks free",
    ),
    Mutation(
        "totals-positions-floor-at-the-front",
        "controller/decision/totals.py",
        "accepted_at = [min(running[i] - (running[i - 1] if i else 0), proposed[i]) for i in range(k)]",
        "accepted_at = [min(math.floor(expected[i]), proposed[i]) for i in range(k)]",
        ("tests/controller/test_totals.py",),
        "the inferred counts rounded down: what the floors lose all lands on position 0",
    ),
    Mutation(
        "totals-drafting-rounds-are-the-steps",
        "controller/decision/totals.py",
        "drafting = min(rounds, -(-drafted // k))",
        "drafting = rounds",
        ("tests/controller/test_totals.py",),
        "steps that drafted nothing counted as rounds that drafted and rejected: acceptance read too low",
    ),
    Mutation(
        "totals-with-split-timings",
        "specd_api/checks.py",
        '    if a.draft_seconds or a.verify_seconds:\n        raise ValueError("totals_only: no split timings',
        '    if False:\n        raise ValueError("totals_only: no split timings',
        ("tests/controller/test_totals.py",),
        "request totals with split timings accepted: which of the two the controller learns from is ambiguous",
    ),
    Mutation(
        "adapter-routes-to-the-smallest-k",
        "specd/llama/endpoints.py",
        "return max(below, key=lambda s: s.k) if below else min(same, key=lambda s: s.k)",
        "return min(below, key=lambda s: s.k) if below else min(same, key=lambda s: s.k)",
        ("tests/llama/test_adapter.py",),
        "a plan's K routed to its drafter's smallest endpoint, not the largest within the plan's K",
    ),
    Mutation(
        "suffix-cache-evicts-the-oldest-of-any-segment",
        "decoder/drafters/suffix_cache.py",
        "largest = max(self._by_segment, key=self.segment_bytes)",
        "largest = next(iter(self._outputs.values())).segment",
        ("tests/decoder/test_suffix.py",),
        "past the cache's bound the oldest output goes whoever's: two flooding segments push every other out",
    ),
    Mutation(
        "seeded-requests-speculate",
        "decoder/worker/service.py",
        "elif spec.params.seed is not None and not spec.params.is_greedy:",
        "elif spec.params.seed is not None and spec.params.is_greedy:",
        ("tests/worker/test_api.py",),
        "a seeded sampled request speculates: its text moves with the plan and the load",
    ),
    Mutation(
        "dead-rules-shadowed-globs-missed",
        "controller/decision/rule_globs.py",
        "shadow = next((g for g in candidates if covers(matches[g], match, budget)), None)",
        "shadow = None",
        ("tests/controller/test_dead_rules.py",),
        "a glob behind an earlier glob that covers it passes policy check, and never applies",
    ),
    Mutation(
        "covers-star-in-the-specific-glob",
        "controller/decision/rule_globs.py",
        'if j == len(specific) or specific[j] == "*":  # the specific side may end, or match any text, here',
        "if j == len(specific):",
        ("tests/controller/test_dead_rules.py",),
        "a specific glob's * taken for one character: a live rule reported dead",
    ),
    Mutation(
        "dead-rules-repeats-missed",
        "controller/decision/rule_globs.py",
        "if why is None and match in first:",
        "if why is None and match in first and is_glob(match):",
        ("tests/controller/test_dead_rules.py",),
        "a repeated exact match passes policy check, and never applies",
    ),
    Mutation(
        "client-segments-no-room-for-new-hosts",
        "decoder/worker/client_segments.py",
        "kept = int(bounds.max_names * bounds.new_host_share) if mine else 0  # for addresses holding none",
        "kept = 0",
        ("tests/worker/test_client_segments.py",),
        "four addresses at their share take every client-segment place: a new tenant is served unnamed",
    ),
    Mutation(
        "report-budget-by-aggregates-alone",
        "controller/serving/report_budget.py",
        "cost = len(segments) + SEGMENT_COST * max(len(set(segments)) - 1, 0)",
        "cost = len(segments)",
        ("tests/controller/test_report_budget.py",),
        "a report spread over 980 segments charged as one over 16: 5x the controller's CPU for the same budget",
    ),
    Mutation(
        "parameters-not-served-ignored",
        "decoder/worker/openai_api.py",
        'raise ValueError(f"this worker does not implement {name}: leave it out")',
        "return value",
        ("tests/worker/test_api.py",),
        "logit_bias, penalties, best_of ... answered 200 and ignored: the client gets something else, silently",
    ),
    Mutation(
        "max-completion-tokens-ignored",
        "decoder/worker/openai_api.py",
        "self.max_tokens = self.max_completion_tokens",
        "pass",
        ("tests/worker/test_api.py",),
        "a chat's max_completion_tokens ignored: the default length comes back",
    ),
    Mutation(
        "tenant-may-name-any-segment",
        "decoder/worker/config.py",
        "return any(fnmatch.fnmatchcase(segment, glob) for glob in self.segments)",
        "return True",
        ("tests/worker/test_tenants.py",),
        "a tenant's key naming another tenant's segment: its traffic moves the other's learning",
    ),
    Mutation(
        "tenant-inferred-segments-shared",
        "decoder/worker/app.py",
        'return named, f"{tenant.name}/"',
        'return named, ""',
        ("tests/worker/test_tenants.py",),
        "a tenant's unnamed requests learned under the shared inferred segments, beside every other tenant's",
    ),
    Mutation(
        "key-check-forgets-the-tenant",
        "decoder/worker/auth.py",
        'scope.setdefault("state", {})[TENANT_STATE] = matched[0]',
        'scope.setdefault("state", {})[TENANT_STATE] = None',
        ("tests/worker/test_tenants.py",),
        "every key treated as the operator's: a tenant's key names any segment",
    ),
    Mutation(
        "tokenizing-in-one-lane",
        "decoder/worker/tokenizing.py",
        "lane = self.small if chars <= SMALL_PROMPT_CHARS else self.large",
        "lane = self.large",
        ("tests/worker/test_tokenizing.py", "tests/worker/test_limits.py"),
        "small prompts queued behind large ones: one client's large prompts stall every request",
    ),
    Mutation(
        "tokenizing-hosts-in-arrival-order",
        "decoder/worker/tokenizing.py",
        "host = min(self.waiting, key=lambda h: self.served.get(h, -1))",
        "host = next(iter(self.waiting))",
        ("tests/worker/test_tokenizing.py", "tests/worker/test_limits.py"),
        "a flooding host's queued prompts served before another host's that arrived later",
    ),
    Mutation(
        "capped-encoding-cuts-where-an-entry-spans",
        "decoder/capped_encoding.py",
        "while cut < n and piece[cut - 1 : cut + 1] in pairs:",
        "while cut < n and piece[cut - 1 : cut + 1] not in pairs:",
        ("tests/decoder/test_capped_encoding.py",),
        "a long piece cut inside a merge: its tokens differ from the tokenizer's",
    ),
    Mutation(
        "capped-encoding-runs-past-the-cap",
        "decoder/capped_encoding.py",
        "if len(ids) + after + part_least > cap:",
        "if False:",
        ("tests/decoder/test_capped_encoding.py",),
        "the model runs over the whole of a long piece: a prompt's work grows with its length, not the cap",
    ),
    Mutation(
        "capped-encoding-window-keeps-its-unsettled-pieces",
        "decoder/capped_encoding.py",
        "yield done.ids[:first]",
        "yield done.ids",
        ("tests/decoder/test_capped_encoding.py",),
        "a window's last pieces tokenized twice (again with the next window)",
    ),
    Mutation(
        "capped-encoding-window-restarts-a-piece-late",
        "decoder/capped_encoding.py",
        "span = done.word_to_chars(count - SETTLE)",
        "span = done.word_to_chars(count - 1)",
        ("tests/decoder/test_capped_encoding.py",),
        "the next window starts at the last piece: the piece before it is never tokenized",
    ),
    Mutation(
        "engine-uncapped-encoding-ignores-the-cap",
        "decoder/engine.py",
        "            raise PromptTooLong(len(ids), cap)",
        "            pass",
        ("tests/decoder/test_capped_encoding.py",),
        "a tokenizer the capped path cannot reproduce: its prompts pass any token limit",
    ),
    Mutation(
        "worker-tokenizes-without-its-limit",
        "decoder/worker/app.py",
        "lambda: work(limits.max_prompt_tokens)",
        "lambda: work(1 << 62)",
        ("tests/worker/test_limits.py",),
        "text prompts tokenized without max_prompt_tokens: any length served, tokenized whole",
    ),
    Mutation(
        "ngram-simple-searches-from-the-patterns-own-start",
        "specd/llama/ngram_simple.py",
        "for j in range(length - n - 1, 0, -1):",
        "for j in range(length - n + 1, 0, -1):",
        ("tests/llama/test_ngram_simple.py", "tests/llama/test_adapter.py"),
        "llama.cpp's n-gram search starting at the pattern's own start, so the latest occurrence is the current one",
    ),
    Mutation(
        "ngram-simple-drafts-fewer-than-n",
        "specd/llama/ngram_simple.py",
        "return [] if copy < n else list(history[j + n : j + n + copy])",
        "return list(history[j + n : j + n + copy])",
        ("tests/llama/test_ngram_simple.py", "tests/llama/test_adapter.py"),
        "a draft shorter than the n-gram made, where llama-server makes none",
    ),
    Mutation(
        "ngram-simple-cut-before-the-m-gram",
        "specd/llama/ngram_simple.py",
        "found = ngram_simple_draft(tokens[:-1], tokens[-1], self.n, self.m)[:k]",
        "found = ngram_simple_draft(tokens[:-1], tokens[-1], self.n, k)",
        ("tests/llama/test_ngram_simple.py", "tests/llama/test_adapter.py"),
        "the round's budget taken as the server's m-gram size: no draft near the end, where the server drafts",
    ),
    Mutation(
        "llama-lookup-scored-at-another-n-gram-size",
        "specd/llama/ngram_simple.py",
        "return replay(NgramSimpleDrafter(NGRAM_SIZE, k), prompt_ids, generated, k, rules, None)",
        "return replay(NgramSimpleDrafter(2, k), prompt_ids, generated, k, rules, None)",
        ("tests/llama/test_adapter.py",),
        "prompt lookup scored at an n-gram size other than the one its endpoints are started with",
    ),
    Mutation(
        "adapter-reports-drafted-as-accepted",
        "specd/llama/adapter.py",
        'seconds=float(timings.get("predicted_ms", 0.0)) / 1000.0, drafted=int(timings.get("draft_n", 0)),',
        'seconds=float(timings.get("predicted_ms", 0.0)) / 1000.0, drafted=int(timings.get("draft_n_accepted", 0)),',
        ("tests/llama/test_adapter.py",),
        "the engine's accepted count reported as its drafted count: acceptance read as 1",
    ),
    Mutation(
        "adapter-drops-the-sampling-fields",
        "specd/llama/adapter.py",
        '"prompt": ids, "n_predict": body.max_tokens or DEFAULT_MAX_TOKENS, "temperature": body.temperature,',
        '"prompt": ids, "n_predict": body.max_tokens or DEFAULT_MAX_TOKENS,',
        ("tests/llama/test_adapter.py",),
        "the request's temperature not forwarded: the engine samples at its own default, not greedily",
    ),
    Mutation(
        "adapter-scores-no-prompt-lookup",
        "specd/llama/adapter.py",
        'if k <= 0 or s.drafter == "prompt_lookup" or not generated:',
        "if True:",
        ("tests/llama/test_adapter.py",),
        "prompt lookup never scored over the adapter's requests: the controller learns its acceptance only by probing",
    ),
    Mutation(
        "adapter-without-the-lifecycles-signals",
        "specd/llama/adapter_run.py",
        "        lifecycle.signals(),\n",
        "",
        ("tests/llama/test_adapter.py",),
        "no handlers of the lifecycle: SIGTERM kills the adapter before it stops the servers it started",
    ),
    Mutation(
        "adapter-calibration-off-by-one-pass",
        "specd/llama/calibration.py",
        'deal([RoundRecord("prompt_lookup", n, n, 0, 1, 0.0, s) for s in verify.get(n + 1, [])])',
        'deal([RoundRecord("prompt_lookup", n, n, 0, 1, 0.0, s) for s in verify.get(n, [])])',
        ("tests/llama/test_adapter.py",),
        "a pass of n new tokens reported as verifying n drafts (it verifies n - 1): every v(n) priced one pass low",
    ),
    Mutation(
        "totals-steps-without-the-accepted",
        "specd_client/reports.py",
        "steps = max(emitted - accepted, -(-drafted // self.k), 1)",
        "steps = max(emitted, -(-drafted // self.k), 1)",
        ("tests/llama/test_adapter.py",),
        "a request's steps counted as its tokens: every accepted draft read as a step of its own",
    ),
    Mutation(
        "gguf-keys-in-halves",
        "specd/llama/gguf_export.py",
        'pairs_interleaved(read(f"{hf}.self_attn.k_proj.weight"), shape.kv_heads)',
        'read(f"{hf}.self_attn.k_proj.weight")',
        ("tests/llama/test_gguf_parity.py",),
        "the key projection exported in transformers' rotary layout: llama.cpp rotates the wrong pairs",
    ),
    Mutation(
        "gguf-merges-out-of-order",
        "specd/llama/gguf_export.py",
        'merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]',
        'merges = sorted(m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or [])',
        ("tests/llama/test_gguf_parity.py",),
        "the BPE merges exported out of their rank order: llama.cpp merges in another order than transformers",
    ),
)


@dataclass
class Outcome:
    name: str
    verdict: str  # caught | missed | stale | skipped (the CPU cannot run its tests)
    seconds: float
    detail: str  # the first failing test, or why stale


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], metavar="NAME", help="run only these (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the outcomes as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy (its path is printed)")
    args = parser.parse_args(argv)

    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:28} {m.path:34} {m.why}")
        return 0
    unknown = set(args.only) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"unknown mutation(s): {', '.join(sorted(unknown))}; see --list")
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]

    work = Path(tempfile.mkdtemp(prefix="specd-mutants-"))
    try:
        copy = make_copy(work)
        check_imports_come_from(copy)
        tests = sorted({t for m in chosen for t in m.tests if (copy / t.split("::")[0]).exists()})
        print(f"baseline: {len(tests)} test files on the unmutated copy in {copy} …", flush=True)
        ok, seconds, detail = run_tests(copy, tests)
        if not ok:
            print(f"baseline FAILED in {seconds:.0f} s: {detail}\nno mutation can be judged", flush=True)
            return 2
        print(f"baseline passed in {seconds:.0f} s", flush=True)
        outcomes = [mutate_and_test(copy, m) for m in chosen]
    finally:
        if args.keep:
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    if args.json:
        args.json.write_text(json.dumps([asdict(o) for o in outcomes], indent=2) + "\n")
    counts = {v: sum(o.verdict == v for o in outcomes) for v in ("caught", "missed", "stale", "skipped")}
    line = f"mutations: {counts['caught']} caught, {counts['missed']} missed"
    line += f", {counts['stale']} stale" if counts["stale"] else ""
    print(line + (f", {counts['skipped']} skipped (see above: this CPU)" if counts["skipped"] else ""))
    return 0 if counts["caught"] + counts["skipped"] == len(outcomes) else 1


def make_copy(work: Path) -> Path:
    """The repository's working tree (as it is, uncommitted changes included) under ``work/main``, with
    ``../shared`` beside it when the checkout has one."""
    copy = work / "main"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(*IGNORED), symlinks=True)
    for name in LINKED:
        if (REPO / name).exists():
            (copy / name).symlink_to(REPO / name)
    shared = REPO.parent / "shared"
    if shared.is_dir():
        (work / "shared").symlink_to(shared)
    return copy


def environment(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_imports_come_from(copy: Path) -> None:
    """The editable install points at the checkout: make sure the copy's packages shadow it."""
    probe = "import controller, decoder, specd_api; print(controller.__file__, decoder.__file__, specd_api.__file__)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=copy, env=environment(copy), capture_output=True,
                         text=True, check=True).stdout.split()  # fmt: skip
    strays = [f for f in out if not Path(f).resolve().is_relative_to(copy.resolve())]
    if strays:
        raise SystemExit(f"mutations: the copy's code is not what gets imported: {strays}")


def run_tests(copy: Path, tests: Sequence[str]) -> tuple[bool, float, str]:
    """(all passed, seconds, the first failure or the tail of the output)."""
    started = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-p", "no:cacheprovider", "--no-header", *tests]
    try:
        proc = subprocess.run(cmd, cwd=copy, env=environment(copy), capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, time.monotonic() - started, f"timed out after {TIMEOUT_S} s"
    seconds = time.monotonic() - started
    if proc.returncode == 0:
        return True, seconds, ""
    failed = re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", proc.stdout, flags=re.MULTILINE)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
    return False, seconds, failed[0] if failed else tail[0]


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return next((set(line.partition(":")[2].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def mutate_and_test(copy: Path, mutation: Mutation) -> Outcome:
    lacking = sorted(mutation.cpu_flags - cpu_flags())
    if lacking:
        outcome = Outcome(mutation.name, "skipped", 0.0, f"the CPU lacks {', '.join(lacking)}: its tests skip")
        print(f"skipped {mutation.name:28} {outcome.detail}", flush=True)
        return outcome
    path = copy / mutation.path
    source = path.read_text()
    found = source.count(mutation.original)
    if found != 1:
        outcome = Outcome(mutation.name, "stale", 0.0, f"{mutation.path}: the original occurs {found} times")
        print(f"stale   {mutation.name:28} {outcome.detail}", flush=True)
        return outcome
    tests = [t for t in mutation.tests if (copy / t.split("::")[0]).exists()]
    if not tests:
        outcome = Outcome(mutation.name, "stale", 0.0, f"none of its tests exist: {', '.join(mutation.tests)}")
        print(f"stale   {mutation.name:28} {outcome.detail}", flush=True)
        return outcome
    path.write_text(source.replace(mutation.original, mutation.mutant))
    try:
        passed, seconds, detail = run_tests(copy, tests)
    finally:
        path.write_text(source)
    verdict = "missed" if passed else "caught"
    outcome = Outcome(mutation.name, verdict, round(seconds, 1), detail or f"{len(tests)} test files passed")
    print(f"{verdict:7} {mutation.name:28} {seconds:6.0f} s  {outcome.detail}", flush=True)
    return outcome


if __name__ == "__main__":
    sys.exit(main())
