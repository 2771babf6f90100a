"""``specd distill --head eagle``: train an EAGLE-3 head for a target on its own states, judge it before and after
(greedy α through the engine at K = 4, KL and top-1 agreement of its first drafting step), save it in the
speculators layout (decoder/heads/layout.py) with the report beside it."""

from __future__ import annotations

import math

import torch

from decoder.heads import EagleHead, HeadShape, LoadedHead, save_head
from decoder.heads.layout import default_aux_layers
from decoder.models import LoadedModel, parse_dtype, resolve_device
from distill.batches import BatchSource
from distill.config import HELDOUT_FRACTION, DistillConfig
from distill.data import read_documents, split_documents
from distill.evaluate import EVAL_BATCH, Evaluation, HeldOut, greedy_alpha
from distill.head_training import draft_vocabulary, head_loss, new_head, target_states, unrolled_logits
from distill.models import load_target
from distill.pipeline import prepare_streams, start_state
from distill.progress import Progress
from distill.report import Report
from distill.trainer import StopRequest, Trainer, make_optimizer, train


def distill_head(
    cfg: DistillConfig, stop: StopRequest | None = None, progress: Progress | None = None
) -> Report | None:
    """Train (or continue) a head; the report, or None when stopped early with a checkpoint to resume."""
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    documents = split_documents(read_documents(cfg.data), cfg.seed, HELDOUT_FRACTION)
    target = load_target(cfg, device, parse_dtype(cfg.dtype, device))
    train_stream, heldout = prepare_streams(cfg, target, documents.train, documents.heldout)
    config = target.model.config
    hidden = cfg.head_hidden or target.hidden_size
    heads = max(1, hidden // int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads))
    shape = HeadShape(
        hidden=hidden, heads=heads, kv_heads=math.gcd(heads, int(config.num_key_value_heads)),
        head_dim=hidden // heads, intermediate=int(config.intermediate_size) * hidden // target.hidden_size,
        vocab=target.vocab_size, draft_vocab=min(cfg.draft_vocab, target.vocab_size),
        target_hidden=target.hidden_size, aux_layers=default_aux_layers(target.num_layers),
        rms_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
    )  # fmt: skip
    draft_ids = draft_vocabulary(train_stream, target.vocab_size, shape.draft_vocab)
    head = new_head(target.model, shape, draft_ids, cfg.seed).to(device)
    optimizer = make_optimizer(head, cfg, device)
    state = start_state(cfg, head, optimizer)
    if state.before is None:
        state.before = evaluate_head(target, head, heldout, cfg).to_json()
    before = Evaluation.from_json(state.before)
    print(f"before: {before.describe()}", flush=True)

    ids = draft_ids.to(device)

    def step(batch: torch.Tensor, lr: float) -> float:
        for group in optimizer.param_groups:
            group["lr"] = lr
        states, target_logits = target_states(target.model, batch, shape.aux_layers)
        loss = head_loss(unrolled_logits(head, states, batch, cfg.ttt_steps), target_logits, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.item())

    if not train(Trainer(cfg, head, optimizer, BatchSource(train_stream, cfg, target.model, device), state, step),
                 stop, progress):  # fmt: skip
        return None

    after = evaluate_head(target, head, heldout, cfg)
    architectures = list(getattr(config, "architectures", None) or ["LlamaForCausalLM"])
    save_head(head, cfg.out, str(cfg.target), architectures, shares_embeddings=shape.hidden == shape.target_hidden)
    report = Report(before=before, after=after, steps=state.step, tokens=state.step * cfg.tokens_per_step,
                    seconds=state.seconds, eval_prompts=len(heldout.prompts), eval_tokens=cfg.eval_tokens)  # fmt: skip
    report.write(cfg.report_path)
    print(report.summary(), flush=True)
    print(f"saved the head to {cfg.out} and the report to {cfg.report_path}", flush=True)
    return report


@torch.no_grad()
def evaluate_head(target: LoadedModel, head: EagleHead, data: HeldOut, cfg: DistillConfig) -> Evaluation:
    """Greedy α of the ``eagle`` drafter at K = EVAL_K over the held-out prompts (``greedy_alpha``), and the first
    drafting step's KL and top-1 agreement against the target over the held-out blocks (its draft vocabulary's
    share of the target's distribution, renormalised), each block weighing the same as in ``logit_match``."""
    from decoder.engine import SpeculativeDecoder

    head.eval()
    decoder = SpeculativeDecoder(target, head=LoadedHead(head, str(cfg.target), "training"))
    alpha = greedy_alpha(decoder, "eagle", data.prompts, cfg.eval_tokens)
    ids = head.target_ids()
    kl_sum = agree_sum = 0.0
    for batch in data.blocks.split(EVAL_BATCH):
        batch = batch.to(ids.device)
        states, target_logits = target_states(target.model, batch, head.shape.aux_layers)
        draft = unrolled_logits(head, states, batch, 1)[0]  # [b, m, draft_vocab]
        kl_sum += float(head_loss([draft], target_logits, ids)) * len(batch)
        agree_sum += float((ids[draft.argmax(-1)] == target_logits[:, 1:].argmax(-1)).float().mean()) * len(batch)
    return Evaluation(alpha=alpha, kl=kl_sum / len(data.blocks), agreement=agree_sum / len(data.blocks))
