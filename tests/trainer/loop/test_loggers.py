"""Loggers (trainer/loop/loggers.py) and the report_to check. wandb (offline mode) and MLflow (its local file store) run
for real when installed; SwanLab and Trackio run through stand-in modules that record the calls our code makes:
those tests check what we send (names, ids, resume flags, keys), not that the real packages accept it. No test
needs a network."""

from __future__ import annotations

import importlib.machinery
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tests.trainer.loop.test_trainer import losses, make_args, small_model
from trainer.config.args import ConfigError, TrainingArguments
from trainer.data.sft_data import load_sft_dataset
from trainer.data.tasks import generate_tasks
from trainer.data.tokenizer import byte_level_tokenizer
from trainer.loop.callbacks import TrainerCallback
from trainer.loop.checkpoint import checkpoints
from trainer.loop.metrics import MetricsWriter
from trainer.loop.trainer import Trainer

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in generate_tasks(24, seed=3)))
    return load_sft_dataset([path], byte_level_tokenizer(), cutoff_len=64, show_progress=False)


class StopAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True


def stopped_then_resumed(tmp_path, dataset, **overrides):
    """A 6-step run stopped after step 3 (checkpoint-3), then resumed to the end; returns (args, final state)."""
    common = dict(max_steps=6, save_strategy="steps", save_steps=3, **overrides)
    args = make_args(tmp_path, **common)
    Trainer(model=small_model(), args=args, train_dataset=dataset, callbacks=[StopAt(3)]).train()
    assert [p.name for p in checkpoints(args.output_dir)] == ["checkpoint-3"]
    resumed = Trainer(model=small_model(), args=make_args(tmp_path, **common), train_dataset=dataset)
    resumed.train(resume_from_checkpoint=True)
    return args, resumed.state


def saved_run_ids(args) -> dict:
    state = json.loads((Path(args.output_dir) / "checkpoint-3" / "trainer_state.json").read_text())
    return state["logger_run_ids"]


# ---- the report_to check ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "mlflow", "swanlab", "trackio"])
def test_missing_logger_package_is_one_line_at_argument_time(name, monkeypatch):
    monkeypatch.setitem(sys.modules, name, None)  # what `import name` and find_spec see when it is not installed
    with pytest.raises(ConfigError) as e:
        TrainingArguments(report_to=["jsonl", name])
    assert str(e.value) == f"report_to={name}: {name} is not installed (pip install {name})"


def test_all_is_jsonl_and_every_installed_logger(monkeypatch):
    for name in ("tensorboard", "wandb", "mlflow", "swanlab", "trackio"):
        monkeypatch.setitem(sys.modules, name, None)
    assert TrainingArguments(report_to="all").report_to == ["jsonl"]
    monkeypatch.setitem(sys.modules, "trackio", fake_module("trackio"))
    assert TrainingArguments(report_to="all").report_to == ["jsonl", "trackio"]


@pytest.mark.parametrize(
    "name",
    ["tensorboard", pytest.param("wandb", marks=pytest.mark.slow)],  # one path: a CLI start each
)
def test_cli_missing_logger_exits_2_with_one_line_before_any_work(name, tmp_path):
    out = tmp_path / "out"
    code = (
        "import runpy, sys; sys.modules[sys.argv[1]] = None; del sys.argv[1]; "
        "runpy.run_module('trainer.sft', run_name='__main__', alter_sys=True)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, name, "--report_to", name, "--max_steps", "1", "--output_dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: report_to={name}: {name} is not installed (pip install {name})"
    ]
    assert not out.exists()


# ---- stand-in services: what we send ---------------------------------------------------------------------------


def fake_module(name: str) -> types.ModuleType:
    """A module that records every call into `calls` (init returns a run with the ids SwanLab/Trackio expose)."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec reports it installed
    module.calls = []

    def init(**kwargs):
        module.calls.append(("init", kwargs))
        run_id = kwargs.get("id") or "run-1"
        return types.SimpleNamespace(public=types.SimpleNamespace(run_id=run_id), name=kwargs.get("name"))

    module.init = init
    module.log = lambda data, step=None: module.calls.append(("log", data, step))
    module.finish = lambda: module.calls.append(("finish",))
    return module


def test_a_service_that_cannot_start_its_run_is_one_line(tmp_path, monkeypatch):
    """Issue 21 item 10: wandb without a login in a non-interactive shell was wandb's UsageError traceback."""
    swanlab = fake_module("swanlab")

    def refuse(**kwargs):
        raise RuntimeError("No API key configured.\nRun `swanlab login`.")

    swanlab.init = refuse
    monkeypatch.setitem(sys.modules, "swanlab", swanlab)
    with pytest.raises(
        ConfigError,
        match=r"^report_to=swanlab: swanlab could not start a run \(RuntimeError: No API "
        r"key configured. Run `swanlab login`.\); set it up .* or leave swanlab out "
        r"of report_to$",
    ):
        MetricsWriter(tmp_path, ["swanlab"], run_name="r", config={})


def test_swanlab_names_logs_and_resumes_the_run(tmp_path, monkeypatch):
    swanlab = fake_module("swanlab")
    monkeypatch.setitem(sys.modules, "swanlab", swanlab)
    monkeypatch.setenv("SWANLAB_PROJECT", "kw")
    writer = MetricsWriter(tmp_path, ["swanlab"], run_name="r", config={"learning_rate": 0.1})
    writer.write({"loss": 1.5, "eval_loss": 2.0, "epoch": 0.5, "note": "text"}, step=3)
    writer.close()
    assert writer.run_ids == {"swanlab": "run-1"}
    assert swanlab.calls == [
        ("init", {"project": "kw", "experiment_name": "r", "config": {"learning_rate": 0.1}}),
        ("log", {"train/loss": 1.5, "eval/loss": 2.0, "train/epoch": 0.5, "train/global_step": 3}, 3),
        ("finish",),
    ]
    swanlab.calls.clear()
    MetricsWriter(tmp_path, ["swanlab"], run_name="r", config={}, run_ids=writer.run_ids).close()
    assert swanlab.calls[0] == (
        "init",
        {"project": "kw", "experiment_name": "r", "config": {}, "id": "run-1", "resume": "allow"},
    )


def test_trackio_resumes_by_run_name(tmp_path, monkeypatch):
    trackio = fake_module("trackio")
    monkeypatch.setitem(sys.modules, "trackio", trackio)
    writer = MetricsWriter(tmp_path, ["trackio"], run_name="first-name", config={})
    writer.write({"loss": 1.0, "grad_norm": float("nan")}, step=2)
    writer.close()
    assert writer.run_ids == {"trackio": "first-name"}
    assert trackio.calls[0] == (
        "init",
        {"project": "huggingface", "name": "first-name", "config": {}, "resume": "allow"},
    )
    assert trackio.calls[1] == ("log", {"loss": 1.0}, 2)  # NaN left out
    trackio.calls.clear()
    MetricsWriter(tmp_path, ["trackio"], run_name="renamed", config={}, run_ids=writer.run_ids).close()
    assert trackio.calls[0][1]["name"] == "first-name"


def test_training_stores_logger_run_ids_in_the_checkpoint_and_resumes_them(tmp_path, dataset, monkeypatch):
    swanlab = fake_module("swanlab")
    monkeypatch.setitem(sys.modules, "swanlab", swanlab)
    args, state = stopped_then_resumed(tmp_path, dataset, report_to=["jsonl", "swanlab"])
    assert saved_run_ids(args) == {"swanlab": "run-1"}
    inits = [c[1] for c in swanlab.calls if c[0] == "init"]
    assert [i.get("id") for i in inits] == [None, "run-1"] and inits[1]["resume"] == "allow"
    # the training rows; each train() call also logs its end-of-training metrics (train_runtime, ...), as HF does
    logged_steps = [c[2] for c in swanlab.calls if c[0] == "log" and "train/loss" in c[1]]
    assert logged_steps == [1, 2, 3, 4, 5, 6] and state.logger_run_ids == {"swanlab": "run-1"}


# ---- the real packages, offline ---------------------------------------------------------------------------------


def test_mlflow_resumed_run_continues_the_same_run(tmp_path, dataset, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 wants a database; the file store needs no server
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "kernelwright-test")
    args, state = stopped_then_resumed(tmp_path, dataset, report_to=["mlflow"], run_name="mlflow-run")
    run_id = saved_run_ids(args)["mlflow"]
    client = mlflow.tracking.MlflowClient()
    run = client.get_run(run_id)
    assert run.info.run_name == "mlflow-run" and run.data.params["learning_rate"] == "0.01"
    assert client.get_experiment(run.info.experiment_id).name == "kernelwright-test"
    history = client.get_metric_history(run_id, "loss")
    assert [m.step for m in history] == [1, 2, 3, 4, 5, 6]
    assert [m.value for m in history] == pytest.approx(losses(state))
    assert len(client.search_runs([run.info.experiment_id])) == 1  # no second run was started
    assert mlflow.active_run() is None


def test_wandb_offline_resumed_run_keeps_its_id(tmp_path, dataset, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    args, _ = stopped_then_resumed(tmp_path, dataset, report_to=["wandb"], run_name="wandb-run")
    run_id = saved_run_ids(args)["wandb"]
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs)  # one run, written twice
