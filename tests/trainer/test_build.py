"""trainer.build.build_model: the one way a model comes to exist (issue 12).

The CLI, trainer.generate and the Python API build through it; the 2-process FSDP2/DDP builds are covered in
tests/trainer/parallel/test_distributed.py (the `build` jobs and every sft run there)."""

import torch

from trainer.build import build_model, build_preset, load_pretrained, save_pretrained
from trainer.config.args import TrainingArguments
from trainer.loop import trainer as trainer_module
from trainer.loop.trainer import Trainer
from trainer.model.causal_lm import CausalLM
from trainer.parallel.transforms import apply_all


def test_settings_are_given_when_the_model_is_built(tmp_path):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        label_smoothing_factor=0.1,
        neftune_noise_alpha=5.0,
        use_kernels=False,
        gradient_checkpointing=True,
        seed=3,
    )
    model, tokenizer = build_model("tiny", args)
    assert isinstance(model, CausalLM)  # one process: no wrapper
    assert (model.label_smoothing, model.neftune_noise_alpha, model.use_kernels) == (0.1, 5.0, False)
    assert model.gradient_checkpointing  # the transforms ran at build
    assert tokenizer.eos_token_id == model.config.eos_token_id
    # the preset's init is drawn from args.seed: bitwise build_preset's with that seed
    reference, _ = build_preset("tiny", seed=3)
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


SETTINGS = ("impl", "label_smoothing", "z_loss", "neftune_noise_alpha")


def _record_setting_writes(monkeypatch) -> list:
    """Every write of a model setting onto a CausalLM from now on, as (name, value)."""
    writes = []
    set_attribute = CausalLM.__setattr__

    def recording(self, name, value):
        if name in SETTINGS:
            writes.append((name, value))
        set_attribute(self, name, value)

    monkeypatch.setattr(CausalLM, "__setattr__", recording)
    return writes


def test_settings_are_written_once_at_construction(tmp_path, monkeypatch):
    # Issue 23: build_model wrote them as attributes after the weights loaded, and the Trainer wrote them again.
    # Now the CausalLM is constructed with them and nothing writes them later: not the build, not the Trainer.
    args = TrainingArguments(
        output_dir=str(tmp_path), label_smoothing_factor=0.1, z_loss=1e-3, neftune_noise_alpha=5.0, use_kernels=False
    )
    writes = _record_setting_writes(monkeypatch)
    model, _ = build_model("tiny", args)
    assert ("label_smoothing", 0.1) in writes and ("z_loss", 1e-3) in writes and ("neftune_noise_alpha", 5.0) in writes
    assert len([w for w in writes if w[0] != "impl"]) == 3  # the constructor's, once each
    ops = [w for w in writes if w[0] == "impl"]
    built = list(writes)
    Trainer(model=model, args=args)
    assert writes == built  # the Trainer had nothing to write
    assert {value for _, value in ops} == {"torch"} and model.impl == "torch"


def test_the_trainer_applies_its_arguments_to_a_model_built_otherwise(tmp_path, monkeypatch):
    # As transformers' Trainer: TrainingArguments(label_smoothing_factor=...) applies to the model it is handed,
    # built by hand or from other arguments; once, by the Trainer.
    model, _ = build_preset("tiny")
    writes = _record_setting_writes(monkeypatch)
    args = TrainingArguments(output_dir=str(tmp_path), label_smoothing_factor=0.1, z_loss=1e-3, use_kernels=False)
    Trainer(model=model, args=args)
    assert (model.label_smoothing, model.z_loss, model.neftune_noise_alpha, model.use_kernels) == (
        0.1,
        1e-3,
        None,
        False,
    )
    assert [name for name, _ in writes if name != "impl"] == ["label_smoothing", "z_loss", "neftune_noise_alpha"]
    built, _ = build_model("tiny", TrainingArguments(output_dir=str(tmp_path), z_loss=1e-2))
    Trainer(model=built, args=args)
    assert (built.label_smoothing, built.z_loss, built.use_kernels) == (0.1, 1e-3, False)


def test_a_directory_and_its_dtype(tmp_path):
    model, tokenizer = build_preset("tiny", seed=1)
    save_pretrained(model, tmp_path / "m", tokenizer=tokenizer)
    built, _ = build_model(str(tmp_path / "m"), dtype="bfloat16", use_kernels=False)
    assert built.model.embed_tokens.weight.dtype == torch.bfloat16
    again = load_pretrained(tmp_path / "m")  # the same path without training arguments
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)


def test_transforms_are_idempotent(tmp_path):
    # The Trainer applies them to whatever model it gets: a model from build_model has them already, and a second
    # application must not compile the blocks again (a fresh torch.compile wrapper recompiles on first use).
    args = TrainingArguments(output_dir=str(tmp_path), torch_compile=True, gradient_checkpointing=True)
    model, _ = build_model("tiny", args)
    compiled = [block._compiled_call_impl for block in model.model.layers]
    assert all(c is not None for c in compiled)
    assert apply_all(model, args) is model
    assert [block._compiled_call_impl for block in model.model.layers] == compiled


def test_the_trainer_puts_a_model_on_the_device_it_trains_on(tmp_path, monkeypatch):
    # transformers' Trainer moves the model to args.device; ours left a CPU-built model on the CPU even where CUDA
    # was there. "meta" stands in for the accelerator this CPU machine does not have.
    monkeypatch.setattr(trainer_module, "local_device", lambda: torch.device("meta"))
    model, _ = build_preset("tiny")
    Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path)))
    assert {p.device.type for p in model.parameters()} == {"meta"}
