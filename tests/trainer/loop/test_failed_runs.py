"""Issue 21 item 3 (and item 10's max_nonfinite_steps stop): a run whose every step was non-finite fails in one line,
exit 1, without saving a final model; every JSON file a run writes parses under a strict reader."""

import json
import math

import kernels
from trainer import sft
from trainer.checkpoint_hf import to_json
from trainer.model.causal_lm import CausalLM

FEW_STEPS = [
    "--model",
    "tiny",
    "--max_steps",
    "3",
    "--save_steps",
    "2",
    "--per_device_train_batch_size",
    "8",
    "--exact_match_examples",
    "0",
    "--logging_steps",
    "1",
    "--disable_tqdm",
    "true",
]


def _strict(text: str):
    def refuse(constant):
        raise ValueError(f"non-JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def _nan_loss(monkeypatch, training=True):
    forward = CausalLM.forward

    def nan_forward(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if out.loss is not None and self.training == training:
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(CausalLM, "forward", nan_forward)


def test_to_json_writes_null_with_the_value_beside_it():
    text = to_json({"loss": float("nan"), "norm": float("inf"), "lr": 1e-3, "hist": [1.0, float("-inf")]})
    assert _strict(text) == {
        "loss": None,
        "loss_non_finite": "nan",
        "norm": None,
        "norm_non_finite": "inf",
        "lr": 1e-3,
        "hist": [1.0, None],
    }


def test_a_run_whose_every_step_is_non_finite_fails_in_one_line_and_saves_no_model(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    _nan_loss(monkeypatch)
    with kernels.backend("reference"):
        assert sft.main([*FEW_STEPS, "--output_dir", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert err[-1].startswith("error: training failed: all 3 steps had a non-finite loss")
    assert not (out / "model.safetensors").exists() and not (out / "final_metrics.json").exists()
    assert not list(out.glob("checkpoint-*"))  # no scheduled save inside a run of non-finite steps


def test_max_nonfinite_steps_stop_is_one_line(tmp_path, monkeypatch, capsys):
    _nan_loss(monkeypatch)
    with kernels.backend("reference"):
        assert sft.main([*FEW_STEPS, "--max_nonfinite_steps", "2", "--output_dir", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert err[-1].startswith("error: 2 non-finite steps in a row (max_nonfinite_steps=2)")


def test_every_json_file_is_strict_json_even_with_a_nan_eval_loss(tmp_path, monkeypatch):
    out = tmp_path / "out"
    _nan_loss(monkeypatch, training=False)  # training is fine, evaluation gives NaN
    with kernels.backend("reference"):
        assert (
            sft.main(
                [
                    *FEW_STEPS,
                    "--output_dir",
                    str(out),
                    "--report_to",
                    "jsonl",
                    "--eval_strategy",
                    "steps",
                    "--eval_steps",
                    "2",
                ]
            )
            == 0
        )
    final = _strict((out / "final_metrics.json").read_text())  # a bare NaN here before
    assert math.isfinite(final["train_loss"])
    assert final["eval_loss"] is None and final["eval_loss_non_finite"] == "nan"
    files = [f for f in [*out.rglob("*.json"), *out.rglob("*.jsonl")] if ".cache" not in f.parts]
    assert any(f.name == "trainer_state.json" for f in files) and any(f.name == "metrics.jsonl" for f in files)
    for file in files:
        for line in file.read_text().splitlines() if file.suffix == ".jsonl" else [file.read_text()]:
            _strict(line)  # the eval rows of metrics.jsonl and trainer_state.json's log_history included
