"""Evaluation and prediction: the eval loss over a whole dataset, predictions for `compute_metrics`, the best metric.

`prediction_loop` runs the model over every micro batch of an eval loader (no shuffle, no gradients) and returns
Hugging Face's `PredictionOutput`: `<prefix>_loss` is the token-weighted mean over the whole set (the sum of every
target's loss over all ranks / their count, not a mean of batch means), with `<prefix>_perplexity`, `_runtime` and
`_samples_per_second`; with predictions wanted, the logits (after `preprocess_logits_for_metrics`) and labels of
every example, in dataset order over all ranks, padded to the longest sequence with -100, then `compute_metrics`.
`track_best` keeps `metric_for_best_model`'s best value, step and checkpoint in the TrainerState.

Called by `trainer.loop.trainer.Trainer.evaluate/predict` (which switch the model to eval mode and back) and, through
them, by the training loop on its eval schedule.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.dist import gather_batches
from trainer.loop import checkpoint as ckpt
from trainer.parallel.transforms import unwrap

# What every evaluation reports, as <prefix>_<name>; compute_metrics adds its own.
EVAL_METRICS = ("loss", "perplexity", "runtime", "samples_per_second")


@dataclass
class EvalPrediction:
    predictions: object
    label_ids: object
    losses: object = None

    def __iter__(self):  # HF lets users unpack `preds, labels = eval_pred`
        return iter((self.predictions, self.label_ids))


@dataclass
class PredictionOutput:
    predictions: object
    label_ids: object
    metrics: dict


@torch.no_grad()
def prediction_loop(
    model,
    loader,
    *,
    device: torch.device,
    prefix: str,
    want_predictions: bool,
    autocast,
    compute_loss,
    logits_loss,
    compute_metrics=None,
    preprocess_logits_for_metrics=None,
    eval_accumulation_steps: int | None = None,
    world_size: int = 1,
) -> PredictionOutput:
    """Every micro batch of `loader` through `model` (already in eval mode). `autocast()` gives the eval precision's
    context; `compute_loss(model, batch, num_items, device)` the sum of the batch's token losses over num_items,
    `logits_loss(logits, labels, num_items)` the same from logits already computed (the predictions path): both
    with the run's label smoothing and z-loss, so the eval loss does not depend on whether predictions are kept."""
    plan = loader.global_batches(loader.epoch)  # every rank's micro batches, in dataset order (no shuffle)
    start = time.perf_counter()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    targets = 0
    preds, labels = [], []
    pending_preds, pending_labels = [], []
    for step, batch in enumerate(loader):
        one = torch.ones((), device=device)
        with autocast():
            if want_predictions:
                logits = forward_logits(model, batch, device)  # (B, T, V)
                batch_labels = batch["labels"].to(device)
                loss = logits_loss(logits, batch_labels, one)  # num_items=1: the sum of token losses
                if preprocess_logits_for_metrics is not None:
                    logits = preprocess_logits_for_metrics(logits, batch_labels)
                pending_preds.append(logits.detach())
                pending_labels.append(batch_labels)
                if eval_accumulation_steps and (step + 1) % eval_accumulation_steps == 0:
                    # move to the host so the device never holds all
                    preds += [p.cpu() for p in pending_preds]
                    labels += [lb.cpu() for lb in pending_labels]
                    pending_preds, pending_labels = [], []
            else:
                loss = compute_loss(model, batch, one, device)  # num_items=1: the sum of token losses
        loss_sum += loss.double()
        targets += int(batch["num_items"]) if "num_items" in batch else count_targets(batch["labels"])
    preds += [p.cpu() for p in pending_preds]
    labels += [lb.cpu() for lb in pending_labels]
    samples = sum(len(b) for b in plan)  # the filler batches that keep ranks in step are not samples
    if world_size > 1:
        # The loss is the token-weighted mean over the whole eval set: sums and target counts over all ranks
        # (filler batches have no targets).
        counts = torch.tensor([loss_sum.item(), float(targets)], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(counts)
        total, targets = counts[0].item(), int(counts[1].item())
        if want_predictions:
            preds, labels = _gather_in_order(preds, len(plan)), _gather_in_order(labels, len(plan))
    else:
        total = loss_sum.item()
    runtime = time.perf_counter() - start
    eval_loss = total / targets if targets else float("nan")
    metrics = {
        f"{prefix}_loss": eval_loss,  # the names EVAL_METRICS lists
        f"{prefix}_perplexity": math.exp(eval_loss) if eval_loss < 700 else float("inf"),
        f"{prefix}_runtime": runtime,
        f"{prefix}_samples_per_second": samples / max(runtime, 1e-9),
    }
    predictions = label_ids = None
    if preds:
        predictions, label_ids = _pad_cat(preds, -100), _pad_cat(labels, -100)
        if compute_metrics is not None:
            extra = compute_metrics(EvalPrediction(predictions=predictions, label_ids=label_ids))
            metrics.update({(k if k.startswith(f"{prefix}_") else f"{prefix}_{k}"): v for k, v in extra.items()})
    return PredictionOutput(predictions=predictions, label_ids=label_ids, metrics=metrics)


def track_best(state, metrics: dict, args) -> None:
    """Hugging Face's best-model bookkeeping: when `metric_for_best_model` improved, record its value, the step
    and the checkpoint that step saves (or would save) in `state`."""
    name = args.metric_for_best_model
    if not name:
        return
    key = name if name.startswith("eval_") else f"eval_{name}"
    value = metrics.get(key)
    if value is None:
        raise ValueError(f"metric_for_best_model: {key!r} is not among the evaluation metrics {sorted(metrics)}")
    greater = args.greater_is_better if args.greater_is_better is not None else not key.endswith("loss")
    best = state.best_metric
    if math.isfinite(value) and (best is None or (value > best if greater else value < best)):
        state.best_metric = value
        state.best_global_step = state.global_step
        state.best_model_checkpoint = str(Path(args.output_dir) / f"{ckpt.PREFIX}-{state.global_step}")


def forward_logits(model, batch, device):
    """The logits of any model (a tensor, a dict or an output object with `.logits`) for a batch's inputs."""
    inputs = {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor) and k != "labels"}
    accepted = forward_params(model)
    kwargs = {k: v for k, v in inputs.items() if k in accepted or "**" in accepted}
    out = model(**kwargs)
    return out if isinstance(out, torch.Tensor) else (out["logits"] if isinstance(out, dict) else out.logits)


def forward_params(model) -> set:
    """The argument names the model's forward takes ("**" when it takes any): remove_unused_columns in effect."""
    forward = unwrap(model).forward
    params = inspect.signature(forward).parameters
    names = set(params)
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        names.add("**")
    return names


def count_targets(labels: torch.Tensor) -> int:
    """Supervised targets after the label shift (what `num_items` holds when the collator did not count them)."""
    return int((labels[:, 1:] != -100).sum())


def _gather_in_order(batches: list[torch.Tensor], num_batches: int) -> list[torch.Tensor]:
    """The eval set's batches from every rank, each once, in dataset order (a collective). The eval loader deals
    global batch j to rank j % world_size, and appends filler copies (no targets) after the last real batch to keep
    the ranks in step: interleave the ranks' lists back and cut the fillers off."""
    per_rank = gather_batches(batches, -100)
    world_size = len(per_rank)
    return [per_rank[j % world_size][j // world_size] for j in range(num_batches)]


def _pad_cat(tensors: list[torch.Tensor], pad: int) -> torch.Tensor:
    """Concatenate (B, T, ...) tensors along B, padding T to the longest with `pad` (Hugging Face's -100)."""
    if all(t.dim() < 2 for t in tensors) or len({t.shape[1] for t in tensors}) == 1:
        return torch.cat(tensors)
    longest = max(t.shape[1] for t in tensors)
    out = []
    for t in tensors:
        shape = list(t.shape)
        shape[1] = longest - t.shape[1]
        out.append(torch.cat([t, t.new_full(shape, pad)], dim=1))
    return torch.cat(out)
