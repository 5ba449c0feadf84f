"""The command line's own arguments and their checks: `SFTArguments` (the options every method's command takes that
are not TrainingArguments: model, data, ...), `METHODS` (the methods `--stage` and a config's `stage:` key choose
from, each a plug-in in trainer/methods/), and `check_run`, every check of a run's arguments against this machine and
the file system, the chosen method's own among them, before anything is read, built or written (trainer/cli.py).

No `from __future__ import annotations` in this module: the argument parser reads SFTArguments' annotations as types.
"""

import dataclasses
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import kernels
from kernels._dispatch import TRITON_MISSING, interpreter_on
from trainer.build import check_model_name, dcp_source, is_preset, model_type_of, preset_config, read_config
from trainer.config.args import ConfigError, _arg
from trainer.data.cache import cache_root, check_cache_root
from trainer.data.hf_sources import MIX_STRATEGIES, check_sources, split_names
from trainer.data.sft_data import DataError, resolve_data_files
from trainer.loop.checkpoint import checkpoints, resolve_resume, saved_world_size
from trainer.loop.engine import check_engine_args
from trainer.loop.resume import check_resume_arguments, saved_arguments
from trainer.methods.base import evaluates, interleave_probs
from trainer.methods.dpo_method import DPO
from trainer.methods.grpo_method import GRPO
from trainer.methods.sft_method import SFT
from trainer.model.attention import _flash_attn
from trainer.model.causal_lm import CausalLM, context_length_warning
from trainer.model.lora import import_peft, lora_config
from trainer.model.moe import no_router_message
from trainer.model.transformers_model import MODEL_IMPLS, check_transformers_path, model_path
from trainer.parallel.transforms import ZERO3_4BIT_EXPERTS, uses_zero3

METHODS = {method.name: method for method in (SFT, DPO, GRPO)}
# transformers' attn_implementation values -> our attention backends (trainer/model/attention.py). transformers'
# "eager" (the unfused softmax(QK^T)V) has no counterpart here: sdpa computes the same attention.
ATTN_IMPLEMENTATIONS = {"auto": "auto", "sdpa": "sdpa", "flex_attention": "flex", "flash_attention_2": "flash"}


@dataclass
class SFTArguments:
    """The command line's options that are not TrainingArguments, the same for every method (the group "sft" of
    --help; the method's own options follow as their own group)."""

    stage: str = _arg(
        "sft",
        "sft",
        "What to train: sft (supervised), or dpo (preference pairs, with the dpo group's "
        "options; python -m trainer.dpo sets it; LlamaFactory's name).",
        choices=tuple(METHODS),
    )
    model: str = _arg("tiny", "sft", "Model: a Hugging Face directory, a preset (tiny), or a hub id.")
    data: list[str] | None = _arg(
        None, "sft", "Training data files or directories (JSONL/JSON/Parquet); default: the embedded tasks."
    )
    eval_data: list[str] | None = _arg(
        None, "sft", "Held-out data files; default: the embedded eval tasks when --data is not given."
    )
    dataset_name: list[str] | None = _arg(
        None,
        "sft",
        "Training data as datasets.load_dataset reads it (TRL's name): a Hub id, a directory (save_to_disk, or of "
        "data files) or a builder (json, parquet, csv, text) with --data_files; several (or a,b): a mixture.",
    )
    dataset_config: str | None = _arg(None, "sft", "The configuration of --dataset_name (load_dataset's name=).")
    data_files: list[str] | None = _arg(
        None, "sft", "Files (or glob patterns) the --dataset_name builder or directory reads (load_dataset's)."
    )
    dataset_train_split: str = _arg("train", "sft", "The split of --dataset_name to train on.")
    dataset_test_split: str | None = _arg(
        None, "sft", "The split of --dataset_name to evaluate on (default: none; TRL's default is test)."
    )
    mix_strategy: str = _arg(
        "concat",
        "sft",
        "How several --dataset_name sources mix (LlamaFactory's names): one after the other, or interleaved until "
        "the first (under) or the last (over) runs out.",
        choices=MIX_STRATEGIES,
    )
    interleave_probs: list[float] | str | None = _arg(
        None,
        "sft",
        "Sampling probabilities of the sources for interleave_* (e.g. 0.7 0.3; in YAML a list, or LlamaFactory's "
        "'0.7,0.3'), seeded with data_seed (else seed).",
    )
    streaming: bool = _arg(
        False,
        "sft",
        "Read the training data (stage sft's examples, stage dpo's pairs) as a stream (datasets' and LlamaFactory's "
        "name): tokenised as training goes, batched from --packing_buffer examples at a time, resumed exactly; "
        "needs max_steps.",
    )
    dataset_num_proc: int | None = _arg(
        None,
        "sft",
        "Tokenise in this many processes: the same tokens and order as one (TRL's name; LlamaFactory's "
        "preprocessing_num_workers).",
    )
    data_cache_dir: str | None = _arg(
        None,
        "sft",
        "Where tokenised data is cached, shared by every run (default: $KERNELWRIGHT_DATA_CACHE, else "
        "$XDG_CACHE_HOME/kernelwright/data, i.e. ~/.cache/kernelwright/data).",
    )
    val_size: float = _arg(
        0.0, "sft", "Hold out this many training examples (int) or this fraction (<1) for evaluation."
    )
    data_format: str = _arg(
        "auto",
        "sft",
        "Record format (stage dpo: auto, standard, conversational, sharegpt or alpaca preference pairs).",
        choices=tuple(dict.fromkeys(f for method in METHODS.values() for f in method.data_formats)),
    )
    train_on_prompt: bool = _arg(
        False, "sft", "Also train on prompt tokens (default: assistant/completion tokens only)."
    )
    mask_history: bool = _arg(False, "sft", "Train only on the last assistant turn of each conversation.")
    skip_bad_examples: bool = _arg(False, "sft", "Turn malformed examples into counted warnings instead of errors.")
    model_dtype: str | None = _arg(
        None,
        "sft",
        "Load the weights in this dtype (default: the checkpoint's).",
        choices=("float32", "bfloat16", "float16"),
    )
    eval_exact_match: bool | None = _arg(
        None,
        "sft",
        "Report exact-match accuracy of greedy answers on held-out conversations "
        "before and after training (default: on for the embedded tasks).",
    )
    exact_match_examples: int = _arg(
        200, "sft", "How many held-out conversations the exact-match evaluation uses (0: none)."
    )
    max_new_tokens: int = _arg(32, "sft", "Longest answer generated for the sample answers printed at the end.")
    plot: bool = _arg(True, "sft", "Save the train/eval loss curve as output_dir/loss_curve.png (needs matplotlib).")
    attn_implementation: str = _arg(
        "auto",
        "sft",
        "Attention backend, by transformers' names (auto: flash-attn on "
        "CUDA in bf16/fp16 when installed, else flex or sdpa; sdpa on CPU).",
        choices=tuple(ATTN_IMPLEMENTATIONS),
    )
    model_impl: str = _arg(
        "auto",
        "sft",
        "Which model trains: ours (llama, mistral, qwen2, qwen3, qwen3_5_text and the mixtures of experts qwen3_moe, "
        "mixtral, gpt_oss, qwen3_next, qwen3_5_moe_text: our kernels throughout), transformers "
        "(its modeling code for any causal LM, our fused loss and optimizer inside), or auto (ours where it applies).",
        choices=MODEL_IMPLS,
    )


def run_arguments(args, sft: SFTArguments, method_args) -> dict:
    """What a run was asked to do, as saved in output_dir/sft_args.json (the method's run_args_file): every argument,
    resolved, except a logging_dir derived from the clock (output_dir/runs/<date>_<host>); the method's own options
    where it has them (dpo_args.json, grpo_args.json)."""
    saved = dataclasses.asdict(method_args) if METHODS[sft.stage].arguments_saved else {}
    values = {**args.to_dict(), **dataclasses.asdict(sft), **saved}
    if os.path.dirname(values["logging_dir"]) == os.path.join(args.output_dir, "runs"):
        del values["logging_dir"]
    return json.loads(json.dumps(values, default=str))


def check_run(args, sft: SFTArguments, method_args) -> None:
    """Every check of the arguments against this machine and the file system, run before anything expensive
    (building the model, tokenising) or written; each failure is a one-line ConfigError/DataError (exit 2)."""
    check_model_name(sft.model)
    transformers_path = model_path_of(sft) == "transformers"
    if transformers_path:
        check_transformers_path(args)
    METHODS[sft.stage].check(args, sft, method_args)
    _check_output_dir(args, sft, method_args)
    check_cache_root(cache_root(sft.data_cache_dir))
    if args.resume_from_checkpoint and str(args.resume_from_checkpoint).lower() not in ("true", "auto", "latest"):
        resolve_resume(args.resume_from_checkpoint, args.output_dir)  # a damaged or missing one: exit 2, nothing built
    _check_resume_arguments(args)
    if sft.train_on_prompt and sft.mask_history:
        raise ConfigError(
            "train_on_prompt and mask_history cannot both be set (train_on_prompt trains every token, "
            "mask_history the last assistant turn only)"
        )
    _check_sft_values(sft)
    _check_data_sources(sft)
    _check_streaming(args, sft, method_args)
    _check_eval_data(args, sft)
    # the engine's files (DeepSpeed's JSON) read and checked against these arguments, world size from the launcher
    check_engine_args(args, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    if args.dist_config is not None and args.dist_config.get("dcp_path"):
        dcp_source(args)  # the fsdp2 build's weights: a DCP directory
    for paths in (sft.data, sft.eval_data):
        if paths:
            resolve_data_files(paths)
    cuda = torch.cuda.is_available()
    try:
        kernels.current_backend()  # refuses an unknown KERNELS_BACKEND
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if (
        args.use_kernels
        and not args.use_liger_kernel
        and not kernels.HAS_TRITON
        and (cuda or interpreter_on() or kernels.current_backend() == "triton")
    ):
        raise ConfigError(
            f"use_kernels: our kernels run on Triton here, but {TRITON_MISSING}; or pass --use_kernels false"
        )
    if args.use_kernels and not cuda and kernels.current_backend() == "triton" and not interpreter_on():
        raise ConfigError(
            "KERNELS_BACKEND=triton: Triton kernels on a CPU need the interpreter (TRITON_INTERPRET=1, "
            "about 37 us per program: for tests); unset it to run the PyTorch references"
        )
    if args.use_liger_kernel:
        if not cuda:
            raise ConfigError(
                "use_liger_kernel: liger-kernel's Triton kernels need a CUDA GPU, and none is visible; "
                "leave it off (--use_kernels runs kernelwright's, with a CPU reference)"
            )
        if importlib.util.find_spec("liger_kernel") is None:
            raise ConfigError("use_liger_kernel: liger-kernel is not installed (pip install liger-kernel)")
    if (
        cuda
        and (args.bf16 or args.bf16_full_eval or sft.model_dtype == "bfloat16")
        and not torch.cuda.is_bf16_supported()
    ):
        raise ConfigError(
            "bf16: this GPU does not support bfloat16 (it needs compute capability 8.0, Ampere, or "
            "newer); use --fp16 instead"
        )
    _check_attention(args, sft, cuda)
    if not transformers_path:
        _check_context_length(args, sft)
        _check_router_loss(args, sft)
        _check_4bit_experts(args, sft)
        if args.use_peft:
            _check_lora(args, sft)


def model_path_of(sft: SFTArguments) -> str | None:
    """ "ours" or "transformers" for the run's --model and --model_impl (trainer.model.transformers_model.model_path);
    None for a hub id not downloaded yet (decided when it is built). A one-line error when neither applies."""
    if is_preset(sft.model):
        if sft.model_impl == "transformers":
            raise ConfigError(f"model_impl transformers: {sft.model!r} is a preset of ours; pass a model directory")
        return "ours"
    if not (Path(sft.model) / "config.json").is_file():
        return None
    return model_path(model_type_of(Path(sft.model)), sft.model_impl)


def _check_sft_values(sft: SFTArguments) -> None:
    """The sft command's own numbers: val_size a count (a whole number >= 1) or a fraction in (0, 1),
    exact_match_examples >= 0 (0: no exact-match check) and max_new_tokens >= 1."""
    if sft.val_size < 0 or (sft.val_size >= 1 and sft.val_size != int(sft.val_size)):
        raise ConfigError(
            f"val_size={sft.val_size:g}: expected 0 (no held-out split), a count of examples (a whole "
            "number >= 1) or a fraction in (0, 1)"
        )
    if sft.exact_match_examples < 0:
        raise ConfigError(
            f"exact_match_examples={sft.exact_match_examples}: expected a count >= 0 (0: no exact-match check)"
        )
    if sft.max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={sft.max_new_tokens}: must be a positive integer")


def _check_data_sources(sft: SFTArguments) -> None:
    """--data or --dataset_name, and the options of the one given; a Hub id without a network, the files a builder
    reads (trainer.data.hf_sources.check_sources): one line each, before anything is read."""
    if sft.dataset_num_proc is not None and sft.dataset_num_proc < 1:
        raise ConfigError(f"dataset_num_proc={sft.dataset_num_proc}: expected a number of processes >= 1")
    METHODS[sft.stage].check_sources(sft)
    if not sft.dataset_name:
        given = [
            name
            for name in ("dataset_config", "data_files", "dataset_test_split", "interleave_probs")
            if getattr(sft, name) is not None
        ] + (["mix_strategy"] if sft.mix_strategy != "concat" else [])
        if given:
            raise ConfigError(f"{', '.join(given)}: options of --dataset_name, which is not given")
        return
    if sft.data:
        raise ConfigError("data and dataset_name: both give the training data; give one of them")
    if sft.dataset_test_split is not None and (sft.eval_data or sft.val_size):
        given = "--eval_data" if sft.eval_data else f"val_size={sft.val_size:g}"
        raise ConfigError(
            f"dataset_test_split={sft.dataset_test_split!r} gives the evaluation data, but {given} does too; "
            "give one of them"
        )
    try:
        names = split_names(sft.dataset_name)
        check_sources(names, sft.data_files, sft.mix_strategy, interleave_probs(sft), sft.dataset_config)
    except DataError as exc:
        raise ConfigError(str(exc)) from None


def _check_streaming(args, sft: SFTArguments, method_args) -> None:
    """--streaming's needs (trainer.data.streaming): a method that streams (and what it needs of a stream), max_steps,
    the datasets package, and no option that needs the whole data at once."""
    if not sft.streaming:
        return
    method = METHODS[sft.stage]
    if not method.streams:
        *others, last = [name for name, other in METHODS.items() if other.streams]
        raise ConfigError(
            f"streaming: stage {sft.stage}'s command reads its data whole; --streaming is for stages "
            f"{', '.join(others)} and {last}"
        )
    method.check_streaming(args, sft, method_args)
    if args.max_steps <= 0:
        raise ConfigError("max_steps: must be set (> 0) with --streaming (the length of a stream is unknown)")
    if importlib.util.find_spec("datasets") is None:
        raise ConfigError("streaming: reads through the datasets package: pip install datasets")
    given = [
        f"{name}={getattr(sft, name)!r}"
        for name in ("val_size", "dataset_test_split", "dataset_num_proc")
        if getattr(sft, name) not in (None, 0, 0.0)
    ]
    if given:
        raise ConfigError(
            f"{', '.join(given)}: not with --streaming (a stream is read once, in the training process, as training "
            "goes); give the eval data as --eval_data FILE"
        )


def _check_eval_data(args, sft: SFTArguments) -> None:
    """Evaluation data where the arguments evaluate, and one source of it: --eval_data, --val_size (held out of
    --data), or the embedded tasks' eval file when --data is not given; a metric_for_best_model that evaluation
    reports."""
    data = sft.data or sft.dataset_name
    if sft.val_size and (sft.eval_data or not data):
        given = "--eval_data" if sft.eval_data else "the embedded tasks' own eval set (no --data)"
        raise ConfigError(
            f"val_size={sft.val_size:g} holds out part of --data for evaluation, but {given} is the "
            "evaluation data already; give one of them"
        )
    method = METHODS[sft.stage]
    asking = evaluates(args)
    if asking and data and not sft.eval_data and not sft.val_size and not sft.dataset_test_split:
        raise ConfigError(
            f"{' and '.join(asking)} asks for evaluation, but there is no evaluation data: give {method.eval_sources}, "
            "or turn evaluation off (--eval_strategy no, no --eval_on_start)"
        )
    best = args.metric_for_best_model
    name = (best or "").removeprefix("eval_")
    families = method.eval_metric_families  # "rewards/<function>/mean|std": any name from "rewards/"
    if best and name not in method.eval_metrics and not name.startswith(tuple(f.split("<")[0] for f in families)):
        raise ConfigError(  # the command has no compute_metrics
            f"metric_for_best_model={best!r}: the evaluation reports {', '.join(method.eval_metrics)} (as "
            "eval_<name> or <name>)" + "".join(f", and {family}" for family in families)
        )


def _our_config(sft: SFTArguments):
    """The ModelConfig of --model (a preset, or a directory with a config.json), or None for a hub id not yet
    downloaded (checked when it is built)."""
    if is_preset(sft.model):
        return preset_config(sft.model)[0]
    return read_config(sft.model) if (Path(sft.model) / "config.json").is_file() else None


def _check_context_length(args, sft: SFTArguments) -> None:
    """cutoff_len (the longest document: packed rows restart positions per document) against the model's context
    (trainer.model.causal_lm.context_length_warning): a warning line when beyond it, exit 2 when RoPE cannot represent
    it; a hub id not yet downloaded is checked when it is built."""
    config = _our_config(sft)
    if config is None:
        return
    warning = context_length_warning(
        config,
        args.cutoff_len,
        f"preset {sft.model!r}" if is_preset(sft.model) else str(Path(sft.model) / "config.json"),
    )
    if warning and int(os.environ.get("RANK", "0")) == 0:
        print(warning, file=sys.stderr)


def _check_router_loss(args, sft: SFTArguments) -> None:
    """router_aux_loss_coef set for our model (check_run calls it off the transformers path, whose model says it when
    built) of a type without routers: the build's one-line error, before anything is built or written."""
    config = _our_config(sft) if args.router_aux_loss_coef else None
    if config is not None and not any(config.layer_moe):
        raise ConfigError(no_router_message(args.router_aux_loss_coef, config.model_type))


def _check_4bit_experts(args, sft: SFTArguments) -> None:
    """load_in_4bit on our mixture-of-experts model under DeepSpeed ZeRO-3: the build's one-line error
    (trainer.parallel.transforms), from the model's config before the data are read or anything is built."""
    config = _our_config(sft) if args.load_in_4bit and uses_zero3(args) else None
    if config is not None and any(config.layer_moe):
        raise ConfigError(ZERO3_4BIT_EXPERTS)


def _check_resume_arguments(args) -> None:
    """A resume with an argument that the checkpoint's state cannot follow (trainer.loop.resume.check_resume_arguments)
    stops here, before the build; the Trainer checks again the checkpoint it resumes ("auto": the newest intact)."""
    if not args.resume_from_checkpoint:
        return
    if str(args.resume_from_checkpoint).lower() in ("true", "auto", "latest"):
        found = checkpoints(args.output_dir)
        if not found:
            return
        resume = found[-1]
    else:
        resume = Path(args.resume_from_checkpoint)
    if saved_world_size(resume) not in (0, int(os.environ.get("WORLD_SIZE", "1"))):
        return  # saved by another number of processes: the Trainer names the batch such a resume needs
    try:
        saved = saved_arguments(resume)
    except (OSError, ValueError):  # damaged: resume auto skips it (and a path to it was refused above)
        return
    check_resume_arguments(resume, args, saved)


def _check_lora(args, sft: SFTArguments) -> None:
    """peft is installed and the LoRA targets and modules to save exist in the model, checked on a copy built on
    the meta device (no memory, no weights read); a hub id not yet downloaded is checked when it is built."""
    import_peft()
    if not (is_preset(sft.model) or Path(sft.model).is_dir()):
        return
    config = preset_config(sft.model)[0] if is_preset(sft.model) else read_config(sft.model)
    with torch.device("meta"):
        lora_config(CausalLM(config), args)


def _check_output_dir(args, sft: SFTArguments, method_args) -> None:
    """output_dir can be written, and holds no trained model or checkpoints that this run would replace unasked.

    Hugging Face's example scripts refuse a non-empty output_dir ("Use --overwrite_output_dir to overcome.");
    here only what a run trained counts (a model or checkpoints; logs and the data cache do not), and a finished run
    with exactly these arguments (output_dir/sft_args.json) may be re-run: it reproduces the same model, so running
    the same command twice works, while any other run needs --overwrite_output_dir, --resume_from_checkpoint or
    another --output_dir."""
    out = Path(args.output_dir)
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"output_dir: {existing} is a file, not a directory (output_dir={out})")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"output_dir: {out} cannot be written (no write permission on {existing})")
    if args.overwrite_output_dir or args.resume_from_checkpoint or not out.is_dir():
        return
    # complete checkpoints only: a run killed during its first save left a checkpoint-N.tmp, and its re-run starts
    trained = (
        "checkpoints"
        if checkpoints(out)
        else "a trained model"
        if any((out / name).exists() for name in ("config.json", "model.safetensors", "adapter_config.json"))
        else None
    )
    if trained is None:
        return
    saved = out / METHODS[sft.stage].run_args_file
    if saved.is_file() and json.loads(saved.read_text()) == run_arguments(args, sft, method_args):
        return
    raise ConfigError(
        f"output_dir: {out} already holds {trained} of another run (it is not empty); use "
        "--overwrite_output_dir to overcome, --resume_from_checkpoint auto to continue it, or another "
        "--output_dir"
    )


def _check_attention(args, sft: SFTArguments, cuda: bool) -> None:
    backend = ATTN_IMPLEMENTATIONS[sft.attn_implementation]
    name = f"attn_implementation={sft.attn_implementation!r}"
    if backend in ("flex", "flash") and not cuda:
        raise ConfigError(
            f"{name} needs a CUDA GPU, and none is visible (on a CPU, flex attention runs forward "
            "only); use sdpa or auto"
        )
    if backend == "flash":
        if _flash_attn() is None:
            raise ConfigError(f"{name} needs flash-attn (pip install flash-attn --no-build-isolation)")
        if not (args.bf16 or args.fp16 or sft.model_dtype in ("bfloat16", "float16")):
            raise ConfigError(f"{name} needs bf16 or fp16 tensors: pass --bf16 (or --fp16)")
