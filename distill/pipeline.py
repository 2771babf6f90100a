"""One distillation run: data -> models -> evaluate before -> train -> evaluate after -> save draft and report."""

from __future__ import annotations

import torch

from decoder.models import LoadedModel, parse_dtype, resolve_device
from distill.batches import BatchSource
from distill.checkpoint import RunState, has_checkpoint, load_checkpoint
from distill.config import HELDOUT_FRACTION, DistillConfig
from distill.data import DataError, pack, read_documents, split_documents
from distill.evaluate import Evaluation, HeldOut, evaluate, held_out
from distill.models import check_lengths, load_draft, load_target, save_draft
from distill.progress import Progress
from distill.report import Report
from distill.trainer import StopRequest, Trainer, autocast, draft_step, make_optimizer, train
from specd_api.errors import UsageError


def distill(cfg: DistillConfig, stop: StopRequest | None = None, progress: Progress | None = None) -> Report | None:
    """Run (or continue) a distillation; the report, or None when stopped early with a checkpoint to resume."""
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    dtype = parse_dtype(cfg.dtype, device)

    # 1. Data, split before any model is loaded so a bad file fails fast.
    documents = split_documents(read_documents(cfg.data), cfg.seed, HELDOUT_FRACTION)

    # 2. Models.
    target = load_target(cfg, device, dtype)
    draft = load_draft(cfg, target)
    check_lengths(cfg, target, draft)
    train_stream, heldout = prepare_streams(cfg, target, documents.train, documents.heldout)

    # 3. Fresh or resumed state.
    optimizer = make_optimizer(draft.model, cfg, device)
    state = start_state(cfg, draft.model, optimizer)

    # 4. Evaluate the draft as it starts (once: a resumed run keeps the first run's numbers).
    if state.before is None:
        state.before = evaluate(target, draft.model, heldout, cfg.eval_tokens).to_json()
    before = Evaluation.from_json(state.before)
    print(f"before: {before.describe()}", flush=True)

    # 5. Train.
    batches = BatchSource(train_stream, cfg, target.model, device)
    step = draft_step(draft.model, target.model, optimizer, cfg, autocast(device, dtype))
    if not train(Trainer(cfg, draft.model, optimizer, batches, state, step), stop, progress):
        return None

    # 6. Evaluate, save, report.
    return finish(cfg, target, draft, heldout, state, before, dtype)


def prepare_streams(
    cfg: DistillConfig, target: LoadedModel, train: list[str], heldout: list[str]
) -> tuple[torch.Tensor, HeldOut]:
    """The packed train stream ([num_tokens] int64) and the held-out prompts and blocks."""
    train_stream = pack(train, target.tokenizer)
    if train_stream.numel() < cfg.seq_len:
        raise DataError(
            f"the training documents hold {train_stream.numel()} tokens, fewer than --seq-len {cfg.seq_len}; "
            "give more data or a shorter --seq-len"
        )
    heldout_stream = pack(heldout, target.tokenizer)
    if heldout_stream.numel() < 2:
        raise DataError("the held-out documents hold fewer than 2 tokens; give more data")
    return train_stream, held_out(heldout_stream, cfg.eval_prompts, cfg.seq_len)


def start_state(cfg: DistillConfig, draft_model: object, optimizer: torch.optim.Optimizer) -> RunState:
    """Resume from ``OUT/checkpoint`` when asked; refuse to overwrite one when not."""
    try:
        cfg.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create --out {str(cfg.out)!r}: {e.strerror}") from None
    if not has_checkpoint(cfg):
        if cfg.resume:
            print(f"no checkpoint in {cfg.checkpoint_dir}; starting afresh", flush=True)
        torch.manual_seed(cfg.seed)
        return RunState()
    if not cfg.resume:
        raise UsageError(f"{cfg.checkpoint_dir} holds a checkpoint: pass --resume to continue it, or use another --out")
    state = load_checkpoint(cfg, draft_model, optimizer)
    print(f"resumed from step {state.step}", flush=True)
    return state


def finish(
    cfg: DistillConfig,
    target: LoadedModel,
    draft: LoadedModel,
    heldout: HeldOut,
    state: RunState,
    before: Evaluation,
    dtype: torch.dtype,
) -> Report:
    after = evaluate(target, draft.model, heldout, cfg.eval_tokens)
    save_draft(draft.model, target.tokenizer, cfg.out, dtype)
    report = Report(
        before=before,
        after=after,
        steps=state.step,
        tokens=state.step * cfg.tokens_per_step,
        seconds=state.seconds,
        eval_prompts=len(heldout.prompts),
        eval_tokens=cfg.eval_tokens,
    )
    report.write(cfg.report_path)
    print(report.summary(), flush=True)
    print(f"saved the draft to {cfg.out} and the report to {cfg.report_path}", flush=True)
    return report
