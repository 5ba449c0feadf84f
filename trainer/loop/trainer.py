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
  (no `.item()`, no device tensor made from a Python number; tests/trainer/loop/test_trainer.py counts them).
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
  batch stay the same, and refused otherwise (`check_resume_across_worlds`, trainer/loop/resume.py, docs/multi_gpu.md).

Where the rest lives: evaluation and prediction in trainer/loop/evaluation.py, the checkpoint directory layout in
trainer/loop/checkpoint.py, the model's files and resuming in trainer/loop/resume.py (docs/architecture.md draws the
modules).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

import kernels
from trainer.build import apply_model_settings, causal_lm, model_settings
from trainer.checkpoint_hf import to_json
from trainer.config.args import TrainingArguments
from trainer.data.batching import BatchLoader
from trainer.data.hf_datasets import eval_whole, trainer_dataset
from trainer.data.streaming import StreamLoader, is_stream, training_data
from trainer.dist import init_distributed, local_device, world
from trainer.loop import checkpoint as ckpt
from trainer.loop.callbacks import CallbackHandler, EarlyStoppingCallback, TrainerCallback, TrainerControl, TrainerState
from trainer.loop.engine import check_engine_args, start_engine
from trainer.loop.evaluation import (
    EvalPrediction,
    PredictionOutput,
    count_targets,
    forward_params,
    prediction_loop,
    track_best,
)
from trainer.loop.metrics import MetricsWriter, Throughput, device_peak_flops, format_logs, peak_memory_gb
from trainer.loop.optim import PAGED_ON_CPU, build_lr_scheduler, build_optimizer
from trainer.loop.resume import apply_checkpoint_arguments, restore_checkpoint, save_model_files, saved_arguments
from trainer.model.causal_lm import HostLabels
from trainer.model.lora import has_adapter, trainable_summary
from trainer.model.offload import ActivationOffloader, hiding_note
from trainer.model.transformers_model import TransformersModel, check_transformers_path
from trainer.parallel.transforms import apply_all, gradient_sync, is_fsdp, unwrap, uses_fsdp

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

    def training_loss(self) -> float:
        """The mean loss of this call's real updates (nan when there were none)."""
        return self.train_loss_sum / self.train_loss_steps if self.train_loss_steps else float("nan")


@dataclass
class _Window:
    """One window's numbers from forward/backward: its loss (on the device), its tokens (this rank's; with several
    processes the host sync replaces them by all ranks') and, with several processes, all ranks' tokens on the
    device."""

    loss: torch.Tensor
    tokens: int
    global_tokens: torch.Tensor | None


@dataclass
class _Run:
    """What one train() call carries from its setup to its end: the engine (which holds the model, optimizer,
    schedule and loss scale), the loader and the step counts derived from it, the TrainerState, the running sums,
    the meters and where the logs go. `windows` is optimizer steps per epoch: floor(micro batches / accumulation)."""

    engine: Any
    loader: BatchLoader
    device: torch.device
    micro: int
    accum: int
    micro_per_epoch: int
    windows: int
    max_steps: int
    num_epochs: int
    state: TrainerState | None = None
    sums: _RunningSums = field(default_factory=_RunningSums)
    writer: MetricsWriter | None = None
    progress: Any = None
    throughput: Throughput | None = None
    peak_flops: float | None = None
    flops_per_token: float | None = None
    start_time: float = 0.0
    start_step: int = 0
    start_nonfinite: int = 0
    offloader: ActivationOffloader | None = None  # activation_offloading
    offload_checked: bool = False  # whether the first offloaded forward was weighed against its compute

    @property
    def model(self) -> nn.Module:
        """What the loop calls forward on: the engine's model (DeepSpeed's engine module under DeepSpeed)."""
        return self.engine.model

    def window_size(self, window: int) -> int:
        """Micro batches in this window of the epoch: the accumulation; the epoch's last window takes the
        leftover micro batches too (see the module docstring)."""
        if window < self.windows - 1:
            return self.accum
        return self.micro_per_epoch - self.accum * (self.windows - 1)


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _full_numel(param: torch.Tensor) -> int:
    """How many weights a parameter stands for: its numel; for a 4-bit weight's packed codes (load_in_4bit), the
    unpacked count trainer/model/quant.py notes on them (`full_numel`); under DeepSpeed ZeRO-3, which leaves each rank
    an empty tensor in its place, `ds_numel`."""
    if hasattr(param, "full_numel"):
        return param.full_numel
    return param.ds_numel if hasattr(param, "ds_numel") else param.numel()


class Trainer:
    """Hugging Face's `Trainer` constructor and methods, over our loop. See the module docstring."""

    stage = "sft"  # the method (`--stage`) it trains: what the transformers path checks a model against

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
        # A `datasets` object becomes a TokenizedDataset here, every row checked, before anything is built
        train_dataset = self._prepare_dataset(train_dataset, "train_dataset")
        eval_dataset = self._prepare_dataset(eval_whole(eval_dataset), "eval_dataset")
        self.args = args
        self.model_init = model_init
        init_distributed()  # under torchrun/accelerate: join the process group (a no-op for one process)
        self.rank, self.world_size = world()
        check_engine_args(args, self.world_size)  # e.g. DeepSpeed's JSON, read before anything is built
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
        self.scaler = None  # fp16's loss scaler (PyTorch's engine), once training
        self.engine = None  # what the loop calls (trainer/loop/engine.py: PyTorch's or DeepSpeed's), once training
        self._aux_sums: list = []  # training batches' MoE load-balancing losses (device scalars) since the last log
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
        args.resolve_world(self.world_size)  # gradient_accumulation_steps from global_batch_size, for this world
        while True:
            try:
                return self._train_loop(resume)
            except torch.OutOfMemoryError:
                if not args.auto_find_batch_size or args.per_device_train_batch_size == 1:
                    raise
                # Half the micro batch, twice the accumulation: the global batch (and the run) stays the same.
                # The arguments are updated so training_args.json records what actually ran.
                micro, accum = args.halve_micro_batch(self.world_size)
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
        dataset = self._prepare_dataset(eval_whole(dataset), "eval_dataset")
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
        return self._prediction_loop(
            self._prepare_dataset(test_dataset, "test_dataset"), metric_key_prefix, want_predictions=True
        )

    def _prediction_loop(self, dataset, prefix: str, want_predictions: bool) -> PredictionOutput:
        """trainer.loop.evaluation.prediction_loop over `dataset` with the model in eval mode (and back to train mode
        after, when it was training)."""
        model = self.model
        device = self._device(model)
        was_training = unwrap(model).training  # a DeepSpeed engine's own flag stays True through eval()
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
        # -- setup: model transforms, data, the engine (optimizer, schedule, loss scale), state, resume, logs
        run = self._start_run(resume)
        args, state = self.args, run.state
        previous_handlers = self._install_stop_signals()
        self._fire("on_train_begin", model=run.model)
        if args.eval_on_start and self.eval_dataset is not None and resume is None:
            self._evaluate_and_track(run, log=False)
        # A run resumed at or past max_steps trains nothing (the epoch loop is empty).
        start_epoch = run.num_epochs if state.global_step >= run.max_steps else state.global_step // run.windows

        # -- train: for each epoch, for each window of micro batches, one optimizer step
        try:
            for epoch in range(start_epoch, run.num_epochs):
                first_window = state.global_step - epoch * run.windows
                if first_window == 0:  # a fresh epoch; mid-epoch, the restored loader state goes on where it was
                    run.loader.set_epoch(epoch)
                batches = iter(run.loader)
                self._fire("on_epoch_begin")
                for window in range(first_window, run.windows):
                    micro_batches = [next(batches) for _ in range(run.window_size(window))]
                    self._fire("on_step_begin")
                    # 1-2. forward/backward over the window, then clip and step (or skip): the step's one host sync
                    learning_rate, tokens = self._train_step(run, micro_batches)
                    state.global_step += 1
                    state.epoch = epoch + (window + 1) / run.windows
                    if run.flops_per_token:
                        state.total_flos += run.flops_per_token * tokens
                    run.progress.update(1)
                    every = args.torch_empty_cache_steps
                    if every and state.global_step % every == 0 and run.device.type == "cuda":
                        torch.cuda.empty_cache()
                    self._fire("on_step_end", model=run.model)

                    # 3. log / evaluate / save on schedule
                    self._mark_due(run)
                    if self.control.should_log:
                        self._log_training(run, learning_rate)
                    self._maybe_evaluate_and_save(run)
                    if self.control.should_training_stop or self.control.should_epoch_stop:
                        break
                self.control.should_epoch_stop = False
                self._fire("on_epoch_end")
                if args.eval_strategy == "epoch":
                    self.control.should_evaluate = True
                if args.save_strategy == "epoch":
                    self.control.should_save = True
                self._maybe_evaluate_and_save(run)
                if self.control.should_training_stop:
                    break

            # -- end: Hugging Face's end-of-training metrics, over what this call trained
            metrics = self._end_metrics(run)
        except KeyboardInterrupt:  # a second Ctrl-C: no checkpoint of this point
            self._print(f"aborted by a second Ctrl-C after step {state.global_step}, without saving; {self._on_disk()}")
            raise
        finally:
            run.progress.close()
            self._restore_stop_signals(previous_handlers)
            run.writer.close()
        self._check_the_end(run)
        if args.load_best_model_at_end and state.best_model_checkpoint and self.stop_signal is None:
            run.engine.load_checkpoint(Path(state.best_model_checkpoint), weights_only=True)
            self._print(
                f"loaded the best model from {state.best_model_checkpoint} ({args.metric_for_best_model}="
                f"{state.best_metric})"
            )
        self._fire("on_train_end", model=run.model)
        return TrainOutput(state.global_step, run.sums.training_loss(), metrics)

    # ---- setup ----------------------------------------------------------------------------------------
    def _start_run(self, resume: Path | None) -> _Run:
        """The run's model (transformed), train loader, step counts, engine and TrainerState, restored from
        `resume` when given; then the writer, the meters, the run summary and the progress bar."""
        args = self.args
        micro = args.per_device_train_batch_size
        if self.train_dataset is None:
            raise ValueError("Trainer.train: no train_dataset")
        self.train_dataset = self._prepare_dataset(self.train_dataset, "train_dataset")  # one set after __init__
        if self.optimizer is not None and uses_fsdp(args) and not is_fsdp(self.model):
            raise ValueError(
                "optimizers: FSDP2 replaces the parameters with sharded ones, so the optimizer must be "
                "built after sharding; pass optimizers=(None, scheduler-or-None) with dist_config fsdp2"
            )
        # LoRA -> activation checkpointing -> per-block compile -> FSDP2/DDP, before the optimizer is built (it must
        # see only the adapter as trainable, and FSDP2's sharded parameters); a model from trainer.build.build_model
        # has them already (apply_all is idempotent)
        self.model = apply_all(self.model, args)
        device = self._device(self.model)
        loader = self._train_loader(micro)
        micro_per_epoch = len(loader)  # at least 1: BatchLoader refuses a plan with none
        windows = args.steps_per_epoch(micro_per_epoch)  # floor(micro batches / accum), at least 1
        max_steps = args.get_max_steps(micro_per_epoch)
        engine = self._start_engine(device, max_steps)
        offloader = ActivationOffloader.for_model(unwrap(engine.model), device) if args.activation_offloading else None
        run = _Run(
            offloader=offloader,
            engine=engine,
            loader=loader,
            device=device,
            micro=micro,
            accum=args.gradient_accumulation_steps,
            micro_per_epoch=micro_per_epoch,
            windows=windows,
            max_steps=max_steps,
            num_epochs=math.ceil(max_steps / windows),
        )
        every = args.resolve_steps(max_steps)
        run.state = TrainerState(
            max_steps=max_steps,
            num_train_epochs=run.num_epochs,
            is_world_process_zero=self.rank == 0,
            train_batch_size=micro,
            logging_steps=every["logging_steps"],
            eval_steps=every["eval_steps"] or every["logging_steps"],
            save_steps=every["save_steps"],
        )
        if resume is not None:
            self._resume(run, resume)
        self.state = run.state
        self.control = TrainerControl()
        self._open_outputs(run, resume)
        return run

    def _start_engine(self, device: torch.device, max_steps: int):
        """The engine (trainer/loop/engine.py) over the Trainer's optimizer and schedule where it has them (given to the
        constructor, or kept from an earlier train()), built where not; Hugging Face's attributes then name what
        it runs (under DeepSpeed `model` is its engine, around the model)."""
        args = self.args
        if self.optimizer is None and args.optim == "paged_adamw_8bit" and device.type == "cpu":
            self._print(PAGED_ON_CPU)
        engine = self.engine = start_engine(
            self.model,
            args,
            running=self.engine,
            device=device,
            rank=self.rank,
            world_size=self.world_size,
            max_steps=max_steps,
            make_optimizer=lambda model: self.optimizer if self.optimizer is not None else build_optimizer(model, args),
            make_scheduler=lambda optimizer: (
                self.lr_scheduler if self.lr_scheduler is not None else build_lr_scheduler(optimizer, args, max_steps)
            ),
            scaler=self.scaler,
        )
        self.model, self.optimizer, self.lr_scheduler = engine.model, engine.optimizer, engine.scheduler
        self.scaler = engine.scaler
        return engine

    def _resume(self, run: _Run, resume: Path) -> None:
        """The checkpoint's state into the run (trainer/loop/resume.py), and what it changed, in lines for the user."""
        args = self.args
        restored = restore_checkpoint(
            resume,
            engine=run.engine,
            loader=run.loader,
            args=args,
            rank=self.rank,
            world_size=self.world_size,
            micro=run.micro,
            accum=run.accum,
            windows_per_epoch=run.windows,
        )
        run.state = TrainerState.from_dict(
            {**restored["trainer_state"], "max_steps": run.max_steps, "num_train_epochs": run.num_epochs}
        )
        self._load_method_state(run, restored["method_state"], resume)
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
        step = run.state.global_step
        self._print(f"resumed from {resume} at step {step}")
        if step >= run.max_steps:
            self._print(
                f"resume_from_checkpoint: {resume} is at step {step} and max_steps is "
                f"{run.max_steps}: nothing left to train; the weights are the checkpoint's"
            )

    def _open_outputs(self, run: _Run, resume: Path | None) -> None:
        """The metrics writer, the throughput and MFU meters, the run summary and the progress bar."""
        args, state = self.args, run.state
        run.writer = MetricsWriter(
            args.output_dir,
            args.report_to,
            args.logging_dir,
            enabled=self.rank == 0,
            run_name=args.run_name,
            config=args.to_dict(),
            run_ids=state.logger_run_ids,
            resumed_step=state.global_step if resume is not None else None,
        )
        state.logger_run_ids = run.writer.run_ids  # saved in every checkpoint: a resume logs to the same runs
        run.throughput = Throughput()
        run.peak_flops = device_peak_flops(run.device)
        run.flops_per_token = self._flops_per_token(run.model)
        self._print_run_summary(run)
        run.start_time, run.start_step = time.perf_counter(), state.global_step
        run.start_nonfinite = state.nonfinite_steps
        run.progress = self._progress(run.max_steps, state.global_step)

    # ---- one step -------------------------------------------------------------------------------------
    def _train_step(self, run: _Run, micro_batches: list) -> tuple[float, int]:
        """One optimizer step over a window of micro batches: forward/backward of each, then the engine's clip and
        step, or skip of a non-finite (or fp16-overflowing) update. Returns the learning rate this step used and the
        window's tokens (over all ranks with several)."""
        window = self._forward_backward(run, micro_batches)
        # The rate this step uses, read before the scheduler moves on: what Hugging Face logs.
        learning_rate = run.engine.scheduler.get_last_lr()[0]
        update = run.engine.step(
            functools.partial(self._host_numbers, run, window), lambda: self._fire("on_pre_optimizer_step")
        )
        self._count_update(run, update)
        self._fire("on_optimizer_step")
        return learning_rate, window.tokens

    def _forward_backward(self, run: _Run, micro_batches: list) -> _Window:
        """Forward and backward of every micro batch of a window, gradients accumulated in `.grad`. Returns the
        window's loss (on the device), its tokens (this rank's, on the host) and, with several processes, the
        window's tokens over all ranks (on the device; the loss is then the sum over all ranks too)."""
        model, device = run.model, run.device
        num_items = self._loss_normaliser(micro_batches, device)
        model.train()
        window_loss = torch.zeros((), device=device, dtype=torch.float32)
        window_tokens = 0
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            # Gradients are reduced across ranks once per window, in the last micro step's backward.
            with gradient_sync(model, last):
                with self._autocast(device, train=True), run.offloader() if run.offloader else contextlib.nullcontext():
                    loss = self._compute_loss(model, batch, num_items, device)
                run.engine.backward(loss, last)
            window_loss += loss.detach().float()
            if not last:
                self._fire("on_substep_end")
            tokens = int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()
            if run.offloader and not run.offload_checked and run.peak_flops and run.flops_per_token:
                run.offload_checked = True
                note = hiding_note(run.offloader.offloaded_bytes, tokens, run.flops_per_token, run.peak_flops)
                if note:
                    self._print(note)
            run.throughput.add(tokens, count_targets(batch["labels"]))  # on the host copy of the labels
            window_tokens += tokens
        return self._window(window_loss, window_tokens, device)

    def _window(self, window_loss: torch.Tensor, window_tokens: int, device) -> _Window:
        """The window's numbers: with several processes each rank holds its share of the loss and tokens, and the
        sums over all ranks are logged, the loss divided by world_size (_loss_normaliser). float64 counts tokens
        exactly."""
        if self.world_size == 1:
            return _Window(window_loss, window_tokens, None)
        totals = torch.stack(
            [window_loss.double(), torch.full((), float(window_tokens), dtype=torch.float64, device=device)]
        )
        torch.distributed.all_reduce(totals)
        return _Window(totals[0] / self.world_size, window_tokens, totals[1])

    def _host_numbers(self, run: _Run, window: _Window, grad_norm) -> tuple[float, float | None]:
        """The step's one host sync: one copy of every number the host needs, (loss, gradient norm); with several
        processes the window's tokens over all ranks too, which then replace this rank's in `window.tokens`; they
        count into num_input_tokens_seen. `.to(device)`: FSDP2 with offloaded parameters, and DeepSpeed, have the
        norm on the CPU; DeepSpeed may have none (stage 0 without clipping)."""
        on_device = (
            [window.loss]
            + ([grad_norm] if grad_norm is not None else [])
            + ([window.global_tokens] if window.global_tokens is not None else [])
        )
        host = torch.stack([t.to(run.device, torch.float64) for t in on_device]).tolist()
        loss_value = host.pop(0)
        grad_norm_value = host.pop(0) if grad_norm is not None else None
        if window.global_tokens is not None:
            window.tokens = int(host.pop(0))
        run.state.num_input_tokens_seen += window.tokens
        return loss_value, grad_norm_value

    def _count_update(self, run: _Run, update: tuple) -> None:
        """What the engine's step did, into the running sums and the state: a real update's loss and gradient norm
        to log, a skipped non-finite one counted (and `max_nonfinite_steps` of them in a row stop the run), an fp16
        overflow counted."""
        args, state, sums = self.args, run.state, run.sums
        loss, grad_norm, stepped, finite, overflow = update
        if overflow:
            state.overflow_steps += 1
        if stepped:
            sums.nonfinite_in_row = 0
            sums.logged_loss += loss
            sums.logged_steps += 1
            sums.train_loss_sum += loss
            sums.train_loss_steps += 1
            sums.last_grad_norm = grad_norm
        elif not finite:
            state.nonfinite_steps += 1
            sums.nonfinite_in_row += 1
            self._print(
                f"step {state.global_step + 1}: non-finite loss ({loss}) or grad_norm ({grad_norm}); update skipped"
            )
            if sums.nonfinite_in_row >= args.max_nonfinite_steps:
                last = ckpt.latest_checkpoint(args.output_dir)
                raise TrainingError(
                    f"{sums.nonfinite_in_row} non-finite steps in a row (max_nonfinite_steps="
                    f"{args.max_nonfinite_steps}); stopping. Last good checkpoint: {last or 'none saved'}"
                )

    # ---- after a step ---------------------------------------------------------------------------------
    def _mark_due(self, run: _Run) -> None:
        """Is a log, an evaluation, a save or the end due after this step? Set in `self.control`, where callbacks
        may have set some already (on_step_end)."""
        args, state = self.args, run.state
        step = state.global_step
        if _due(args.logging_strategy, step, state.logging_steps) or (args.logging_first_step and step == 1):
            self.control.should_log = True
        if _due(args.eval_strategy, step, state.eval_steps) and step >= (args.eval_delay or 0):
            self.control.should_evaluate = True
        # No scheduled save inside a run of non-finite steps: the newest checkpoint stays the last good one.
        if args.save_strategy == "steps" and step % state.save_steps == 0 and not run.sums.nonfinite_in_row:
            self.control.should_save = True
        if step >= run.max_steps:
            self.control.should_training_stop = True
        if self.stop_signal is not None:  # SIGTERM or a first Ctrl-C: save this step, then stop
            self.control.should_save = True
            self.control.should_training_stop = True

    def _log_training(self, run: _Run, learning_rate: float) -> None:
        """The training log line: the mean loss of the steps since the last log, the last gradient norm, the
        learning rate, the throughput since the last log, MFU and memory; then the sums start over."""
        state, sums = run.state, run.sums
        # Skipped (non-finite) steps are not averaged in; a window of only skipped steps logs no loss.
        logs = {
            "loss": sums.logged_loss / sums.logged_steps if sums.logged_steps else None,
            "grad_norm": sums.last_grad_norm,
            "learning_rate": learning_rate,
            **self._take_aux_loss(),
            **self._extra_logs(),
        }
        speed = run.throughput.mark()
        logs.update(speed)
        if run.peak_flops and run.flops_per_token:
            # tokens_per_second counts this rank's tokens, so this is already the per-device MFU.
            logs["mfu"] = run.flops_per_token * speed["tokens_per_second"] / run.peak_flops
        logs["peak_memory_gb"] = peak_memory_gb(run.device)
        if self.args.include_num_input_tokens_seen:
            logs["num_input_tokens_seen"] = state.num_input_tokens_seen
        if state.nonfinite_steps or state.overflow_steps:
            logs["skipped_steps"] = state.nonfinite_steps + state.overflow_steps
        self._log(run, logs)
        sums.logged_loss, sums.logged_steps, sums.last_grad_norm = 0.0, 0, None

    def _record_aux_loss(self, out) -> None:
        """A training forward's MoE load-balancing loss (our MoE models' `aux_loss`), for `_take_aux_loss`."""
        aux = out.get("aux_loss") if isinstance(out, dict) else None
        if aux is not None and torch.is_grad_enabled():
            self._aux_sums.append(aux.detach())

    def _take_aux_loss(self) -> dict:
        """{"aux_loss": the mean load-balancing loss of the training batches since the last log, over all ranks} for
        our MoE models with output_router_logits (its term is inside `loss` already, as transformers adds it; TRL logs
        it as aux_loss too), else {}; one host copy, at logging steps only."""
        if not self._aux_sums:
            return {}
        values = torch.stack(self._aux_sums).double()
        sums = torch.stack([values.sum(), torch.full_like(values[0], len(values))])  # a fill: no host copy
        self._aux_sums = []
        if self.world_size > 1:
            torch.distributed.all_reduce(sums)
        total, count = sums.tolist()
        return {"aux_loss": total / count}

    def _extra_logs(self) -> dict:
        """What a trainer built on this loop adds to each training log (trainer/methods/preference.py: TRL's
        metrics)."""
        return {}

    # ---- the end --------------------------------------------------------------------------------------
    def _end_metrics(self, run: _Run) -> dict:
        """Hugging Face's end-of-training metrics, logged unless a signal stopped the run (it is not at its end:
        its resume logs them, once)."""
        args, state = self.args, run.state
        runtime = time.perf_counter() - run.start_time
        steps_trained = state.global_step - run.start_step
        # Deliberate differences: after a resume HF divides the new steps' losses by the whole run's global_step
        # and counts the whole run's samples and steps against this call's runtime; here all three cover this
        # call's steps only.
        samples_trained = steps_trained * args.total_train_batch_size(self.world_size)
        metrics = {
            "train_runtime": runtime,
            "train_samples_per_second": samples_trained / max(runtime, 1e-9),
            "train_steps_per_second": steps_trained / max(runtime, 1e-9),
            "total_flos": state.total_flos,
            "train_loss": run.sums.training_loss() if run.sums.train_loss_steps else None,
        }
        if self.stop_signal is None:
            self._log(run, metrics)
        return metrics

    def _check_the_end(self, run: _Run) -> None:
        """Say where a stopped run stands; refuse, in one line, a run whose every step was skipped."""
        state = run.state
        steps_trained = state.global_step - run.start_step
        if self.stop_signal is not None:
            self._print(f"{self.stop_signal.name}: stopped at step {state.global_step}; {self._on_disk()}")
        elif steps_trained and state.nonfinite_steps - run.start_nonfinite == steps_trained:
            # Every step was skipped: the weights are the starting ones, and a caller saving them as "the trained
            # model" would replace a good model with an untrained one (transformers goes on and saves it).
            raise TrainingError(
                f"training failed: all {steps_trained} steps had a non-finite loss or gradient norm, "
                f"so no update reached the weights (lower the learning rate, check the data, or try "
                f"bf16 instead of fp16); {self._on_disk()}"
            )

    def _print_run_summary(self, run: _Run) -> None:
        """Hugging Face's `***** Running training *****` block, plus one line of ours spelling out the global batch."""
        micro, accum, world_size = run.micro, run.accum, self.world_size
        sizes = [(_full_numel(p), p.requires_grad) for p in run.model.parameters()]  # tied: once
        trainable, total = sum(n for n, grad in sizes if grad), sum(n for n, _ in sizes)
        processes = f"{world_size} process{'es' if world_size > 1 else ''}"
        examples = "a stream" if is_stream(self.train_dataset) else f"{len(self.train_dataset):,}"
        if run.loader.max_tokens is not None:  # token-budget batching: a micro batch is a token count, not a row count
            global_batch = (
                f"{processes} x micro batches of up to {run.loader.max_tokens:,} tokens x {accum} accumulation "
                f"= {world_size * accum} micro batches per step"
            )
        else:
            global_batch = (
                f"{processes} x {micro} micro batch x {accum} accumulation = "
                f"{world_size * micro * accum} sequences per step"
            )
        self._print(
            "\n".join(
                [
                    "***** Running training *****",
                    f"  Num examples = {examples}",
                    f"  Num Epochs = {run.num_epochs:,}",
                    f"  Instantaneous batch size per device = {micro:,}",
                    f"  Total train batch size (w. parallel, distributed & accumulation) = "
                    f"{self.args.total_train_batch_size(world_size):,}",
                    f"  Gradient Accumulation steps = {accum}",
                    f"  Total optimization steps = {run.max_steps:,}",
                    f"  Number of trainable parameters = {trainable:,}",
                    f"  Global batch = {global_batch}",
                ]
                + ([trainable_summary(trainable, total)] if has_adapter(unwrap(run.model)) else [])
            )
        )

    # ---- pieces of the loop -----------------------------------------------------------------------------
    def _device(self, model) -> torch.device:
        """Where batches go: this rank's device with several processes (FSDP2 with offload_params keeps the
        shards on the CPU, but computes on the accelerator), else wherever the model's parameters are."""
        return local_device() if self.world_size > 1 else _model_device(model)

    def _fire(self, event: str, **kwargs) -> None:
        """Call every callback's `event` with the arguments, the state and the control (which it may change)."""
        self.control = self.callback_handler.fire(event, self.args, self.state, self.control, **kwargs)

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
            # passes untouched (tests/trainer/parallel/test_distributed.py: test_fsdp2_loss_skips_ignored_rows)
            kwargs["labels"] = HostLabels(kwargs["labels"])
        out = model(**kwargs)
        loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
        self._record_aux_loss(out)
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
        wrapped = unwrap(model)
        if ours is not None:
            settings = model_settings(args)
            if any(getattr(ours, name) != value for name, value in settings.items()):
                apply_model_settings(ours, settings)
        elif isinstance(wrapped, TransformersModel):  # the transformers path: the loss's settings are ours
            check_transformers_path(args)
            if wrapped.router_aux_loss_coef != args.router_aux_loss_coef:
                wrapped.router_aux_loss_coef = args.router_aux_loss_coef
            wrapped.check_stage(self.stage)
            wrapped.label_smoothing, wrapped.z_loss = args.label_smoothing_factor, args.z_loss
            wrapped.neftune_noise_alpha = args.neftune_noise_alpha
            if wrapped.tiled_mlp != args.tiled_mlp:
                wrapped.tiled_mlp = args.tiled_mlp
        else:
            name = type(model).__name__
            if args.neftune_noise_alpha:
                raise ValueError(
                    f"neftune_noise_alpha: a {name} has no trainer.model.causal_lm.CausalLM inside to add the "
                    "noise; leave it unset for this model"
                )
            if args.use_liger_kernel:
                raise ValueError(
                    f"use_liger_kernel: a {name} has no trainer.model.causal_lm.CausalLM inside to run "
                    "liger-kernel's ops; leave it off for this model"
                )
            if args.tiled_mlp:
                raise ValueError(
                    f"tiled_mlp: a {name} has no trainer.model.causal_lm.CausalLM inside whose MLPs could run in "
                    "tiles; leave it off for this model"
                )
            if args.router_aux_loss_coef is not None:
                raise ValueError(
                    f"router_aux_loss_coef: a {name} has no trainer.model.causal_lm.CausalLM inside to add the "
                    "router loss to; set output_router_logits and router_aux_loss_coef in its config instead"
                )
            accepted = forward_params(model)
            if (args.label_smoothing_factor or z_loss) and ("labels" in accepted or "**" in accepted):
                raise ValueError(
                    f"label_smoothing_factor/z_loss: a {name} computes its own loss from labels, which "
                    "would ignore them; use trainer.model.causal_lm.CausalLM or a model whose forward returns logits"
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

    def _flops_per_token(self, model) -> float | None:
        fn = getattr(unwrap(model), "flops_per_token", None)
        flops = None if fn is None else fn(self.args.cutoff_len)  # None: a model that does not count them
        return None if flops is None else float(flops)

    def _log(self, run: _Run, logs: dict) -> None:
        state, progress = run.state, run.progress
        logs = {"epoch": round(state.epoch, 4), **{k: v for k, v in logs.items() if v is not None}}
        state.log_history.append({**logs, "step": state.global_step})
        run.writer.write(logs, state.global_step)
        self._fire("on_log", logs=logs)
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

    def _maybe_evaluate_and_save(self, run: _Run) -> None:
        args, state = self.args, run.state
        metrics = None
        if self.control.should_evaluate and self.eval_dataset is not None:
            metrics = self._evaluate_and_track(run, log=True)
        if args.save_strategy == "best" and metrics is not None and state.best_global_step == state.global_step:
            self.control.should_save = True
        if self.control.should_save and (args.save_strategy != "no" or self.stop_signal is not None):
            self._save_checkpoint(run)
        self.control.reset_step()

    def _evaluate_and_track(self, run: _Run, log: bool) -> dict:
        """Evaluate, log the metrics (not the evaluation before the first step, eval_on_start), track the best."""
        metrics = self.evaluate()
        if log:
            self._log(run, metrics)
        track_best(run.state, metrics, self.args)
        self._fire("on_evaluate", metrics=metrics)
        return metrics

    def _save_checkpoint(self, run: _Run) -> Path:
        args, state = self.args, run.state
        path = ckpt.save_checkpoint(
            args.output_dir,
            state.global_step,
            save_model=self._save_model_files,
            save_engine=run.engine.save_checkpoint,
            data_state=run.loader.state_dict(),
            method_state=self._method_state(run),
            trainer_state=state.to_dict(),
            args_dict=args.to_dict(),
            rank=self.rank,
            world_size=self.world_size,
            save_only_model=args.save_only_model,
        )
        if self.rank == 0:
            ckpt.rotate_checkpoints(args.output_dir, args.save_total_limit, state.best_model_checkpoint)
        self._fire("on_save")
        return path

    def _method_state(self, run: _Run) -> dict | None:
        """What a method carries from one optimizer step to the next that a checkpoint must hold (a dict of tensors,
        alike on every rank; GRPO's buffered generation inside its cycle); the Trainer's own steps carry nothing."""
        return None

    def _load_method_state(self, run: _Run, state: dict | None, resume: Path) -> None:
        """`_method_state`'s dict (None when the checkpoint has none) back into the method, after the rest of the
        checkpoint is restored."""

    def _save_model_files(self, directory: Path) -> None:
        """The model in the Hugging Face layout into `directory`; every rank calls it (gathering FSDP2 shards or
        DeepSpeed ZeRO-3 partitions is a collective), rank 0 writes."""
        full = self.engine.full_state_dict() if self.engine is not None else None
        save_model_files(self.model, directory, rank=self.rank, tokenizer=self.processing_class, full_state_dict=full)

    # ---- data -----------------------------------------------------------------------------------------
    def _prepare_dataset(self, dataset, name: str):
        """`dataset` as the loaders take it: a Hugging Face `datasets.Dataset` of tokens converted once and checked
        row by row, a raw one refused in one line (trainer/data/hf_datasets.py); anything else as it is."""
        return training_data(dataset, name) if name == "train_dataset" else trainer_dataset(dataset, name)

    def _train_loader(self, micro: int):
        return self._loader(self.train_dataset, micro, train=True)

    def _eval_loader(self, dataset):
        return self._loader(dataset, self.args.per_device_eval_batch_size, train=False)

    def _loader(self, dataset, micro: int, train: bool):
        """Micro batches of a tokenized dataset (`trainer.data.batching.BatchLoader`), or of `data_collator` over any
        sequence of examples, wrapped so that both shuffle deterministically and resume mid-epoch."""
        args = self.args
        if train and args.dataloader_num_workers:
            self._print(
                f"dataloader_num_workers={args.dataloader_num_workers}: batches are collated in the main "
                "process from in-memory token arrays (microseconds each); no worker processes are started"
            )
        pad_id = getattr(self.processing_class, "pad_token_id", None)
        if is_stream(dataset):  # trainer.data.streaming: read, tokenised and batched as training goes
            if not train or self.data_collator is not None:
                what = "data_collator" if train else "an eval_dataset"
                raise ValueError(
                    f"{what} with a streamed dataset: not supported (a stream is batched by its own loader, for "
                    "training); give the eval data as a datasets.Dataset or a tokenized dataset"
                )
            return StreamLoader.from_args(
                dataset,
                args,
                micro,
                pad_token_id=pad_id if pad_id is not None else 0,
                rank=self.rank,
                world_size=self.world_size,
            )
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
