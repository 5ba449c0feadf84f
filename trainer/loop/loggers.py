"""Experiment loggers: where the loop's log dicts go, one backend per `report_to` name.

Every backend has the same small interface: `log(logs, step)` sends one dict of metrics at an optimizer step,
`finish()` closes the run, and `run_id` names the tracking service's run (None for the file loggers). The loop
saves the run ids in `trainer_state.json` (`TrainerState.logger_run_ids`) and passes them back when it resumes,
so a resumed run continues the same logged run instead of starting a new one.

  jsonl        output_dir/metrics.jsonl, one {"step", ...} object per line (ours; always available)
  tensorboard  torch.utils.tensorboard.SummaryWriter in logging_dir (scalars only)
  wandb        wandb.init(project=$WANDB_PROJECT or "huggingface", name=run_name, config=the arguments);
               resumes with id=<saved id>, resume="allow". wandb itself reads WANDB_MODE (offline, disabled),
               WANDB_DIR, WANDB_ENTITY, WANDB_API_KEY. Keys are logged as transformers does: eval_x -> eval/x,
               everything else train/x, against a train/global_step axis.
  mlflow       tracking URI $MLFLOW_TRACKING_URI (else mlflow's default), experiment $MLFLOW_EXPERIMENT_NAME,
               run_name; the arguments are logged as params (values over 250 characters dropped, as transformers
               does) on a new run only, since MLflow params cannot change; resumes with start_run(run_id=<saved>).
               $MLFLOW_TAGS (a JSON object) sets tags; a run the user started beforehand is used and left open.
  swanlab      swanlab.init(project=$SWANLAB_PROJECT, experiment_name=run_name, config); resumes with
               id=<saved id>, resume="allow". swanlab reads SWANLAB_MODE (cloud, local, offline, disabled).
  trackio      trackio.init(project="huggingface" (transformers' default `project`), name=run_name, config,
               resume="allow"); trackio names runs by their name, so that is the id kept for a resume. trackio is
               local unless TRACKIO_SPACE_ID is set.

Each service's package is imported when its logger opens (a guarded optional dependency); whether it is
installed is checked earlier, when the arguments are validated (`trainer.config.args`), so a missing package is one
line and exit 2 before any expensive work. A service that cannot start its run (wandb without a login in a
non-interactive shell, an unreachable MLflow server) is one line too, exit 2, when the loop opens its loggers.
`open_logger` is called on rank 0 only.

Test: `python -m pytest tests/trainer/loop/test_loggers.py -q` (wandb offline and MLflow's file store for real;
SwanLab and Trackio through stand-in modules that record the calls).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

from trainer.checkpoint_hf import to_json
from trainer.coerce import ConfigError
from trainer.config.args import LOGGER_PACKAGES

# transformers' MLflowCallback drops parameter values longer than this (MLflow rejects them).
_MLFLOW_MAX_PARAM_LENGTH = 250
# MLflow accepts at most 100 params per log_params call.
_MLFLOW_PARAMS_PER_CALL = 100
# transformers' default `project` for Trackio.
_TRACKIO_PROJECT = "huggingface"


def _import(name: str) -> Any:
    try:
        return importlib.import_module(LOGGER_PACKAGES[name])
    except ImportError as e:
        raise ImportError(f"report_to={name}: cannot import {LOGGER_PACKAGES[name]} ({e})") from e


def _scalars(logs: dict) -> dict[str, float]:
    """The finite numbers in `logs` (services log scalars; strings, None and NaN/Inf are left out)."""
    return {
        k: v for k, v in logs.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def _hf_keys(logs: dict, step: int) -> dict:
    """transformers' `rewrite_logs` for wandb/SwanLab: eval_x -> eval/x, test_x -> test/x, x -> train/x, plus
    the step as train/global_step."""
    out = {}
    for key, value in logs.items():
        for prefix in ("eval", "test"):
            if key.startswith(prefix + "_"):
                out[f"{prefix}/{key[len(prefix) + 1 :]}"] = value
                break
        else:
            out[f"train/{key}"] = value
    out["train/global_step"] = step
    return out


class JsonlLogger:
    """output_dir/metrics.jsonl, which reads as one unbroken run: a run resumed at `resumed_step` first drops the
    rows past that step (logged after the checkpoint by the run that was stopped, which this run logs again; and a
    line torn by a kill), rewriting the file atomically; a fresh run never appends to an earlier run's file, it
    moves it aside to metrics.<n>.jsonl (the first free n) and says so."""

    run_id = None

    def __init__(self, output_dir: str | Path, resumed_step: int | None = None):
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "metrics.jsonl"
        if path.exists() and resumed_step is not None:
            _truncate_after(path, resumed_step)
        elif path.exists():
            n = 1
            while (out / f"metrics.{n}.jsonl").exists():
                n += 1
            aside = out / f"metrics.{n}.jsonl"
            os.replace(path, aside)
            print(
                f"metrics.jsonl: {out} held an earlier run's metrics; moved them to {aside.name}",
                file=sys.stderr,
                flush=True,
            )
        self.file = path.open("a")

    def log(self, logs: dict, step: int) -> None:
        self.file.write(to_json({"step": step, **logs}) + "\n")
        self.file.flush()

    def finish(self) -> None:
        self.file.close()


def _truncate_after(path: Path, step: int) -> None:
    """Keep the rows of a metrics.jsonl up to `step` (and drop a torn, unreadable line); replace the file atomically."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("step", 0) <= step:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


class TensorBoardLogger:
    run_id = None

    def __init__(self, logging_dir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(f"report_to=tensorboard: cannot import tensorboard ({e})") from e
        self.writer = SummaryWriter(log_dir=str(logging_dir))

    def log(self, logs: dict, step: int) -> None:
        for key, value in _scalars(logs).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, run_name: str | None, config: dict, run_id: str | None):
        self.wandb = _import("wandb")
        resume = {"id": run_id, "resume": "allow"} if run_id else {}
        self.run = self.wandb.init(
            project=os.getenv("WANDB_PROJECT", "huggingface"), name=run_name, config=config, **resume
        )
        self.run_id = self.run.id
        self.run.define_metric("train/global_step")
        self.run.define_metric("*", step_metric="train/global_step", step_sync=True)

    def log(self, logs: dict, step: int) -> None:
        self.run.log(_hf_keys(_scalars(logs), step))

    def finish(self) -> None:
        self.run.finish()


class MlflowLogger:
    def __init__(self, run_name: str | None, config: dict, run_id: str | None):
        self.mlflow = mlflow = _import("mlflow")
        tracking_uri = os.getenv("MLFLOW_TRACKING_URI")
        if tracking_uri:
            mlflow.set_tracking_uri(tracking_uri)
        active = mlflow.active_run()
        self.owns_run = active is None or (run_id is not None and active.info.run_id != run_id)
        if self.owns_run:
            experiment = os.getenv("MLFLOW_EXPERIMENT_NAME")
            if experiment:
                mlflow.set_experiment(experiment)  # creates it when it does not exist
            active = mlflow.start_run(run_id=run_id, run_name=None if run_id else run_name)
        self.run_id = active.info.run_id
        if run_id is None:  # params are immutable in MLflow: a resumed run keeps the ones it started with
            params = [(k, v) for k, v in config.items() if len(str(v)) <= _MLFLOW_MAX_PARAM_LENGTH]
            for i in range(0, len(params), _MLFLOW_PARAMS_PER_CALL):
                mlflow.log_params(dict(params[i : i + _MLFLOW_PARAMS_PER_CALL]))
            tags = os.getenv("MLFLOW_TAGS")
            if tags:
                mlflow.set_tags(json.loads(tags))

    def log(self, logs: dict, step: int) -> None:
        # MLflow metric names allow letters, digits and _-. :/ only (transformers sanitises the same way).
        metrics = {re.sub(r"[^0-9A-Za-z_\-. :/]", "_", k): v for k, v in _scalars(logs).items()}
        self.mlflow.log_metrics(metrics, step=step)

    def finish(self) -> None:
        if self.owns_run:
            self.mlflow.end_run()


class SwanlabLogger:
    def __init__(self, run_name: str | None, config: dict, run_id: str | None):
        self.swanlab = _import("swanlab")
        resume = {"id": run_id, "resume": "allow"} if run_id else {}
        self.run = self.swanlab.init(
            project=os.getenv("SWANLAB_PROJECT"), experiment_name=run_name, config=config, **resume
        )
        self.run_id = self.run.public.run_id

    def log(self, logs: dict, step: int) -> None:
        self.swanlab.log(_hf_keys(_scalars(logs), step), step=step)

    def finish(self) -> None:
        self.swanlab.finish()


class TrackioLogger:
    def __init__(self, run_name: str | None, config: dict, run_id: str | None):
        self.trackio = _import("trackio")
        self.run = self.trackio.init(project=_TRACKIO_PROJECT, name=run_id or run_name, config=config, resume="allow")
        self.run_id = self.run.name

    def log(self, logs: dict, step: int) -> None:
        self.trackio.log(_scalars(logs), step=step)

    def finish(self) -> None:
        self.trackio.finish()


_SERVICES = {"wandb": WandbLogger, "mlflow": MlflowLogger, "swanlab": SwanlabLogger, "trackio": TrackioLogger}


def open_logger(
    name: str,
    *,
    output_dir: str | Path,
    logging_dir: str | Path | None,
    run_name: str | None,
    config: dict,
    run_id: str | None,
    resumed_step: int | None = None,
):
    """The logger for report_to name `name`; `run_id` (from a checkpoint) continues that logged run, `resumed_step`
    is the step a resumed run starts from (None for a fresh run)."""
    if name == "jsonl":
        return JsonlLogger(output_dir, resumed_step)
    if name == "tensorboard":
        return TensorBoardLogger(logging_dir or Path(output_dir) / "runs")
    try:
        return _SERVICES[name](run_name, config, run_id)
    except Exception as exc:  # the service's own setup (a login, a server): its message, in one line
        message = " ".join(str(exc).split())
        raise ConfigError(
            f"report_to={name}: {LOGGER_PACKAGES[name]} could not start a run ({type(exc).__name__}: "
            f"{message}); set it up (e.g. wandb login, or WANDB_MODE=offline) or leave {name} out of "
            "report_to"
        ) from None


__all__ = [
    "LOGGER_PACKAGES",
    "open_logger",
    "JsonlLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "MlflowLogger",
    "SwanlabLogger",
    "TrackioLogger",
]
