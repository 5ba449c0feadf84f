"""The Trainer: Hugging Face's API over one training loop you can read top to bottom (`_train_loop`).

What the loop guarantees, and how:
- Loss normalisation. Every micro batch reports `num_items`, its supervised targets after the label shift.
  The loss of each micro batch is `sum of its token losses / N`, N = the supervised targets of the whole
  accumulation window (summed across data-parallel ranks), so the gradient of per_device=B, accum=1 equals
  that of per_device=1, accum=B to fp32 rounding and the logged loss depends on neither. It is never also
  divided by the number of micro steps. Under data parallelism the normaliser is N / world_size, so that
  DDP/FSDP's gradient average is exact and `loss.backward()` runs with grad_output exactly 1
  (`_loss_normaliser`).
- Host syncs. One per optimizer step: the window's loss and gradient norm (and, with several processes, its
  token count) come to the host together in one `.tolist()`; nothing else in the step waits for the device
  (no `.item()`, no device tensor made from a Python number; tests/trainer/test_trainer.py counts them).
- Steps. `max_steps = ceil(epochs * floor(micro_batches_per_epoch / accum))` as Hugging Face defines it. The
  micro batches left over at the end of an epoch (fewer than `accum`) are folded into the epoch's last
  window instead of making an extra partial step (Hugging Face takes an extra step there, so its epochs
  and max_steps disagree); nothing is dropped and the token normalisation keeps that window exact.
- Mixed precision. bf16/fp16 run under `torch.autocast` over fp32 parameters: the parameters are the fp32
  master weights and the optimizer state is fp32, as in Hugging Face Trainer; our kernels compute in fp32
  internally whatever the input dtype. fp16 adds a dynamic loss scaler: an overflow skips the step, lowers
  the scale and is counted (`overflow_steps`), and the scheduler does not advance, as in Hugging Face.
- Non-finite steps. A non-finite loss or gradient norm never reaches the weights: the update is skipped,
  counted (`nonfinite_steps`) and logged; after `max_nonfinite_steps` in a row the run stops with a clear
  error, and the last checkpoint on disk is the last good one.
- Checkpoints are atomic and resumable exactly (model, optimizer, scheduler, scaler, RNG, data position);
  SIGTERM and a first Ctrl-C (SIGINT) save a checkpoint at the end of the current step and stop
  (`stop_signal` says which); a second Ctrl-C aborts at once and says what is on disk. Under another number of
  processes a resume is exact but for the per-rank RNG (re-seeded, with a warning) when the micro and global
  batch stay the same, and refused otherwise (`check_resume_across_worlds`, trainer/resume.py, docs/multi_gpu.md).

Where the rest lives: evaluation and prediction in trainer/evaluation.py, the checkpoint directory layout in
trainer/checkpoint.py, the model's files and resuming in trainer/resume.py (docs/architecture.md draws the modules).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

import kernels

from . import checkpoint as ckpt
from .args import TrainingArguments
from .batching import BatchLoader
from .build import apply_model_settings, causal_lm, model_settings
from .callbacks import CallbackHandler, EarlyStoppingCallback, TrainerCallback, TrainerControl, TrainerState
from .checkpoint_hf import to_json
from .deepspeed_engine import CHECKPOINT_DIR as DEEPSPEED_DIR
from .deepspeed_engine import DeepSpeedRun
from .deepspeed_engine import check_args as check_deepspeed_args
from .dist import init_distributed, local_device, world
from .evaluation import EvalPrediction, PredictionOutput, count_targets, forward_params, prediction_loop, track_best
from .lora import has_adapter, trainable_summary
from .metrics import MetricsWriter, Throughput, device_peak_flops, format_logs, peak_memory_gb
from .model import HostLabels
from .optim import build_lr_scheduler, build_optimizer
from .parallel import apply_all, gradient_sync, is_fsdp, unwrap, uses_deepspeed, uses_fsdp
from .parallel import save_sharded as save_sharded_state
from .resume import (
    apply_checkpoint_arguments,
    load_model_weights,
    restore_checkpoint,
    save_model_files,
    saved_arguments,
)

__all__ = [
    "Trainer",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "EarlyStoppingCallback",
    "EvalPrediction",
    "PredictionOutput",
    "TrainOutput",
    "TrainingError",
    "set_seed",
]


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many non-finite steps in a row); the message says why and what is on disk."""


class TrainOutput(NamedTuple):
    """What `Trainer.train()` returns, as in Hugging Face: the step reached, the mean training loss of the steps this
    call trained (nan when it trained none), and the end-of-training metrics (train_runtime, ..., train_loss)."""

    global_step: int
    training_loss: float
    metrics: dict


def set_seed(seed: int, deterministic: bool = False) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


@dataclass
class _RunningSums:
    """What the loop carries from step to step: the loss and gradient norm to log next, this call's training loss
    (the final train_loss), and how many non-finite steps came in a row."""

    logged_loss: float = 0.0
    logged_steps: int = 0
    last_grad_norm: float | None = None
    train_loss_sum: float = 0.0
    train_loss_steps: int = 0
    nonfinite_in_row: int = 0


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


class Trainer:
    """Hugging Face's `Trainer` constructor and methods, over our loop. See the module docstring."""

    def __init__(
        self,
        model=None,
        args=None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        model_init=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        preprocess_logits_for_metrics=None,
    ):
        if args is None:
            args = TrainingArguments()
        if model is None and model_init is None:
            raise ValueError("Trainer: pass a model or a model_init")
        self.args = args
        self.model_init = model_init
        init_distributed()  # under torchrun/accelerate: join the process group (a no-op for one process)
        self.rank, self.world_size = world()
        if uses_deepspeed(args):  # the JSON read and checked against the arguments before anything is built
            check_deepspeed_args(args, world_size=self.world_size)
        self.model = self._configure_model(model if model is not None else self._call_model_init())
        self.data_collator = data_collator
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.processing_class = processing_class
        self.compute_metrics = compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.optimizer, self.lr_scheduler = optimizers
        if model_init is not None and self.optimizer is not None:
            raise ValueError(
                "Trainer: optimizers cannot be passed together with model_init (the model is rebuilt per train())"
            )
        self.callback_handler = CallbackHandler(callbacks)
        self.state = TrainerState(is_world_process_zero=self.rank == 0)
        self.control = TrainerControl()
        self.scaler = None
        self.deepspeed: DeepSpeedRun | None = None  # the engine's hooks under dist_config deepspeed, once training
        self.stop_signal: signal.Signals | None = None  # SIGTERM or SIGINT when one stopped the last train()
        # after a resume: arguments given otherwise whose checkpoint's value applied (and is now in args)
        self.checkpoint_arguments: dict = {}
        self.control = self.callback_handler.fire("on_init_end", args, self.state, self.control)

    # ---- public API -----------------------------------------------------------------------------------
    def add_callback(self, callback) -> None:
        self.callback_handler.add(callback)

    def pop_callback(self, callback):
        return self.callback_handler.pop(callback)

    def remove_callback(self, callback) -> None:
        self.callback_handler.remove(callback)

    def train(self, resume_from_checkpoint=None):
        args = self.args
        if resume_from_checkpoint is None:
            resume_from_checkpoint = args.resume_from_checkpoint
        set_seed(args.seed, deterministic=args.full_determinism)
        if self.model_init is not None:
            self.model = self._configure_model(self._call_model_init())
            self.optimizer, self.lr_scheduler = None, None
        resume = ckpt.resolve_resume(resume_from_checkpoint, args.output_dir, say=self._print)
        while True:
            try:
                return self._train_loop(resume)
            except torch.OutOfMemoryError:
                micro = args.per_device_train_batch_size
                if not args.auto_find_batch_size or micro == 1:
                    raise
                # Halve the micro batch and double accumulation: the global batch (and the run) stays the same.
                # The arguments are updated so training_args.json records what actually ran.
                args.per_device_train_batch_size = micro = micro // 2
                if args.global_batch_size is None:
                    args.gradient_accumulation_steps *= 2
                accum = self._accumulation_steps()
                self.optimizer, self.lr_scheduler = None, None
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                self._print(
                    f"auto_find_batch_size: out of memory; retrying with per_device_train_batch_size={micro}, "
                    f"gradient_accumulation_steps={accum}"
                )

    def save_model(self, output_dir: str | None = None) -> Path:
        """Save the model (Hugging Face layout for ours) and the tokenizer to output_dir (args.output_dir)."""
        out = Path(output_dir or self.args.output_dir)
        if self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
        self._save_model_files(out)  # every rank: gathering sharded weights is a collective
        if self.rank == 0:
            (out / "training_args.json").write_text(
                to_json(self.args.to_dict(), indent=2, sort_keys=True, default=str) + "\n"
            )
        if self.world_size > 1:
            torch.distributed.barrier()  # on return the files exist for every rank
        return out

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("Trainer.evaluate: no eval_dataset")
        if isinstance(dataset, dict):
            metrics = {}
            for name, ds in dataset.items():
                metrics.update(self.evaluate(ds, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        output = self._prediction_loop(
            dataset,
            metric_key_prefix,
            want_predictions=self.compute_metrics is not None and not self.args.prediction_loss_only,
        )
        return output.metrics

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test") -> PredictionOutput:
        return self._prediction_loop(test_dataset, metric_key_prefix, want_predictions=True)

    def _prediction_loop(self, dataset, prefix: str, want_predictions: bool) -> PredictionOutput:
        """trainer.evaluation.prediction_loop over `dataset` with the model in eval mode (and back to train mode
        after, when it was training)."""
        model = self.model
        device = self._device(model)
        was_training = model.training
        model.eval()
        loader = self._eval_loader(dataset)
        output = prediction_loop(
            model,
            loader,
            device=device,
            prefix=prefix,
            want_predictions=want_predictions,
            autocast=functools.partial(self._autocast, device, train=False),
            compute_loss=self._compute_loss,
            logits_loss=self._logits_loss,
            compute_metrics=self.compute_metrics,
            preprocess_logits_for_metrics=self.preprocess_logits_for_metrics,
            eval_accumulation_steps=self.args.eval_accumulation_steps,
            world_size=self.world_size,
        )
        if was_training:
            model.train()
        return output

    # ---- the loop -------------------------------------------------------------------------------------
    def _train_loop(self, resume: Path | None):
        # -- setup: model transforms, data, optimizer, schedule, resume
        args = self.args
        micro, accum = args.per_device_train_batch_size, self._accumulation_steps()
        if self.train_dataset is None:
            raise ValueError("Trainer.train: no train_dataset")
        model = self.model
        if self.optimizer is not None and uses_fsdp(args) and not is_fsdp(model):
            raise ValueError(
                "optimizers: FSDP2 replaces the parameters with sharded ones, so the optimizer must be "
                "built after sharding; pass optimizers=(None, scheduler-or-None) with dist_config fsdp2"
            )
        # LoRA -> activation checkpointing -> per-block compile -> FSDP2/DDP, before the optimizer is built (it must
        # see only the adapter as trainable, and FSDP2's sharded parameters); a model from trainer.build.build_model
        # has them already (apply_all is idempotent)
        model = self.model = apply_all(model, args)
        device = self._device(model)
        loader = self._train_loader(micro)
        micro_per_epoch = len(loader)  # at least 1: BatchLoader refuses a plan with none
        windows_per_epoch = args.steps_per_epoch(micro_per_epoch)  # floor(micro batches / accum), at least 1
        max_steps = args.get_max_steps(micro_per_epoch)
        num_epochs = math.ceil(max_steps / windows_per_epoch)
        optimizer, scheduler = self._create_optimizer_and_scheduler(model, max_steps)
        model = self.model  # under dist_config deepspeed: the engine around it
        if args.fp16 and self.scaler is None and self.deepspeed is None:  # DeepSpeed scales fp16 losses itself
            self.scaler = torch.amp.GradScaler(device.type)

        every = args.resolve_steps(max_steps)
        state = TrainerState(
            max_steps=max_steps,
            num_train_epochs=num_epochs,
            is_world_process_zero=self.rank == 0,
            train_batch_size=micro,
            logging_steps=every["logging_steps"],
            eval_steps=every["eval_steps"] or every["logging_steps"],
            save_steps=every["save_steps"],
        )
        if resume is not None:
            restored = restore_checkpoint(
                resume,
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                scaler=self.scaler,
                loader=loader,
                args=args,
                rank=self.rank,
                world_size=self.world_size,
                micro=micro,
                accum=accum,
                windows_per_epoch=windows_per_epoch,
                deepspeed=self.deepspeed,
            )
            state = TrainerState.from_dict(
                {**restored["trainer_state"], "max_steps": max_steps, "num_train_epochs": num_epochs}
            )
            self.checkpoint_arguments, changes = apply_checkpoint_arguments(
                resume, args, saved_arguments(resume), restored["rng_reseeded"]
            )
            for line in changes:
                self._print(line)
            if restored["rng_reseeded"]:
                self._print(
                    f"warning: resume_from_checkpoint: saved by {restored['saved_world']} process(es), resumed "
                    f"by {self.world_size}: per-rank random streams cannot carry over, re-seeded from seed="
                    f"{args.seed}, the step and the rank (dropout/NEFTune noise differs from an unbroken run)"
                )
            self._print(f"resumed from {resume} at step {state.global_step}")
            if state.global_step >= max_steps:
                self._print(
                    f"resume_from_checkpoint: {resume} is at step {state.global_step} and max_steps is "
                    f"{max_steps}: nothing left to train; the weights are the checkpoint's"
                )
        self.state = state
        self.control = TrainerControl()
        writer = MetricsWriter(
            args.output_dir,
            args.report_to,
            args.logging_dir,
            enabled=self.rank == 0,
            run_name=args.run_name,
            config=args.to_dict(),
            run_ids=state.logger_run_ids,
            resumed_step=state.global_step if resume is not None else None,
        )
        state.logger_run_ids = writer.run_ids  # saved in every checkpoint, so that a resume logs to the same runs
        throughput = Throughput()
        peak_flops = device_peak_flops(device)
        flops_per_token = self._flops_per_token(model)
        self._print_run_summary(model, loader, micro, accum, num_epochs, max_steps)
        start_time, start_step, start_nonfinite = time.perf_counter(), state.global_step, state.nonfinite_steps
        progress = self._progress(max_steps, state.global_step)
        previous_handlers = self._install_stop_signals()
        sums = _RunningSums()
        self.control = self.callback_handler.fire("on_train_begin", args, state, self.control, model=model)
        if args.eval_on_start and self.eval_dataset is not None and resume is None:
            self._evaluate_and_track(state)
        # A run resumed at or past max_steps trains nothing (the epoch loop is empty).
        start_epoch = num_epochs if state.global_step >= max_steps else state.global_step // windows_per_epoch

        # -- train: for each epoch, for each window of micro batches, one optimizer step
        try:
            for epoch in range(start_epoch, num_epochs):
                first_window = state.global_step - epoch * windows_per_epoch
                if first_window == 0:  # a fresh epoch; mid-epoch, the restored loader state goes on where it was
                    loader.set_epoch(epoch)
                batches = iter(loader)
                self.control = self.callback_handler.fire("on_epoch_begin", args, state, self.control)
                for window in range(first_window, windows_per_epoch):
                    # The last window of an epoch takes the leftover micro batches too (see the docstring).
                    size = (
                        accum if window < windows_per_epoch - 1 else micro_per_epoch - accum * (windows_per_epoch - 1)
                    )
                    micro_batches = [next(batches) for _ in range(size)]
                    self.control = self.callback_handler.fire("on_step_begin", args, state, self.control)

                    # 1. forward/backward over the window, each micro loss normalised by the window's targets
                    window_loss, window_tokens, global_tokens = self._forward_backward(
                        model, micro_batches, device, state, throughput
                    )
                    # 2. clip, check, step (or skip): the step's one host sync
                    learning_rate, window_tokens = self._clip_and_step(
                        model, optimizer, scheduler, window_loss, window_tokens, global_tokens, device, state, sums
                    )
                    state.global_step += 1
                    state.epoch = epoch + (window + 1) / windows_per_epoch
                    if flops_per_token:
                        state.total_flos += flops_per_token * window_tokens
                    progress.update(1)
                    if (
                        args.torch_empty_cache_steps
                        and state.global_step % args.torch_empty_cache_steps == 0
                        and device.type == "cuda"
                    ):
                        torch.cuda.empty_cache()
                    self.control = self.callback_handler.fire("on_step_end", args, state, self.control, model=model)

                    # 3. log / evaluate / save on schedule
                    self._mark_due(state, max_steps, sums.nonfinite_in_row)
                    if self.control.should_log:
                        self._log_training(
                            state,
                            sums,
                            learning_rate,
                            throughput,
                            device,
                            peak_flops,
                            flops_per_token,
                            writer,
                            progress,
                        )
                    self._maybe_evaluate_and_save(state, model, optimizer, scheduler, loader, writer, progress)
                    if self.control.should_training_stop or self.control.should_epoch_stop:
                        break
                self.control.should_epoch_stop = False
                self.control = self.callback_handler.fire("on_epoch_end", args, state, self.control)
                if args.eval_strategy == "epoch":
                    self.control.should_evaluate = True
                if args.save_strategy == "epoch":
                    self.control.should_save = True
                self._maybe_evaluate_and_save(state, model, optimizer, scheduler, loader, writer, progress)
                if self.control.should_training_stop:
                    break

            # -- end: Hugging Face's end-of-training metrics, over what this call trained
            runtime = time.perf_counter() - start_time
            steps_trained = state.global_step - start_step
            training_loss = sums.train_loss_sum / sums.train_loss_steps if sums.train_loss_steps else float("nan")
            # Deliberate differences: after a resume HF divides the new steps' losses by the whole run's global_step
            # and counts the whole run's samples and steps against this call's runtime; here all three cover this
            # call's steps only.
            samples_trained = steps_trained * args.total_train_batch_size(self.world_size)
            metrics = {
                "train_runtime": runtime,
                "train_samples_per_second": samples_trained / max(runtime, 1e-9),
                "train_steps_per_second": steps_trained / max(runtime, 1e-9),
                "total_flos": state.total_flos,
                "train_loss": training_loss if sums.train_loss_steps else None,
            }
            if self.stop_signal is None:  # a stopped run is not at its end: its resume logs them, once
                self._log(state, metrics, writer, progress)
        except KeyboardInterrupt:  # a second Ctrl-C: no checkpoint of this point
            self._print(f"aborted by a second Ctrl-C after step {state.global_step}, without saving; {self._on_disk()}")
            raise
        finally:
            progress.close()
            self._restore_stop_signals(previous_handlers)
            writer.close()
        if self.stop_signal is not None:
            self._print(f"{self.stop_signal.name}: stopped at step {state.global_step}; {self._on_disk()}")
        elif steps_trained and state.nonfinite_steps - start_nonfinite == steps_trained:
            # Every step was skipped: the weights are the starting ones, and a caller saving them as "the trained
            # model" would replace a good model with an untrained one (transformers goes on and saves it).
            raise TrainingError(
                f"training failed: all {steps_trained} steps had a non-finite loss or gradient norm, "
                f"so no update reached the weights (lower the learning rate, check the data, or try "
                f"bf16 instead of fp16); {self._on_disk()}"
            )
        if args.load_best_model_at_end and state.best_model_checkpoint and self.stop_signal is None:
            if self.deepspeed is not None:
                self.deepspeed.load_checkpoint(Path(state.best_model_checkpoint) / DEEPSPEED_DIR, weights_only=True)
            else:
                load_model_weights(self.model, Path(state.best_model_checkpoint))
            self._print(
                f"loaded the best model from {state.best_model_checkpoint} ({args.metric_for_best_model}="
                f"{state.best_metric})"
            )
        self.control = self.callback_handler.fire("on_train_end", args, state, self.control, model=model)
        return TrainOutput(state.global_step, training_loss, metrics)

    def _forward_backward(self, model, micro_batches, device, state, throughput):
        """Forward and backward of every micro batch of a window, gradients accumulated in `.grad`. Returns the
        window's loss (on the device), its tokens (this rank's, on the host) and, with several processes, the
        window's tokens over all ranks (on the device; the loss is then the sum over all ranks too)."""
        args = self.args
        num_items = self._loss_normaliser(micro_batches, device)
        model.train()
        window_loss = torch.zeros((), device=device, dtype=torch.float32)
        window_tokens = 0
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            # Gradients are reduced across ranks once per window, in the last micro step's backward.
            with gradient_sync(model, last):
                with self._autocast(device, train=True):
                    loss = self._compute_loss(model, batch, num_items, device)
                if self.deepspeed is not None:
                    self.deepspeed.backward(loss, last)
                else:
                    (self.scaler.scale(loss) if self.scaler else loss).backward()
            window_loss += loss.detach().float()
            if i < len(micro_batches) - 1:
                self.control = self.callback_handler.fire("on_substep_end", args, state, self.control)
            tokens = int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()
            throughput.add(tokens, count_targets(batch["labels"]))  # on the host copy of the labels
            window_tokens += tokens
        global_tokens = None
        if self.world_size > 1:
            # Each rank holds its share of the window's loss and tokens: log the sums over all ranks, the loss
            # divided by world_size (_loss_normaliser). float64 counts tokens exactly.
            totals = torch.stack(
                [window_loss.double(), torch.full((), float(window_tokens), dtype=torch.float64, device=device)]
            )
            torch.distributed.all_reduce(totals)
            window_loss, global_tokens = totals[0] / self.world_size, totals[1]
        return window_loss, window_tokens, global_tokens

    def _clip_and_step(
        self,
        model,
        optimizer,
        scheduler,
        window_loss,
        window_tokens: int,
        global_tokens,
        device,
        state,
        sums: _RunningSums,
    ) -> tuple[float, int]:
        """Clip the gradients, bring the window's numbers to the host (the step's one sync), then step the optimizer
        and the scheduler, or skip a non-finite (or fp16-overflowing) update; zero the gradients either way.
        Returns the learning rate this step used and the window's tokens (over all ranks with several).

        Under DeepSpeed its engine clips (gradient_clipping), checks, steps the optimizer and the scheduler and
        zeroes the gradients in one call, skipping a non-finite or overflowing update itself (its own host syncs
        included); the loop counts and logs what it did exactly as its own."""
        args = self.args
        # The rate this step uses, read before the scheduler moves on: what Hugging Face logs.
        learning_rate = scheduler.get_last_lr()[0]
        if self.deepspeed is not None:
            self.control = self.callback_handler.fire("on_pre_optimizer_step", args, state, self.control)
            applied, grad_norm = self.deepspeed.step()
            loss_value, grad_norm_value, window_tokens = self._host_numbers(
                window_loss, grad_norm, window_tokens, global_tokens, device
            )
            state.num_input_tokens_seen += window_tokens
            finite = math.isfinite(loss_value) and applied
            stepped = applied and math.isfinite(loss_value)
            if not applied and args.fp16 and math.isfinite(loss_value):  # DeepSpeed's loss scaler lowered the scale
                finite = True
                state.overflow_steps += 1
        else:
            if self.scaler is not None:
                self.scaler.unscale_(optimizer)
            params = [p for p in model.parameters() if p.grad is not None]
            max_norm = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.zeros((), device=device)
            if hasattr(grad_norm, "full_tensor"):  # FSDP2: the norm over every rank's shards (already used to clip)
                grad_norm = grad_norm.full_tensor()
            loss_value, grad_norm_value, window_tokens = self._host_numbers(
                window_loss, grad_norm, window_tokens, global_tokens, device
            )
            state.num_input_tokens_seen += window_tokens
            finite = math.isfinite(loss_value) and math.isfinite(grad_norm_value)
            self.control = self.callback_handler.fire("on_pre_optimizer_step", args, state, self.control)
            stepped = False
            if self.scaler is not None:
                # Non-finite gradients under fp16 are an overflow: the scaler skips the update and
                # lowers the scale. Only a non-finite loss counts as a non-finite step then.
                finite = math.isfinite(loss_value)
                scale_before = self.scaler.get_scale()
                self.scaler.step(optimizer)
                self.scaler.update()
                stepped = self.scaler.get_scale() >= scale_before and finite
                if self.scaler.get_scale() < scale_before:
                    state.overflow_steps += 1
            elif finite:
                optimizer.step()
                stepped = True
            optimizer.zero_grad(set_to_none=True)
            if stepped:
                scheduler.step()
        if stepped:
            sums.nonfinite_in_row = 0
            sums.logged_loss += loss_value
            sums.logged_steps += 1
            sums.train_loss_sum += loss_value
            sums.train_loss_steps += 1
            sums.last_grad_norm = grad_norm_value
        elif not finite:
            state.nonfinite_steps += 1
            sums.nonfinite_in_row += 1
            self._print(
                f"step {state.global_step + 1}: non-finite loss ({loss_value}) or grad_norm "
                f"({grad_norm_value}); update skipped"
            )
            if sums.nonfinite_in_row >= args.max_nonfinite_steps:
                last = ckpt.latest_checkpoint(args.output_dir)
                raise TrainingError(
                    f"{sums.nonfinite_in_row} non-finite steps in a row (max_nonfinite_steps="
                    f"{args.max_nonfinite_steps}); stopping. Last good checkpoint: {last or 'none saved'}"
                )
        self.control = self.callback_handler.fire("on_optimizer_step", args, state, self.control)
        return learning_rate, window_tokens

    def _host_numbers(
        self, window_loss, grad_norm, window_tokens: int, global_tokens, device
    ) -> tuple[float, float | None, int]:
        """The step's one host sync: one copy of every number the host needs, (loss, gradient norm, the window's
        tokens over all ranks with several). `.to(device)`: FSDP2 with offloaded parameters, and DeepSpeed, have
        the norm on the CPU; DeepSpeed may have none (stage 0 without clipping)."""
        on_device = (
            [window_loss]
            + ([grad_norm] if grad_norm is not None else [])
            + ([global_tokens] if global_tokens is not None else [])
        )
        host = torch.stack([t.to(device, torch.float64) for t in on_device]).tolist()
        loss_value = host.pop(0)
        grad_norm_value = host.pop(0) if grad_norm is not None else None
        if global_tokens is not None:
            window_tokens = int(host.pop(0))
        return loss_value, grad_norm_value, window_tokens

    def _mark_due(self, state, max_steps: int, nonfinite_in_row: int) -> None:
        """Is a log, an evaluation, a save or the end due after this step? Set in `self.control`, where callbacks
        may have set some already (on_step_end)."""
        args, step = self.args, state.global_step
        if _due(args.logging_strategy, step, state.logging_steps) or (args.logging_first_step and step == 1):
            self.control.should_log = True
        if _due(args.eval_strategy, step, state.eval_steps) and step >= (args.eval_delay or 0):
            self.control.should_evaluate = True
        # No scheduled save inside a run of non-finite steps: the newest checkpoint stays the last good one.
        if args.save_strategy == "steps" and step % state.save_steps == 0 and not nonfinite_in_row:
            self.control.should_save = True
        if step >= max_steps:
            self.control.should_training_stop = True
        if self.stop_signal is not None:  # SIGTERM or a first Ctrl-C: save this step, then stop
            self.control.should_save = True
            self.control.should_training_stop = True

    def _log_training(
        self,
        state,
        sums: _RunningSums,
        learning_rate: float,
        throughput,
        device,
        peak_flops,
        flops_per_token,
        writer,
        progress,
    ) -> None:
        """The training log line: the mean loss of the steps since the last log, the last gradient norm, the
        learning rate, the throughput since the last log, MFU and memory; then the sums start over."""
        # Skipped (non-finite) steps are not averaged in; a window of only skipped steps logs no loss.
        logs = {
            "loss": sums.logged_loss / sums.logged_steps if sums.logged_steps else None,
            "grad_norm": sums.last_grad_norm,
            "learning_rate": learning_rate,
            **self._extra_logs(),
        }
        speed = throughput.mark()
        logs.update(speed)
        if peak_flops and flops_per_token:
            # tokens_per_second counts this rank's tokens, so this is already the per-device MFU.
            logs["mfu"] = flops_per_token * speed["tokens_per_second"] / peak_flops
        logs["peak_memory_gb"] = peak_memory_gb(device)
        if self.args.include_num_input_tokens_seen:
            logs["num_input_tokens_seen"] = state.num_input_tokens_seen
        if state.nonfinite_steps or state.overflow_steps:
            logs["skipped_steps"] = state.nonfinite_steps + state.overflow_steps
        self._log(state, logs, writer, progress)
        sums.logged_loss, sums.logged_steps, sums.last_grad_norm = 0.0, 0, None

    def _extra_logs(self) -> dict:
        """What a trainer built on this loop adds to each training log (trainer/preference.py: TRL's metrics)."""
        return {}

    def _print_run_summary(self, model, loader, micro: int, accum: int, num_epochs: int, max_steps: int) -> None:
        """Hugging Face's `***** Running training *****` block, plus one line of ours spelling out the global batch."""
        # ds_numel: a parameter's full size under DeepSpeed ZeRO-3, which leaves each rank an empty tensor in its place
        sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]  # tied: once
        trainable, total = sum(n for n, grad in sizes if grad), sum(n for n, _ in sizes)
        processes = f"{self.world_size} process{'es' if self.world_size > 1 else ''}"
        if loader.max_tokens is not None:  # token-budget batching: a micro batch is a token count, not a row count
            global_batch = (
                f"{processes} x micro batches of up to {loader.max_tokens:,} tokens x {accum} accumulation "
                f"= {self.world_size * accum} micro batches per step"
            )
        else:
            global_batch = (
                f"{processes} x {micro} micro batch x {accum} accumulation = "
                f"{self.world_size * micro * accum} sequences per step"
            )
        self._print(
            "\n".join(
                [
                    "***** Running training *****",
                    f"  Num examples = {len(self.train_dataset):,}",
                    f"  Num Epochs = {num_epochs:,}",
                    f"  Instantaneous batch size per device = {micro:,}",
                    f"  Total train batch size (w. parallel, distributed & accumulation) = "
                    f"{self.args.total_train_batch_size(self.world_size):,}",
                    f"  Gradient Accumulation steps = {accum}",
                    f"  Total optimization steps = {max_steps:,}",
                    f"  Number of trainable parameters = {trainable:,}",
                    f"  Global batch = {global_batch}",
                ]
                + ([trainable_summary(trainable, total)] if has_adapter(unwrap(model)) else [])
            )
        )

    # ---- pieces of the loop -----------------------------------------------------------------------------
    def _device(self, model) -> torch.device:
        """Where batches go: this rank's device with several processes (FSDP2 with offload_params keeps the
        shards on the CPU, but computes on the accelerator), else wherever the model's parameters are."""
        return local_device() if self.world_size > 1 else _model_device(model)

    def _accumulation_steps(self) -> int:
        self.args.resolve_world(self.world_size)
        return self.args.gradient_accumulation_steps

    def _loss_normaliser(self, micro_batches, device) -> int | torch.Tensor:
        """What each micro batch's summed token loss is divided by: N / world_size, N = the window's supervised
        targets over all ranks with average_tokens_across_devices, else this rank's count times world_size (each
        rank its own mean, as Hugging Face). DDP/FSDP average the gradients over the ranks, so dividing by
        world_size here keeps that average exact while `loss.backward()` runs with grad_output exactly 1: the
        cross-entropy backward then skips its in-place scaling pass over the logits (about 4 bytes per logit per
        backward). Each rank's loss is world_size times its share, so the loop divides the logged sum by world_size.
        A host int where no collective is needed (the kernel makes it a device scalar with a fill, not a copy from
        the host); a window without targets (filler batches) divides by 1."""
        total = sum(int(b["num_items"]) if "num_items" in b else count_targets(b["labels"]) for b in micro_batches)
        if self.world_size == 1 or not self.args.average_tokens_across_devices:
            return max(total, 1)
        n = torch.full((), float(total), device=device)  # a fill: no host-to-device copy, no sync
        torch.distributed.all_reduce(n)
        return n.clamp_(min=1.0) / self.world_size

    def _compute_loss(self, model, batch, num_items, device):
        """Sum of the batch's token losses / num_items, whatever kind of model this is."""
        pin = self.args.dataloader_pin_memory and device.type == "cuda"
        # A model that takes host labels (ours) gets them as the collator built them, so the fused loss skips the
        # ignored rows' matmuls without a device sync.
        host = {"labels"} if getattr(unwrap(model), "takes_host_labels", False) else set()
        inputs = {
            k: v if k in host else (v.pin_memory() if pin else v).to(device, non_blocking=True)
            for k, v in batch.items()
            if isinstance(v, torch.Tensor)
        }
        # remove_unused_columns in effect: only the keys the model's forward takes are passed.
        accepted = forward_params(model)
        kwargs = {k: v for k, v in inputs.items() if k in accepted or "**" in accepted}
        if "num_items" in accepted:
            kwargs["num_items"] = num_items
        if host and is_fsdp(model) and "labels" in kwargs:
            # FSDP2's root pre-forward moves every tensor argument to the device (and the skip with it); a holder
            # passes untouched (tests/trainer/test_distributed.py: test_fsdp2_loss_skips_ignored_rows)
            kwargs["labels"] = HostLabels(kwargs["labels"])
        out = model(**kwargs)
        loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
        if loss is not None and "num_items" in accepted:
            return loss
        if loss is not None:
            # A model that averages over its own batch: rescale to sum / window targets (counted on the host copy).
            targets = batch["num_items"] if "num_items" in batch else count_targets(batch["labels"])
            return loss * (targets / num_items)
        logits = out if isinstance(out, torch.Tensor) else (out.get("logits") if isinstance(out, dict) else out.logits)
        return self._logits_loss(logits, inputs["labels"], num_items)

    def _logits_loss(self, logits, labels, num_items):
        """The sum of the token losses of (B, T, V) logits against unshifted labels / num_items, with the arguments'
        label smoothing and z-loss: in training and in evaluation, with or without predictions (transformers applies
        its LabelSmoother in both)."""
        # The labels move, not the logits (as transformers' ForCausalLMLoss does): logits[:, :-1].reshape(...) copied
        # (B*(T-1), V) in the forward, and autograd filled a zeroed (B, T, V) gradient to slice back into.
        targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)  # (B, T): t predicts t+1
        return kernels.cross_entropy(
            logits,
            targets,
            label_smoothing=self.args.label_smoothing_factor,
            z_loss=self.args.z_loss,
            num_items=num_items,
        )

    def _configure_model(self, model):
        """The model the Trainer gets (at construction, or from model_init) with the arguments' model settings, and
        on its device. A model `build_model` built from these arguments has them from its construction and is left
        as it is; one built otherwise (by hand, as transformers' users do, or from other arguments) gets them here,
        once, as transformers' Trainer applies its arguments to whatever model it gets. Train/eval switches then
        only flip `training` (NEFTune adds noise only in training). The settings go to our CausalLM wherever it
        sits: inside torch.compile's OptimizedModule (`_orig_mod`), DDP (`module`) or peft (`base_model.model`); an
        attribute written onto the wrapper would be lost. A module without our model inside takes label smoothing
        and z-loss only through the logits path (`_compute_loss`); a setting it cannot apply is refused, never
        ignored."""
        args = self.args
        z_loss = args.z_loss
        ours = causal_lm(model)
        if ours is not None:
            settings = model_settings(args)
            if any(getattr(ours, name) != value for name, value in settings.items()):
                apply_model_settings(ours, settings)
        else:
            name = type(model).__name__
            if args.neftune_noise_alpha:
                raise ValueError(
                    f"neftune_noise_alpha: a {name} has no trainer.model.CausalLM inside to add the "
                    "noise; leave it unset for this model"
                )
            if args.use_liger_kernel:
                raise ValueError(
                    f"use_liger_kernel: a {name} has no trainer.model.CausalLM inside to run "
                    "liger-kernel's ops; leave it off for this model"
                )
            accepted = forward_params(model)
            if (args.label_smoothing_factor or z_loss) and ("labels" in accepted or "**" in accepted):
                raise ValueError(
                    f"label_smoothing_factor/z_loss: a {name} computes its own loss from labels, which "
                    "would ignore them; use trainer.model.CausalLM or a model whose forward returns logits"
                )
        if args.tf32 is not None and torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = bool(args.tf32)
            torch.backends.cudnn.allow_tf32 = bool(args.tf32)
        if self.world_size == 1:
            # As transformers' Trainer does: the model goes to the device it trains on (CUDA when there is one);
            # with several processes DDP/FSDP2 place it. Without this a CPU-built model would train on the CPU.
            model.to(local_device())
        return model

    def _autocast(self, device, train: bool):
        args = self.args
        if train:
            dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
        else:
            dtype = (
                torch.bfloat16
                if args.bf16 or args.bf16_full_eval
                else torch.float16
                if args.fp16 or args.fp16_full_eval
                else None
            )
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=dtype)

    def _create_optimizer_and_scheduler(self, model, max_steps):
        """The optimizer and the schedule, built once. Under dist_config deepspeed, `deepspeed.initialize` wraps the
        model in its engine (`self.model` from then on) with ours as its client optimizer and schedule, or those
        of the config's sections (trainer/deepspeed_engine.py)."""
        args = self.args
        if uses_deepspeed(args):
            if self.deepspeed is None:
                self.deepspeed = DeepSpeedRun.initialize(
                    model,
                    args,
                    world_size=self.world_size,
                    max_steps=max_steps,
                    make_optimizer=lambda m: self.optimizer or build_optimizer(m, args),
                    make_scheduler=lambda opt: self.lr_scheduler or build_lr_scheduler(opt, args, max_steps),
                )
                self.model = self.deepspeed.engine
            self.optimizer, self.lr_scheduler = self.deepspeed.optimizer, self.deepspeed.scheduler
            return self.optimizer, self.lr_scheduler
        if self.optimizer is None:
            self.optimizer = build_optimizer(model, args)
        if self.lr_scheduler is None:
            self.lr_scheduler = build_lr_scheduler(self.optimizer, args, max_steps)
        return self.optimizer, self.lr_scheduler

    def _flops_per_token(self, model) -> float | None:
        fn = getattr(unwrap(model), "flops_per_token", None)
        if fn is None:
            return None
        return float(fn(self.args.cutoff_len))

    def _log(self, state, logs: dict, writer, progress) -> None:
        logs = {"epoch": round(state.epoch, 4), **{k: v for k, v in logs.items() if v is not None}}
        state.log_history.append({**logs, "step": state.global_step})
        writer.write(logs, state.global_step)
        self.control = self.callback_handler.fire("on_log", self.args, state, self.control, logs=logs)
        if self.rank == 0:
            if progress.disable:
                self._print(f"step {state.global_step}/{state.max_steps} {format_logs(logs)}")
            else:
                progress.set_postfix(
                    {
                        k: (f"{v:.4g}" if isinstance(v, float) else v)
                        for k, v in logs.items()
                        if k in ("loss", "eval_loss", "learning_rate", "tokens_per_second")
                    },
                    refresh=False,
                )
                progress.write(f"step {state.global_step}/{state.max_steps} {format_logs(logs)}")

    def _maybe_evaluate_and_save(self, state, model, optimizer, scheduler, loader, writer, progress) -> None:
        args = self.args
        metrics = None
        if self.control.should_evaluate and self.eval_dataset is not None:
            metrics = self._evaluate_and_track(state, writer=writer, progress=progress)
        if args.save_strategy == "best" and metrics is not None and state.best_global_step == state.global_step:
            self.control.should_save = True
        if self.control.should_save and (args.save_strategy != "no" or self.stop_signal is not None):
            self._save_checkpoint(state, model, optimizer, scheduler, loader)
        self.control.reset_step()

    def _evaluate_and_track(self, state, writer=None, progress=None) -> dict:
        metrics = self.evaluate()
        if writer is not None:
            self._log(state, metrics, writer, progress if progress is not None else _NoProgress())
        track_best(state, metrics, self.args)
        self.control = self.callback_handler.fire("on_evaluate", self.args, state, self.control, metrics=metrics)
        return metrics

    def _save_checkpoint(self, state, model, optimizer, scheduler, loader) -> Path:
        args = self.args
        if self.deepspeed is not None:  # model, optimizer and scheduler: DeepSpeed's checkpoint in deepspeed/
            optimizer, scheduler = None, None
            save_sharded = lambda d: self.deepspeed.save_checkpoint(d / DEEPSPEED_DIR)  # noqa: E731
        elif is_fsdp(model):
            save_sharded = lambda d: save_sharded_state(model, optimizer, d / ckpt.DCP_DIR)  # noqa: E731
        else:
            save_sharded = None
        path = ckpt.save_checkpoint(
            args.output_dir,
            state.global_step,
            save_model=self._save_model_files,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=self.scaler,
            data_state=loader.state_dict(),
            trainer_state=state.to_dict(),
            args_dict=args.to_dict(),
            rank=self.rank,
            world_size=self.world_size,
            save_only_model=args.save_only_model,
            save_sharded=save_sharded,
        )
        if self.rank == 0:
            ckpt.rotate_checkpoints(args.output_dir, args.save_total_limit, state.best_model_checkpoint)
        self.control = self.callback_handler.fire("on_save", args, state, self.control)
        return path

    def _save_model_files(self, directory: Path) -> None:
        """The model in the Hugging Face layout into `directory`; every rank calls it (gathering FSDP2 shards or
        DeepSpeed ZeRO-3 partitions is a collective), rank 0 writes."""
        full = self.deepspeed.full_state_dict() if self.deepspeed is not None else None
        save_model_files(self.model, directory, rank=self.rank, tokenizer=self.processing_class, full_state_dict=full)

    # ---- data -----------------------------------------------------------------------------------------
    def _train_loader(self, micro: int):
        return self._loader(self.train_dataset, micro, train=True)

    def _eval_loader(self, dataset):
        return self._loader(dataset, self.args.per_device_eval_batch_size, train=False)

    def _loader(self, dataset, micro: int, train: bool):
        """Micro batches of a tokenized dataset (`trainer.batching.BatchLoader`), or of `data_collator` over any
        sequence of examples, wrapped so that both shuffle deterministically and resume mid-epoch."""
        args = self.args
        if train and args.dataloader_num_workers:
            self._print(
                f"dataloader_num_workers={args.dataloader_num_workers}: batches are collated in the main "
                "process from in-memory token arrays (microseconds each); no worker processes are started"
            )
        pad_id = getattr(self.processing_class, "pad_token_id", None)
        loader = BatchLoader.from_args(
            dataset,
            args,
            micro,
            train=train,
            pad_token_id=pad_id if pad_id is not None else 0,
            rank=self.rank,
            world_size=self.world_size,
        )
        if self.data_collator is not None:

            def collate(indices, is_padding=False):
                batch = self.data_collator([dataset[i] for i in indices])
                if is_padding:  # a filler batch that keeps ranks in step: it must not train
                    batch["labels"] = torch.full_like(batch["labels"], -100)
                return batch

            loader.collate = collate
        return loader

    # ---- plumbing -------------------------------------------------------------------------------------
    def _call_model_init(self):
        params = inspect.signature(self.model_init).parameters
        model = self.model_init(None) if len(params) == 1 else self.model_init()
        if model is None:
            raise ValueError("model_init returned None")
        return model

    def _progress(self, total: int, initial: int):
        disable = self.args.disable_tqdm or self.rank != 0
        if disable:
            return _NoProgress()
        return tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True, leave=True)

    def _install_stop_signals(self) -> dict:
        """SIGTERM, or a first Ctrl-C: save a checkpoint at the end of this step, then stop. A second Ctrl-C raises
        KeyboardInterrupt at once. Returns the handlers to restore (none outside the main thread)."""
        self.stop_signal = None
        if not threading_main():
            return {}

        def handler(signum, frame):
            if signum == signal.SIGINT and self.stop_signal is not None:
                raise KeyboardInterrupt
            self.stop_signal = signal.Signals(signum)
            again = " (Ctrl-C again to abort without saving)" if signum == signal.SIGINT else ""
            self._print(f"{self.stop_signal.name}: saving a checkpoint at the end of this step, then stopping{again}")

        return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _on_disk(self) -> str:
        """What a stopped run leaves to resume from, for the user."""
        last = ckpt.latest_checkpoint(self.args.output_dir)
        if last is None:
            return "no checkpoint on disk: a new run starts from the beginning"
        return (
            f"the newest checkpoint is {last} (step {ckpt.checkpoint_step(last)}); resume with "
            "resume_from_checkpoint='auto' or that path"
        )

    def _restore_stop_signals(self, previous: dict) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def _print(self, message: str) -> None:
        if self.rank == 0:
            print(message, file=sys.stderr, flush=True)


class _NoProgress:
    disable = True

    def update(self, n=1): ...
    def close(self): ...
    def write(self, s):
        print(s, file=sys.stderr, flush=True)

    def set_postfix(self, *a, **k): ...


def threading_main() -> bool:
    return threading.current_thread() is threading.main_thread()


def _due(strategy, step: int, every: int) -> bool:
    return strategy == "steps" and every > 0 and step % every == 0
