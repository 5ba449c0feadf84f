"""Callbacks with Hugging Face's event names, state and control objects.

A callback subclasses `TrainerCallback` and overrides any of the `on_*` events; each receives
`(args, state, control, **kwargs)` (kwargs: model, optimizer, lr_scheduler, metrics, logs) and may set
flags on `control` to stop training or force a save, an evaluation or a log at the end of this step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field


@dataclass
class TrainerState:
    """What the loop knows about its progress; saved as trainer_state.json in every checkpoint."""

    global_step: int = 0
    epoch: float = 0.0
    max_steps: int = 0
    num_train_epochs: int = 0
    logging_steps: int = 500
    eval_steps: int | None = None
    save_steps: int = 500
    train_batch_size: int | None = None
    num_input_tokens_seen: int = 0
    total_flos: float = 0.0
    log_history: list = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    nonfinite_steps: int = 0
    overflow_steps: int = 0
    is_world_process_zero: bool = True
    # {report_to name: run id} of the tracking services' runs (wandb, mlflow, ...): a resume continues those runs.
    logger_run_ids: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TrainerState:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class TrainerControl:
    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def reset_step(self) -> None:
        self.should_save = self.should_evaluate = self.should_log = False


class TrainerCallback:
    """Override the events you need; every event gets (args, state, control, **kwargs)."""

    def on_init_end(self, args, state, control, **kwargs): ...
    def on_train_begin(self, args, state, control, **kwargs): ...
    def on_train_end(self, args, state, control, **kwargs): ...
    def on_epoch_begin(self, args, state, control, **kwargs): ...
    def on_epoch_end(self, args, state, control, **kwargs): ...
    def on_step_begin(self, args, state, control, **kwargs): ...
    def on_substep_end(self, args, state, control, **kwargs): ...
    def on_pre_optimizer_step(self, args, state, control, **kwargs): ...
    def on_optimizer_step(self, args, state, control, **kwargs): ...
    def on_step_end(self, args, state, control, **kwargs): ...
    def on_evaluate(self, args, state, control, **kwargs): ...
    def on_predict(self, args, state, control, **kwargs): ...
    def on_save(self, args, state, control, **kwargs): ...
    def on_log(self, args, state, control, **kwargs): ...
    def on_prediction_step(self, args, state, control, **kwargs): ...


class CallbackHandler:
    def __init__(self, callbacks=None):
        self.callbacks: list[TrainerCallback] = []
        for cb in callbacks or []:
            self.add(cb)

    def add(self, callback) -> None:
        cb = callback() if isinstance(callback, type) else callback
        if not isinstance(cb, TrainerCallback) and not any(hasattr(cb, n) for n in ("on_log", "on_step_end")):
            raise TypeError(f"callbacks: {type(cb).__name__} is not a TrainerCallback")
        self.callbacks.append(cb)

    def pop(self, callback):
        for cb in self.callbacks:
            if cb is callback or (isinstance(callback, type) and isinstance(cb, callback)):
                self.callbacks.remove(cb)
                return cb
        return None

    def remove(self, callback) -> None:
        self.pop(callback)

    def fire(self, event: str, args, state, control, **kwargs) -> TrainerControl:
        for cb in self.callbacks:
            handler = getattr(cb, event, None)
            if handler is None:
                continue
            result = handler(args, state, control, **kwargs)
            if isinstance(result, TrainerControl):  # HF lets a callback return a new control object
                control = result
        return control


class EarlyStoppingCallback(TrainerCallback):
    """Stop when `metric_for_best_model` has not improved by more than the threshold for `patience` evaluations."""

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float = 0.0):
        if early_stopping_patience < 1:
            raise ValueError("early_stopping_patience must be >= 1")
        self.patience = early_stopping_patience
        self.threshold = early_stopping_threshold
        self.bad_evals = 0
        self.best: float | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if not args.metric_for_best_model:
            raise ValueError("EarlyStoppingCallback needs metric_for_best_model (or load_best_model_at_end=True)")

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        name = args.metric_for_best_model
        key = name if name.startswith("eval_") else f"eval_{name}"
        value = (metrics or {}).get(key)
        if value is None or not math.isfinite(value):
            return
        greater = args.greater_is_better if args.greater_is_better is not None else not key.endswith("loss")
        improved = self.best is None or (
            value - self.best > self.threshold if greater else self.best - value > self.threshold
        )
        if improved:
            self.best = value
            self.bad_evals = 0
        else:
            self.bad_evals += 1
            if self.bad_evals >= self.patience:
                control.should_training_stop = True
