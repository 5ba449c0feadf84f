"""TrainingArguments: Hugging Face defaults and derivations, every validation and parsing error path, aliases,
rejections, global batch size, serialisation round-trips, --help. Pure Python: runs in about a second after
imports (transformers is imported once, as the oracle for defaults and field names), plus one short run of a tiny
model that checks the batching options reach the loader and training_args.json."""

import dataclasses
import json
import math
import pathlib
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from tests.trainer.loop.test_trainer import make_args as trainer_args
from tests.trainer.loop.test_trainer import small_model
from trainer.config.arg_parser import REJECTED, REJECTED_PREFIXES, SIMPLE_ALIASES
from trainer.config.args import (
    ConfigError,
    TrainingArguments,
    format_help,
    parse_args,
    parse_dict,
    parse_optim_args,
)
from trainer.data.sft_data import load_sft_dataset
from trainer.data.tasks import generate_tasks
from trainer.data.tokenizer import byte_level_tokenizer
from trainer.loop.trainer import Trainer

OURS_ON_PURPOSE = {  # defaults we change deliberately (module docstring of trainer/config/args.py)
    "output_dir",  # HF: None, resolved to "trainer_output" in __post_init__ (ours: the default directly)
    "optim",  # HF: adamw_torch_fused; ours: adamw_fused (kernels.FusedAdamW)
    "disable_tqdm",  # HF: None resolved from the log level (False by default); ours: plain False
    "gradient_checkpointing",  # HF 5: None, an alias resolved to False; ours: the field itself, False
}


def error(**kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        TrainingArguments(**kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def parse_error(argv, extras=()) -> str:
    with pytest.raises(ConfigError) as info:
        parse_args(argv, extras)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- defaults and Hugging Face's derivations --------------------------------------------------------------


def test_defaults_equal_hugging_face_and_every_hf_option_is_handled():
    hf_args = pytest.importorskip("transformers.training_args")

    hf = {f.name: f.default for f in dataclasses.fields(hf_args.TrainingArguments)}
    ours = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    shared = set(hf) & set(ours)
    assert len(shared) > 60
    assert {n for n in shared if hf[n] != ours[n]} == OURS_ON_PURPOSE
    initvars = {n for n, f in TrainingArguments.__dataclass_fields__.items() if isinstance(f.type, dataclasses.InitVar)}
    for name in hf:  # accepted, aliased or rejected with a reason: never silently ignored
        rejected = name in REJECTED or any(name.startswith(p) for p in REJECTED_PREFIXES)
        assert name in ours or name in initvars or rejected, name


def test_hf_4x_fields_keep_their_4x_defaults():
    a = TrainingArguments()
    assert (a.warmup_ratio, a.group_by_length, a.save_safetensors, a.overwrite_output_dir) == (0.0, False, True, False)
    assert (a.include_tokens_per_second, a.average_tokens_across_devices, a.tf32) == (False, True, None)
    assert (a.per_device_train_batch_size, a.learning_rate, a.seed) == (8, 5e-5, 42)
    assert (a.max_steps, a.num_train_epochs) == (-1, 3.0)
    assert (a.logging_steps, a.save_steps, a.lr_scheduler_type, a.optim) == (500, 500, "linear", "adamw_fused")
    assert (a.cutoff_len, a.batching_strategy, a.max_nonfinite_steps) == (2048, "normal", 10)
    assert (a.z_loss, a.use_kernels) == (0.0, True)


def test_derived_defaults_follow_hugging_face():
    a = TrainingArguments(output_dir="~/run", eval_strategy="steps", logging_steps=50)
    assert a.output_dir.endswith("/run") and not a.output_dir.startswith("~")
    assert a.run_name == a.output_dir
    assert a.logging_dir.startswith(a.output_dir + "/runs/")
    assert a.do_eval is True and a.eval_steps == 50  # eval_steps falls back to logging_steps
    b = TrainingArguments(eval_strategy="epoch", save_strategy="epoch", load_best_model_at_end=True)
    assert (b.metric_for_best_model, b.greater_is_better) == ("loss", False)
    assert TrainingArguments(metric_for_best_model="eval_loss").greater_is_better is False
    assert TrainingArguments(metric_for_best_model="accuracy").greater_is_better is True
    assert TrainingArguments(metric_for_best_model="accuracy", greater_is_better=False).greater_is_better is False
    c = TrainingArguments(torch_compile_mode="max-autotune")
    assert (c.torch_compile, c.torch_compile_backend) == (True, "inductor")
    assert TrainingArguments(torch_compile=True).torch_compile_backend == "inductor"
    assert TrainingArguments(torch_compile_backend="aot_eager").torch_compile is True


def test_values_are_coerced_from_strings_and_numbers():
    a = TrainingArguments(learning_rate="2e-5", num_train_epochs=2, per_device_train_batch_size=4.0, bf16="yes")
    assert a.learning_rate == 2e-5 and isinstance(a.num_train_epochs, float) and a.per_device_train_batch_size == 4
    assert a.bf16 is True
    assert TrainingArguments(eval_strategy=False).eval_strategy == "no"  # YAML 1.1 reads `no` as False
    assert TrainingArguments(logging_steps=10.0).logging_steps == 10
    assert TrainingArguments(save_steps=0.25).save_steps == 0.25
    assert "per_device_train_batch_size: expected an integer" in error(per_device_train_batch_size=2.5)
    assert "learning_rate: expected a number" in error(learning_rate="fast")
    assert "bf16: expected a boolean" in error(bf16="maybe")
    assert "max_steps: expected an integer" in error(max_steps=True)


@pytest.fixture
def tensorboard_installed(tmp_path, monkeypatch):
    """A stand-in `tensorboard` package on sys.path, so that report_to=tensorboard passes the installed check."""
    (tmp_path / "fake_site" / "tensorboard").mkdir(parents=True)
    (tmp_path / "fake_site" / "tensorboard" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "fake_site"))


def test_resume_report_to_and_tokens_seen_normalisation(tensorboard_installed):
    assert TrainingArguments(resume_from_checkpoint=True).resume_from_checkpoint == "auto"
    assert TrainingArguments(resume_from_checkpoint="true").resume_from_checkpoint == "auto"
    assert TrainingArguments(resume_from_checkpoint="false").resume_from_checkpoint is None
    assert TrainingArguments(resume_from_checkpoint="out/checkpoint-10").resume_from_checkpoint == "out/checkpoint-10"
    assert TrainingArguments().report_to == []
    assert TrainingArguments(report_to="jsonl").report_to == ["jsonl"]
    assert TrainingArguments(report_to=["tensorboard", "jsonl", "jsonl"]).report_to == ["tensorboard", "jsonl"]
    assert TrainingArguments(report_to="all").report_to[0] == "jsonl"
    assert TrainingArguments(report_to=None).report_to == [] and TrainingArguments(report_to=["none"]).report_to == []
    assert TrainingArguments(include_num_input_tokens_seen=True).include_num_input_tokens_seen == "all"
    assert TrainingArguments(include_num_input_tokens_seen="non_padding").include_num_input_tokens_seen == "non_padding"


def test_kernel_provider_and_mixed_precision():
    assert TrainingArguments().kernel_provider == "kernelwright"
    assert TrainingArguments(use_liger_kernel=True).kernel_provider == "liger"
    assert TrainingArguments(use_kernels=False).kernel_provider == "torch"
    precisions = [TrainingArguments(**k).mixed_precision for k in ({}, {"bf16": True}, {"fp16": True})]
    assert precisions == ["no", "bf16", "fp16"]


# --- validation: every error names the argument (and the allowed values where there is a list) -----------

ERRORS = [
    (dict(bf16=True, fp16=True), "bf16 and fp16"),
    (dict(bf16_full_eval=True, fp16_full_eval=True), "bf16_full_eval and fp16_full_eval"),
    (dict(per_device_train_batch_size=0), "per_device_train_batch_size=0"),
    (dict(per_device_eval_batch_size=-1), "per_device_eval_batch_size=-1"),
    (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps=0"),
    (dict(eval_accumulation_steps=0), "eval_accumulation_steps=0"),
    (dict(global_batch_size=0), "global_batch_size=0"),
    (dict(learning_rate=-1e-5), "learning_rate=-1e-05"),
    (dict(weight_decay=-0.1), "weight_decay=-0.1"),
    (dict(max_grad_norm=-1.0), "max_grad_norm=-1.0"),
    (dict(adam_beta1=1.0), "adam_beta1=1.0"),
    (dict(adam_beta2=-0.5), "adam_beta2=-0.5"),
    (dict(warmup_ratio=1.5), "warmup_ratio=1.5: must be in [0, 1]"),
    (dict(warmup_ratio=-0.1), "warmup_ratio=-0.1"),
    (dict(warmup_steps=-3), "warmup_steps=-3"),
    (dict(max_steps=0), "max_steps=0: must be -1 or a positive integer"),
    (dict(num_train_epochs=0), "num_train_epochs=0.0"),
    (dict(eval_strategy="sometimes"), "eval_strategy='sometimes': expected one of no, steps, epoch"),
    (
        dict(evaluation_strategy="step"),
        "eval_strategy='step': expected one of no, steps, epoch (did you mean 'steps'?)",
    ),
    (dict(logging_strategy="always"), "logging_strategy='always': expected one of no, steps, epoch"),
    (dict(save_strategy="bestest"), "save_strategy='bestest': expected one of no, steps, epoch, best"),
    (dict(lr_scheduler_type="cosine_annealing"), "lr_scheduler_type='cosine_annealing' is not a supported schedule"),
    (dict(lr_scheduler_type="reduce_lr_on_plateau"), "expected one of linear, cosine, cosine_with_restarts"),
    (
        dict(optim="adafactor"),
        "optim='adafactor' is not a supported optimizer: "
        "expected one of adamw_fused, adamw_torch, adamw_torch_fused, sgd, adamw_bnb_8bit, adamw_8bit, "
        "paged_adamw_8bit",
    ),
    (dict(optim="paged_adamw_32bit"), "optim='paged_adamw_32bit' is not a supported optimizer"),
    (
        dict(report_to="comet_ml"),
        "report_to='comet_ml' is not supported; expected none, all or some of jsonl, tensorboard, wandb, mlflow",
    ),
    (dict(report_to=["jsonl", "none"]), "report_to="),
    (dict(batching_strategy="packed"), "batching_strategy='packed': expected one of normal, padding_free"),
    (dict(include_num_input_tokens_seen="some"), "include_num_input_tokens_seen='some'"),
    (dict(torch_compile_mode="fastest"), "torch_compile_mode='fastest': expected one of default, reduce-overhead"),
    (dict(logging_steps=10.5), "logging_steps=10.5: must be an integer when >= 1"),
    (dict(save_steps=-1), "save_steps=-1"),
    (dict(eval_strategy="steps", eval_steps=2.5), "eval_steps=2.5"),
    (dict(logging_steps=0), "logging_steps=0.0: must be > 0 when logging_strategy='steps'"),
    (dict(save_steps=0), "save_steps=0.0: must be > 0 when save_strategy='steps'"),
    (dict(eval_strategy="steps", logging_strategy="no", logging_steps=0), "eval_strategy='steps' needs eval_steps"),
    (dict(eval_delay=-1), "eval_delay=-1"),
    (dict(save_total_limit=0), "save_total_limit=0"),
    (dict(dataloader_num_workers=-1), "dataloader_num_workers=-1"),
    (dict(dataloader_prefetch_factor=2), "dataloader_prefetch_factor=2: needs dataloader_num_workers > 0"),
    (dict(dataloader_persistent_workers=True), "dataloader_persistent_workers=True: needs dataloader_num_workers > 0"),
    (dict(torch_empty_cache_steps=0), "torch_empty_cache_steps=0"),
    (dict(label_smoothing_factor=1.0), "label_smoothing_factor=1.0"),
    (dict(neftune_noise_alpha=0), "neftune_noise_alpha=0.0"),
    (dict(cutoff_len=0), "cutoff_len=0"),
    (dict(cutoff_len=1), "cutoff_len=1: must be an integer >= 2"),
    (dict(seed=-1), "seed=-1: must be an integer >= 0"),
    (dict(data_seed=-5), "data_seed=-5: must be an integer >= 0 or unset"),
    (dict(torch_compile_backend="inductr"), "torch_compile_backend='inductr': expected one of"),
    (dict(pad_to_multiple_of=0), "pad_to_multiple_of=0: must be a positive integer or unset"),
    (dict(batching_strategy="dynamic_batching", max_tokens=0), "max_tokens=0: must be a positive integer or unset"),
    (
        dict(group_by_length=True, batching_strategy="padding_free"),
        "group_by_length applies to batching_strategy='normal' (got 'padding_free'",
    ),
    (
        dict(max_tokens=512),
        "max_tokens applies to batching_strategy dynamic_batching or dynamic_padding_free (got 'normal'",
    ),
    (dict(max_nonfinite_steps=0), "max_nonfinite_steps=0"),
    (dict(z_loss=-0.1), "z_loss=-0.1"),
    # best-model rules (Hugging Face's, plus: evaluation must be on)
    (
        dict(load_best_model_at_end=True, eval_strategy="steps", save_strategy="epoch"),
        "load_best_model_at_end needs save_strategy == eval_strategy",
    ),
    (
        dict(load_best_model_at_end=True, eval_strategy="steps", eval_steps=300, save_steps=500),
        "save_steps=500 must be a multiple of eval_steps=300",
    ),
    (
        dict(load_best_model_at_end=True, eval_strategy="steps", eval_steps=0.1, save_steps=500),
        "mix a ratio and a step count",
    ),
    (
        dict(load_best_model_at_end=True, eval_strategy="steps", eval_steps=0.2, save_steps=0.3),
        "save_steps=0.3 must be a multiple of eval_steps=0.2",
    ),
    (dict(load_best_model_at_end=True), "eval_strategy='no': must be steps or epoch with load_best_model_at_end"),
    (dict(save_strategy="best", eval_strategy="steps"), "save_strategy='best' needs metric_for_best_model"),
    (
        dict(save_strategy="best", metric_for_best_model="loss"),
        "eval_strategy='no': must be steps or epoch when save_strategy='best'",
    ),
    # schedules and optimizer options
    (
        dict(lr_scheduler_type="cosine", lr_scheduler_kwargs={"num_cycle": 2}),
        "lr_scheduler_kwargs: unknown key 'num_cycle' for lr_scheduler_type='cosine' (did you mean 'num_cycles'?)",
    ),
    (
        dict(lr_scheduler_kwargs={"num_cycles": 2}),
        "lr_scheduler_kwargs: unknown key 'num_cycles' for lr_scheduler_type='linear'",
    ),
    (dict(lr_scheduler_type="cosine", lr_scheduler_kwargs="{bad json"), "lr_scheduler_kwargs"),
    (
        dict(lr_scheduler_type="cosine", lr_scheduler_kwargs={"num_cycles": "many"}),
        "lr_scheduler_kwargs.num_cycles: expected a number",
    ),
    (
        dict(lr_scheduler_type="polynomial", learning_rate=1e-4, lr_scheduler_kwargs={"lr_end": 1e-3}),
        "lr_scheduler_kwargs.lr_end=0.001: must be smaller than learning_rate=0.0001",
    ),
    (dict(lr_scheduler_type="constant", warmup_steps=10), "lr_scheduler_type='constant' has no warmup"),
    (dict(lr_scheduler_type="constant", warmup_ratio=0.1), "lr_scheduler_type='constant' has no warmup"),
    (dict(lr_scheduler_type="cosine_with_min_lr"), "cosine_with_min_lr needs exactly one of min_lr or min_lr_rate"),
    (
        dict(lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": 1e-6, "min_lr_rate": 0.1}),
        "exactly one of",
    ),
    (dict(lr_scheduler_type="warmup_stable_decay"), "warmup_stable_decay needs num_decay_steps"),
    (
        dict(lr_scheduler_type="warmup_stable_decay", lr_scheduler_kwargs={"num_decay_steps": 5, "decay_type": "exp"}),
        "lr_scheduler_kwargs.decay_type='exp': expected one of linear, cosine, 1-sqrt",
    ),
    (dict(lr_scheduler_type="inverse_sqrt", lr_scheduler_kwargs={"timescale": 0}), "lr_scheduler_kwargs.timescale=0"),
    (
        dict(optim_args="momentum=0.9"),
        "optim_args: unknown key 'momentum' for optim='adamw_fused'; accepted keys: state_dtype",
    ),
    (dict(optim="adamw_torch", optim_args="amsgrad=true,betas=0.9"), "unknown key 'betas' for optim='adamw_torch'"),
    (dict(optim="sgd", optim_args="momentum"), "optim_args='momentum': expected 'key=value,key=value'"),
    (dict(optim="sgd", optim_args="momentum=fast"), "optim_args.momentum: expected a number"),
    (dict(optim="sgd", optim_args="nesterov=true"), "optim_args.nesterov=True: needs momentum > 0 and dampening = 0"),
    (dict(optim="sgd", optim_args={"momentum": -0.9}), "optim_args.momentum=-0.9"),
    # batch sizes and distributed
    (
        dict(global_batch_size=10, per_device_train_batch_size=4),
        "global_batch_size=10: must be a multiple of micro_batch_size",
    ),
    (dict(global_batch_size=16, per_device_train_batch_size=4, gradient_accumulation_steps=8), "global_batch_size=16"),
    (dict(dist_config={"name": "deepspeed"}), "dist_config name deepspeed: 'config_file' is required"),
    (
        dict(dist_config={"name": "fsdp"}),
        "dist_config.name='fsdp': expected one of fsdp2, ddp, deepspeed (did you mean 'fsdp2'?)",
    ),
    (dict(dist_config={"mixed_precision": "bf16"}), "dist_config: 'name' is required"),
    (dict(dist_config={"name": "fsdp2", "reshard": True}), "dist_config: unknown key 'reshard' for name='fsdp2'"),
    (
        dict(dist_config={"name": "ddp", "offload_params": True}),
        "dist_config: unknown key 'offload_params' for name='ddp'",
    ),
    (
        dict(dist_config={"name": "fsdp2", "mixed_precision": "fp8"}),
        "dist_config.mixed_precision='fp8': expected one of bf16, fp16, fp32",
    ),
    (
        dict(dist_config={"name": "fsdp2", "offload_params": "sometimes"}),
        "dist_config.offload_params: expected a boolean",
    ),
    (
        dict(fp16=True, dist_config={"name": "fsdp2", "mixed_precision": "bf16"}),
        "dist_config.mixed_precision='bf16' contradicts --fp16",
    ),
    (dict(dist_config="cluster"), "dist_config='cluster': expected a dict, a JSON object or a .json/.yaml file path"),
    (dict(dist_config="missing.yaml"), "dist_config: file not found: missing.yaml"),
]


@pytest.mark.parametrize("kwargs, expected", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_validation_errors_name_the_argument(kwargs, expected):
    assert expected in error(**kwargs)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_best_model_combinations_hugging_face_accepts():
    TrainingArguments(load_best_model_at_end=True, eval_strategy="steps", eval_steps=250, save_steps=1000)
    TrainingArguments(load_best_model_at_end=True, eval_strategy="steps", eval_steps=0.1, save_steps=0.3)
    TrainingArguments(load_best_model_at_end=True, eval_strategy="steps", eval_steps=0.5, save_steps=2)  # 2 % 0.5 == 0
    TrainingArguments(load_best_model_at_end=True, eval_strategy="steps", save_strategy="best", eval_steps=7)
    TrainingArguments(load_best_model_at_end=True, eval_strategy="epoch", save_strategy="epoch")
    TrainingArguments(save_strategy="best", eval_strategy="epoch", metric_for_best_model="accuracy")


def test_optim_args_parsing_is_typed():
    assert parse_optim_args("sgd", "momentum=0.9, dampening=0,nesterov=false") == {
        "momentum": 0.9,
        "dampening": 0.0,
        "nesterov": False,
    }
    assert parse_optim_args("sgd", '{"momentum": 0.5, "nesterov": true}') == {"momentum": 0.5, "nesterov": True}
    assert TrainingArguments(optim="adamw_torch_fused", optim_args="amsgrad=1").optim_args == {"amsgrad": True}
    assert TrainingArguments().optim_args == {} and TrainingArguments().lr_scheduler_kwargs == {}


def test_dist_config_from_dict_json_and_yaml_file(tmp_path):
    full = {
        "name": "fsdp2",
        "mixed_precision": None,
        "reshard_after_forward": True,
        "offload_params": False,
        "pin_memory": True,
        "dcp_path": None,
    }
    assert TrainingArguments(dist_config={"name": "fsdp2"}).dist_config == full
    assert TrainingArguments(dist_config='{"name": "ddp"}').dist_config == {"name": "ddp"}
    path = tmp_path / "dist.yaml"
    path.write_text("name: fsdp2\nmixed_precision: bf16\noffload_params: 'true'\ndcp_path: /ckpt/dcp\n")
    cfg = TrainingArguments(dist_config=str(path), bf16=True).dist_config
    assert cfg == {**full, "mixed_precision": "bf16", "offload_params": True, "dcp_path": "/ckpt/dcp"}


# --- aliases -------------------------------------------------------------------------------------------------


def test_simple_aliases_fold_into_their_targets():
    a = TrainingArguments(
        evaluation_strategy="epoch", micro_batch_size=2, activation_checkpointing_kwargs='{"use_reentrant": false}'
    )
    assert (a.eval_strategy, a.per_device_train_batch_size) == ("epoch", 2)
    assert a.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert TrainingArguments(enable_activation_checkpointing=True).gradient_checkpointing is True
    assert TrainingArguments(activation_checkpointing="true").gradient_checkpointing is True
    assert TrainingArguments(micro_batch_size=4, per_device_train_batch_size=4).per_device_train_batch_size == 4
    message = error(micro_batch_size=2, per_device_train_batch_size=4)
    assert "micro_batch_size is an alias of per_device_train_batch_size" in message
    message = error(evaluation_strategy="steps", eval_strategy="epoch")
    assert "evaluation_strategy is an alias of eval_strategy" in message
    assert set(SIMPLE_ALIASES) >= {
        "evaluation_strategy",
        "micro_batch_size",
        "enable_activation_checkpointing",
        "activation_checkpointing",
    }


def test_train_sampling_strategy_maps_onto_our_fields():
    random = TrainingArguments(train_sampling_strategy="random")
    assert (random.group_by_length, random.train_shuffle) == (False, True)
    a = TrainingArguments(train_sampling_strategy="sequential")
    assert (a.group_by_length, a.train_shuffle) == (False, False)
    b = TrainingArguments(train_sampling_strategy="group_by_length")
    assert (b.group_by_length, b.train_shuffle) == (True, True)
    assert "train_sampling_strategy='batch_rebalance': expected one of random, sequential, group_by_length" in error(
        train_sampling_strategy="batch_rebalance"
    )
    assert "contradicts group_by_length=True" in error(train_sampling_strategy="sequential", group_by_length=True)


def test_the_arguments_read_no_file_and_no_environment_of_the_run(tmp_path, monkeypatch):
    # Issue 23: __post_init__ opened the DeepSpeed JSON and read WORLD_SIZE, which is why args.py imported
    # deepspeed_engine.py; those are run checks now (sft.check_run, Trainer construction).
    monkeypatch.setenv("WORLD_SIZE", "3")
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8}')  # 3 processes x 8 x 1 is not 8: the run's checks refuse it
    args = TrainingArguments(output_dir=str(tmp_path), deepspeed=str(path))
    assert args.dist_config == {"name": "deepspeed", "config_file": str(path)}
    code = "import sys, trainer.config.args; print('trainer.parallel.deepspeed_engine' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_hugging_face_fsdp_options_become_dist_config(tmp_path):
    a = TrainingArguments(fsdp="full_shard auto_wrap")
    assert a.dist_config["name"] == "fsdp2" and a.dist_config["reshard_after_forward"] is True
    b = TrainingArguments(fsdp=["shard_grad_op", "offload"])
    assert (b.dist_config["reshard_after_forward"], b.dist_config["offload_params"]) == (False, True)
    assert TrainingArguments(fsdp=True).dist_config["name"] == "fsdp2"
    assert TrainingArguments(fsdp=["true"]).dist_config["name"] == "fsdp2"
    assert TrainingArguments(fsdp="").dist_config is None
    path = tmp_path / "fsdp.json"
    path.write_text(
        json.dumps(
            {
                "fsdp_version": 2,
                "fsdp_cpu_offload": True,
                "activation_checkpointing": True,
                "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                "reshard_after_forward": False,
            }
        )
    )
    c = TrainingArguments(fsdp=True, fsdp_config=str(path))
    assert (c.dist_config["offload_params"], c.dist_config["reshard_after_forward"]) == (True, False)
    assert c.gradient_checkpointing is True
    assert "fsdp='hybrid_shard' is FSDP1-only" in error(fsdp="hybrid_shard")
    assert "fsdp='ful_shard': expected one of full_shard" in error(fsdp="ful_shard")
    assert "fsdp_config is read only together with --fsdp" in error(fsdp_config={"version": 2})
    assert "fsdp and dist_config both given" in error(fsdp="full_shard", dist_config={"name": "ddp"})
    assert "fsdp_config.version=1: only 2" in error(fsdp=True, fsdp_config={"version": 1})
    message = error(fsdp=True, fsdp_config={"auto_wrap_policy": "SIZE_BASED_WRAP"})
    assert "fsdp_config.auto_wrap_policy='SIZE_BASED_WRAP'" in message
    assert "fsdp_config: key 'transformer_layer_cls_to_wrap' is not supported" in error(
        fsdp=True, fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
    )


# --- global batch size, steps and warmup -------------------------------------------------------------------


def test_global_batch_size_derives_accumulation_per_world_size():
    a = TrainingArguments(micro_batch_size=2, global_batch_size=16)
    assert a.gradient_accumulation_steps == 1  # untouched until the loop knows the world size
    assert a.resolve_world(1) == 8 and a.gradient_accumulation_steps == 8
    assert a.resolve_world(4) == 2 and a.total_train_batch_size(4) == 16
    message = str(pytest.raises(ConfigError, a.resolve_world, 3).value)
    assert message == "global_batch_size=16 is not divisible by world_size (3) x micro_batch_size (2) = 6"
    assert "world_size=0" in str(pytest.raises(ConfigError, a.resolve_world, 0).value)
    b = TrainingArguments(per_device_train_batch_size=4, gradient_accumulation_steps=3)
    assert b.resolve_world(2) == 3 and b.total_train_batch_size(2) == 24
    c = TrainingArguments(micro_batch_size=2, global_batch_size=16, gradient_accumulation_steps=4)  # world 2's value
    assert c.resolve_world(1) == 8


def test_warmup_steps_follow_hugging_face():
    n = 95
    assert TrainingArguments(warmup_steps=7).get_warmup_steps(n) == 7
    assert TrainingArguments(warmup_steps=7.9).get_warmup_steps(n) == 7  # HF 5.23: int(warmup_steps)
    assert TrainingArguments(warmup_steps=0.1).get_warmup_steps(n) == math.ceil(0.1 * n) == 10
    assert TrainingArguments(warmup_ratio=0.05).get_warmup_steps(n) == math.ceil(0.05 * n) == 5
    assert TrainingArguments(warmup_ratio=0.05, warmup_steps=3).get_warmup_steps(n) == 3
    assert TrainingArguments().get_warmup_steps(n) == 0


def test_ratio_steps_resolve_against_max_steps():
    a = TrainingArguments(logging_steps=0.01, eval_strategy="steps", eval_steps=0.25, save_steps=40)
    assert a.resolve_steps(1001) == {"logging_steps": 11, "eval_steps": 251, "save_steps": 40}
    assert TrainingArguments().resolve_steps(10)["eval_steps"] is None
    assert "max_steps=0" in str(pytest.raises(ConfigError, a.resolve_steps, 0).value)


def test_max_steps_from_epochs_is_the_seeds_floor_formula():
    a = TrainingArguments(num_train_epochs=2.5, gradient_accumulation_steps=3)
    assert a.get_max_steps(10) == math.ceil(2.5 * math.floor(10 / 3)) == 8
    assert TrainingArguments(num_train_epochs=1, gradient_accumulation_steps=8).get_max_steps(3) == 1
    assert TrainingArguments(max_steps=77).get_max_steps(None) == 77
    assert "max_steps: must be set" in str(pytest.raises(ConfigError, a.get_max_steps, None).value)


# --- serialisation -------------------------------------------------------------------------------------------


def rich_args() -> TrainingArguments:
    return TrainingArguments(
        output_dir="out",
        learning_rate=3e-4,
        lr_scheduler_type="warmup_stable_decay",
        lr_scheduler_kwargs={"num_decay_steps": 10, "min_lr_ratio": 0.1},
        warmup_steps=0.05,
        optim="sgd",
        optim_args="momentum=0.9",
        report_to=["jsonl"],
        eval_strategy="steps",
        eval_steps=0.1,
        save_steps=0.2,
        load_best_model_at_end=True,
        fsdp="shard_grad_op",
        bf16=True,
        micro_batch_size=2,
        global_batch_size=32,
        resume_from_checkpoint=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        max_grad_norm=float("inf"),
        train_sampling_strategy="group_by_length",
    )


def test_json_round_trip_is_exact(tmp_path):
    a = rich_args()
    a.resolve_world(4)
    path = tmp_path / "training_args.json"
    a.to_json_file(path)
    saved = json.loads(path.read_text())
    assert set(saved) == {f.name for f in dataclasses.fields(TrainingArguments)}  # no alias keys stored
    b = TrainingArguments.from_json_file(path)
    assert b == a and b.to_dict() == a.to_dict() and b.gradient_accumulation_steps == 4
    assert TrainingArguments.from_dict(a.to_dict()) == a
    assert dataclasses.replace(a) == a  # __post_init__ on its own output changes nothing


def test_to_dict_is_a_deep_copy():
    a = rich_args()
    d = a.to_dict()
    d["lr_scheduler_kwargs"]["num_decay_steps"] = 99
    d["report_to"].append("tensorboard")
    assert a.lr_scheduler_kwargs["num_decay_steps"] == 10 and a.report_to == ["jsonl"]


def test_from_dict_rejects_unknown_and_unsupported_keys(tmp_path):
    with pytest.raises(ConfigError, match="unknown argument learnig_rate; did you mean learning_rate"):
        TrainingArguments.from_dict({"learnig_rate": 1e-4})
    # the path, not read here (HF reads it here): the run's checks read it (tests/trainer/parallel/test_deepspeed.py)
    assert TrainingArguments.from_dict({"deepspeed": "ds.json"}).dist_config == {
        "name": "deepspeed",
        "config_file": "ds.json",
    }
    with pytest.raises(ConfigError, match="eval_strategy given twice"):
        TrainingArguments.from_dict({"eval_strategy": "no", "evaluation_strategy": "steps"})
    assert TrainingArguments.from_dict({"evaluation_strategy": "epoch"}).eval_strategy == "epoch"
    bad = tmp_path / "a.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="does not hold a JSON object"):
        TrainingArguments.from_json_file(bad)
    bad.write_text("{oops")
    with pytest.raises(ConfigError, match="cannot parse"):
        TrainingArguments.from_json_file(bad)


def test_summary_groups_and_marks_changes():
    text = rich_args().summary()
    assert text.splitlines()[0].startswith("Training arguments")
    lines = text.splitlines()
    assert lines.index("[output]") < lines.index("[optimizer]") < lines.index("[distributed]") < lines.index("[extras]")
    marked = {line.split()[1] for line in lines if line.startswith(" *")}
    assert {"learning_rate", "optim", "optim_args", "bf16", "dist_config", "output_dir"} <= marked
    assert not {"seed", "run_name", "logging_dir", "weight_decay"} & marked
    for f in dataclasses.fields(TrainingArguments):
        assert f" {f.name} " in text


# --- parsing -------------------------------------------------------------------------------------------------


@dataclass
class DataArgs:
    model: str = field(metadata={"help": "Model name or path.", "group": "model"})
    data: list[str] = field(default_factory=list, metadata={"help": "Training data files.", "group": "data"})
    val_size: float = field(default=0.0, metadata={"help": "Fraction held out for evaluation.", "group": "data"})
    train_on_prompt: bool = field(default=False, metadata={"help": "Also train on prompt tokens.", "group": "data"})
    data_format: str = field(
        default="auto", metadata={"help": "Dataset format.", "choices": ("auto", "alpaca", "sharegpt")}
    )
    max_samples: int | None = field(default=None, metadata={"help": "Use at most this many examples."})
    cache_dir: pathlib.Path = field(default=pathlib.Path("cache"), metadata={"help": "Tokenized data cache."})


def test_flag_forms():
    for argv in (["--learning_rate", "2e-5"], ["--learning_rate=2e-5"], ["--learning-rate", "2e-5"]):
        (args,) = parse_args(argv)
        assert args.learning_rate == 2e-5
    (args,) = parse_args(
        ["--max_steps", "-1", "--warmup_steps", "0.1", "--seed=7", "--learning_rate", "1", "--learning_rate", "3"]
    )
    assert (args.max_steps, args.warmup_steps, args.seed, args.learning_rate) == (-1, 0.1, 7, 3.0)  # last repeat wins


@pytest.mark.parametrize(
    "tokens, value",
    [
        ([], True),
        (["true"], True),
        (["false"], False),
        (["1"], True),
        (["0"], False),
        (["yes"], True),
        (["no"], False),
    ],
)
def test_boolean_flags(tokens, value):
    (args,) = parse_args(["--bf16", *tokens, "--do_train"])
    assert args.bf16 is value and args.do_train is True


def test_negated_booleans_optionals_lists_and_dicts(tensorboard_installed):
    (args,) = parse_args(
        [
            "--no_remove_unused_columns",
            "--data_seed",
            "none",
            "--eval_steps",
            "0.25",
            "--eval_strategy",
            "steps",
            "--report_to",
            "jsonl",
            "tensorboard",
            "--lr_scheduler_type",
            "cosine_with_restarts",
            "--lr_scheduler_kwargs",
            '{"num_cycles": 3}',
            "--resume_from_checkpoint",
            "--optim",
            "sgd",
            "--optim_args",
            "momentum=0.9,nesterov=true",
            "--dist_config",
            '{"name": "fsdp2", "offload_params": true}',
        ]
    )
    assert args.remove_unused_columns is False and args.data_seed is None and args.eval_steps == 0.25
    assert args.report_to == ["jsonl", "tensorboard"] and args.lr_scheduler_kwargs == {"num_cycles": 3}
    assert args.resume_from_checkpoint == "auto" and args.optim_args == {"momentum": 0.9, "nesterov": True}
    assert args.dist_config["offload_params"] is True
    (args,) = parse_args(
        ["--data_seed", "3", "--resume_from_checkpoint", "ckpt/checkpoint-5", "--fsdp", "full_shard", "auto_wrap"]
    )
    assert (args.data_seed, args.resume_from_checkpoint, args.dist_config["name"]) == (3, "ckpt/checkpoint-5", "fsdp2")


def test_aliases_and_sampling_on_the_command_line():
    (args,) = parse_args(
        [
            "--evaluation_strategy",
            "epoch",
            "--micro_batch_size",
            "2",
            "--enable_activation_checkpointing",
            "--train_sampling_strategy",
            "sequential",
        ]
    )
    assert (args.eval_strategy, args.per_device_train_batch_size, args.gradient_checkpointing, args.train_shuffle) == (
        "epoch",
        2,
        True,
        False,
    )
    assert "--evaluation_strategy and --eval_strategy set the same argument" in parse_error(
        ["--eval_strategy", "steps", "--evaluation_strategy", "epoch"]
    )


def test_names_users_bring_from_trl_and_llamafactory(tmp_path):
    @dataclass
    class Masking:  # the CLI's own dataclass (trainer.sft.SFTArguments) holds train_on_prompt
        train_on_prompt: bool = False

    for flag in ("--max_seq_length", "--max_length", "--cutoff_len"):
        (args,) = parse_args([flag, "512"])
        assert args.cutoff_len == 512
    assert parse_args(["--packing"])[0].batching_strategy == "padding_free"
    assert parse_args(["--packing", "false"])[0].batching_strategy == "normal"
    assert parse_args(["--assistant_only_loss", "false"], [Masking])[1].train_on_prompt is True
    assert parse_args(["--assistant_only_loss"], [Masking])[1].train_on_prompt is False
    config = tmp_path / "trl.yaml"
    config.write_text("max_length: 64\npacking: true\nassistant_only_loss: false\n")
    args, masking = parse_args([str(config)], [Masking])
    assert (args.cutoff_len, args.batching_strategy, masking.train_on_prompt) == (64, "padding_free", True)
    assert TrainingArguments.from_dict({"max_seq_length": 32, "packing": True}).batching_strategy == "padding_free"
    assert "--packing and --batching_strategy set the same argument" in parse_error(
        ["--batching_strategy", "normal", "--packing"]
    )
    assert "packing: expected a boolean, got 'bfd'" in parse_error(["--packing", "bfd"])
    assert "did you mean max_length" in parse_error(["--max_lenght", "8"])
    assert "did you mean packing" in parse_error(["--pakcing"])
    assert "--packing -> --batching_strategy padding_free" in format_help()


FLAG_ERRORS = [
    (["--learnig_rate", "1e-4"], "--learnig_rate: unknown argument learnig_rate; did you mean learning_rate?"),
    (["--zzzz", "1"], "unknown argument zzzz; see --help for the arguments"),
    (
        ["--push_to_hub"],
        "push_to_hub is not supported by kernelwright: pushing to the Hugging Face Hub is not supported",
    ),
    (["--hub_model_id", "me/model"], "hub_model_id is not supported by kernelwright: pushing to the Hugging Face Hub"),
    (["--push_to_hub_model_id", "x"], "push_to_hub_model_id is not supported by kernelwright"),
    (["--tpu_num_cores", "8"], "tpu_num_cores is not supported by kernelwright: TPUs are not supported"),
    (["--ddp_backend", "nccl"], "ddp_backend is not supported by kernelwright: launch with torchrun"),
    (["--local_rank", "3"], "local_rank=3: only a launcher sets it, with LOCAL_RANK=3 in the environment"),
    (["--adafactor"], "adafactor is not supported by kernelwright: Adafactor is not supported"),
    (["--log_level", "info"], "log_level is not supported by kernelwright"),
    (["--learning_rate"], "--learning_rate expects a value (a number)"),
    (["--learning_rate", "1", "2"], "--learning_rate takes one value, got 2: 1 2"),
    (["--learning_rate", "abc"], "learning_rate: expected a number, got 'abc'"),
    (["--bf16", "maybe"], "bf16: expected a boolean, got 'maybe'"),
    (["--no_bf16", "true"], "--no_bf16 takes no value"),
    (["--eval_strategy", "hourly"], "eval_strategy='hourly': expected one of no, steps, epoch"),
    (["--optim", "lion_8bit"], "optim='lion_8bit' is not a supported optimizer"),
    (["--report_to", "wandbb"], "report_to='wandbb' is not supported (did you mean 'wandb'?)"),
    (["--lr_scheduler_kwargs", "{oops"], "lr_scheduler_kwargs"),
    (["--do_train", "stray"], "do_train: expected a boolean, got 'stray'"),
    (["-x"], "unexpected argument '-x'"),
    (["--"], "unexpected argument '--'"),
    (["run.txt"], "config file 'run.txt': expected a .yaml, .yml or .json file"),
    (["missing.yaml"], "config file: file not found: missing.yaml"),
    (
        ["--micro_batch_size", "3", "--global_batch_size", "16"],
        "global_batch_size=16: must be a multiple of micro_batch_size",
    ),
]


@pytest.mark.parametrize("argv, expected", FLAG_ERRORS, ids=[str(i) for i in range(len(FLAG_ERRORS))])
def test_flag_errors(argv, expected):
    assert expected in parse_error(argv)


def test_extra_dataclasses_share_the_command_line():
    args, data = parse_args(
        [
            "--model",
            "tiny-llama",
            "--data",
            "a.jsonl",
            "b.jsonl",
            "--train_on_prompt",
            "--val_size",
            "0.1",
            "--bf16",
            "--max_samples",
            "null",
            "--cache_dir",
            "/tmp/c",
        ],
        [DataArgs],
    )
    assert isinstance(args, TrainingArguments) and args.bf16 is True
    assert data == DataArgs(
        model="tiny-llama",
        data=["a.jsonl", "b.jsonl"],
        val_size=0.1,
        train_on_prompt=True,
        cache_dir=pathlib.Path("/tmp/c"),
    )
    assert "max_samples: expected an integer or null, got 'many'" in parse_error(
        ["--model", "m", "--max_samples", "many"], [DataArgs]
    )
    assert "--model is required (Model name or path.)" in parse_error(["--bf16"], [DataArgs])
    assert "data_format='xml': expected one of auto, alpaca, sharegpt" in parse_error(
        ["--model", "m", "--data_format", "xml"], [DataArgs]
    )
    assert "did you mean val_size" in parse_error(["--model", "m", "--val_sze", "0.1"], [DataArgs])


def test_extra_dataclass_errors_and_collisions():
    @dataclass
    class Checked:
        ratio: float = field(default=0.5, metadata={"help": "A ratio."})

        def __post_init__(self):
            if not 0 <= self.ratio <= 1:
                raise ValueError(f"ratio={self.ratio}: must be in [0, 1]\n(more detail)")

    assert parse_error(["--ratio", "2"], [Checked]) == "ratio=2.0: must be in [0, 1]"

    @dataclass
    class Clash:
        seed: int = 0

    with pytest.raises(TypeError, match="seed"):
        parse_args([], [Clash])


def test_yaml_file_with_flags_winning(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model: tiny\nlearning_rate: 1e-5\nmicro_batch_size: 2\nglobal_batch_size: 16\nbf16: true\n"
        "eval_strategy: no\nenable_activation_checkpointing: true\nlr_scheduler_type: cosine\n"
        "lr_scheduler_kwargs:\n  num_cycles: 0.25\ndist_config:\n  name: fsdp2\n  reshard_after_forward: false\n"
        "data: [x.jsonl]\n"
    )
    args, data = parse_args([str(path), "--learning_rate", "2e-5", "--data", "y.jsonl"], [DataArgs])
    assert args.learning_rate == 2e-5 and data.data == ["y.jsonl"] and data.model == "tiny"  # flags win
    assert (args.per_device_train_batch_size, args.global_batch_size) == (2, 16)
    assert (args.bf16, args.eval_strategy) == (True, "no")
    assert args.gradient_checkpointing is True and args.lr_scheduler_kwargs == {"num_cycles": 0.25}
    assert args.dist_config["reshard_after_forward"] is False
    empty = tmp_path / "empty.yml"
    empty.write_text("")
    (only,) = parse_args([str(empty)])
    assert only == TrainingArguments(logging_dir=only.logging_dir)  # an empty file means all defaults


def test_json_file_and_file_errors(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"learning_rate": 3e-4, "evaluation_strategy": "epoch", "report_to": "jsonl"}))
    (args,) = parse_args([str(path), "--seed", "1"])
    assert (args.learning_rate, args.eval_strategy, args.report_to, args.seed) == (3e-4, "epoch", ["jsonl"], 1)
    cases = {
        "typo.yaml": ("learnin_rate: 1e-4\n", "key 'learnin_rate' in"),
        "hub.yaml": ("push_to_hub: true\n", "push_to_hub is not supported by kernelwright"),
        "twice.yaml": ("eval_strategy: steps\nevaluation_strategy: epoch\n", "eval_strategy given twice"),
        "list.yaml": ("- 1\n- 2\n", "expected a mapping of argument names to values"),
        "broken.yaml": ("a: [1,\n", "cannot parse"),
        "broken.json": ('{"a": ', "cannot parse"),
    }
    for name, (text, expected) in cases.items():
        (tmp_path / name).write_text(text)
        assert expected in parse_error([str(tmp_path / name)]), name
    assert "did you mean learning_rate" in parse_error([str(tmp_path / "typo.yaml")])


def test_alias_in_file_and_canonical_flag(tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text("evaluation_strategy: epoch\nsave_strategy: epoch\n")
    (args,) = parse_args([str(path), "--eval_strategy", "no"])  # the flag wins over the file's alias
    assert args.eval_strategy == "no"


def test_parse_dict_spreads_keys_over_dataclasses():
    args, data = parse_dict({"model": "m", "micro_batch_size": 4, "data_format": "alpaca"}, [DataArgs])
    assert (args.per_device_train_batch_size, data.model, data.data_format) == (4, "m", "alpaca")
    with pytest.raises(ConfigError, match="unknown argument modle; did you mean model"):
        parse_dict({"modle": "m"}, [DataArgs])


def test_help_lists_every_argument_grouped(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--learning_rate", "1", "--help"], [DataArgs])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert text == format_help([DataArgs]) + "\n"
    lines = text.splitlines()
    headers = [line[:-1] for line in lines if line and not line.startswith(" ") and line.endswith(":")]
    assert headers[:13] == [
        "output",
        "control",
        "batching",
        "evaluation",
        "optimizer",
        "schedule",
        "logging",
        "checkpoints",
        "data",
        "precision",
        "performance",
        "distributed",
        "extras",
    ]
    assert "model" in headers and "DataArgs" in headers and "aliases" in headers
    for f in [*dataclasses.fields(TrainingArguments), *dataclasses.fields(DataArgs)]:
        flag_line = next(i for i, line in enumerate(lines) if line.startswith(f"  --{f.name} "))
        assert "default: " in lines[flag_line] or "(required)" in lines[flag_line], f.name
        assert lines[flag_line + 1].startswith("      ") and len(lines[flag_line + 1].strip()) > 10, f.name
    known = {f.name for f in [*dataclasses.fields(TrainingArguments), *dataclasses.fields(DataArgs)]}
    renames = [alias for alias, target in SIMPLE_ALIASES.items() if target in known]  # not the dpo group's here
    for alias in [*renames, "train_sampling_strategy", "fsdp", "fsdp_config", "deepspeed"]:
        assert f"--{alias}" in text
    assert "--learning_rate FLOAT  (default: 5e-05)" in text
    assert "--eval_strategy {no,steps,epoch}  (default: no)" in text
    assert "--model STR  (required)" in text
    assert "push_to_hub" in text and "hub_*" in text
    section = lines.index("data:")
    assert any(line.startswith("  --val_size ") for line in lines[section : section + 40])


# --- batching options: TrainingArguments, read by the loop's loader, saved in training_args.json ---------------


def test_batching_options_are_training_arguments_saved_and_read_back_on_resume(tmp_path):
    args, *_ = parse_args(
        ["--pad_to_multiple_of", "8", "--max_tokens", "512", "--batching_strategy", "dynamic_batching"]
    )
    assert (args.pad_to_multiple_of, args.max_tokens) == (8, 512)
    assert TrainingArguments().pad_to_multiple_of is None and TrainingArguments().max_tokens is None

    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate_tasks(16, seed=3)))
    dataset = load_sft_dataset([data], byte_level_tokenizer(), cutoff_len=64, show_progress=False)
    args = trainer_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=1, pad_to_multiple_of=8)
    Trainer(model=small_model(), args=args, train_dataset=dataset).train()
    checkpoint = pathlib.Path(args.output_dir) / "checkpoint-1"
    assert json.loads((checkpoint / "training_args.json").read_text())["pad_to_multiple_of"] == 8
    assert json.loads((checkpoint / "data_state.json").read_text())["pad_to_multiple_of"] == 8  # the loader's

    # Resuming needs the same batch plan: the arguments read back from the checkpoint give it, the defaults do not.
    back = TrainingArguments.from_json_file(checkpoint / "training_args.json")
    assert back.pad_to_multiple_of == 8
    (pathlib.Path(args.output_dir) / "checkpoint-2").rename(tmp_path / "finished")  # the resumed run saves it anew
    with pytest.raises(
        ValueError, match="pad_to_multiple_of is None here but 8 in .*checkpoint-1, and a resume cannot change it"
    ):
        Trainer(
            model=small_model(), args=dataclasses.replace(back, pad_to_multiple_of=None), train_dataset=dataset
        ).train(resume_from_checkpoint=str(checkpoint))
    resumed = Trainer(model=small_model(), args=back, train_dataset=dataset)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 2
