"""The command line's conductor: `python -m trainer.sft`, `trainer.dpo` and `trainer.grpo` (and `--stage <method>`)
are one run, parse -> check -> read inputs -> hold output_dir -> build -> train -> report, whatever the method.

    python -m trainer.sft                                   # the embedded demo (trainer/configs/demo.yaml)
    python -m trainer.dpo                                   # the DPO demo (trainer/configs/dpo_demo.yaml)
    python -m trainer.sft --model PATH_OR_PRESET --data FILE [--eval_data FILE] [--bf16] [any TrainingArguments flag]
    python -m trainer.sft config.yaml [--learning_rate 1e-5]  # flags win over the file; its `stage:` picks the method

What a method brings is its plug-in, a `trainer.methods.base.Method` named in `trainer.cli_args.METHODS`: its options,
its checks, its reader, its trainer, its demo and what its run reports; this module names no method.

The model is a local Hugging Face directory, a built-in preset (`tiny`), or a hub id (downloaded with
`huggingface_hub` when a network is there). Data: JSONL / JSON / Parquet files or directories in any of the
formats `trainer.data.sft_data` reads (`--data`), or what `datasets.load_dataset` reads, mixtures too
(`--dataset_name`, TRL's names: trainer.data.hf_sources); `--dataset_num_proc` tokenises in several processes.
At the end the model is saved in the Hugging Face layout in `output_dir`, the loss curve as `loss_curve.png`, and,
with `--eval_exact_match`, the exact-match accuracy of greedy answers on held-out conversations is printed before
and after training (trainer.data.task_eval).

Several processes (see docs/multi_gpu.md): `torchrun --nproc_per_node N -m trainer.sft ...` or
`accelerate launch -m trainer.sft ...`; `--dist_config` picks fsdp2 or ddp (ddp by default), `--deepspeed ds.json`
DeepSpeed (also under `deepspeed --module trainer.sft ...`; its config is read and checked by `check_run`).
Under fsdp2 the model is built sharded, so that no rank ever holds all of it (`trainer.build.build_model`); under
DeepSpeed each rank builds it whole and ZeRO partitions it when the engine is made. An error on any rank is
printed with its rank and ends that process with exit code 1, which ends the job (no hang); bad input, which every
rank meets alike, is printed once, by rank 0, and every rank exits 2.

Every argument is checked against the machine and the file system (`trainer.cli_args.check_run`), then every file the
run reads (`read_inputs`: the model directory's config, tokenizer and safetensors headers, then the method's reader:
the data tokenised, the val_size split and the batch plan), before the argument summary, the model build or anything
written. A trained model is never replaced unasked: an output_dir holding a model or checkpoints takes only
--overwrite_output_dir, --resume_from_checkpoint, or the very arguments that produced it (saved as sft_args.json,
dpo_args.json, ... at the end; running the same command again works).

Exit codes: 0 done, 1 a failed run: an error on some rank of a multi-process job, training that cannot go on
(every step non-finite, or max_nonfinite_steps in a row: one line, no final model saved), or the disk full (one line
saying how much a checkpoint needs and how much is free, and the resume command), 2 bad input (one line on stderr, no
traceback), 130 stopped by Ctrl-C (the first saves a checkpoint at the end of the step, a second aborts at once),
143 stopped by SIGTERM after saving; a stopped run prints the command that resumes it.
"""

import contextlib
import errno
import functools
import importlib.util
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from kernels.gated_delta_rule import fla_status
from trainer.build import build_model, causal_lm, read_model_files
from trainer.checkpoint_hf import to_json
from trainer.cli_args import ATTN_IMPLEMENTATIONS, METHODS, SFTArguments, check_run, run_arguments
from trainer.coerce import read_config_file
from trainer.config.args import ConfigError, parse_args
from trainer.data.sft_data import DataError
from trainer.data.task_eval import exact_match_accuracy, exact_match_by_kind, exact_match_flags, sample_answers
from trainer.data.tokenizer import TokenizerError
from trainer.dist import end_on_error, init_distributed, world
from trainer.loop.checkpoint import (
    CheckpointError,
    OutOfSpaceError,
    clean_leftovers,
    hold_output_dir,
    move_aside_previous_run,
)
from trainer.loop.metrics import plot_loss_curve
from trainer.loop.trainer import TrainingError, set_seed
from trainer.methods.base import RunInputs
from trainer.model.causal_lm import ModelError
from trainer.model.transformers_model import TransformersModel
from trainer.parallel.transforms import unwrap

SFT_DEMO_MODEL = Path("outputs/demo")  # the SFT demo's output_dir (trainer/configs/demo.yaml), where the others start


def run_command(name: str, argv: list[str] | None = None) -> int:
    """`python -m trainer.<name>`: the command of method `name` (argv: sys.argv's by default). A method whose demo
    starts from the SFT demo's model trains that first (`python -m trainer.sft`) when it is not in outputs/demo."""
    argv = list(sys.argv[1:] if argv is None else argv)
    embedded = not any(a.split("=")[0] in ("--model", "--data", "-h", "--help") or not a.startswith("-") for a in argv)
    if METHODS[name].after_sft_demo and embedded and not (SFT_DEMO_MODEL / "config.json").is_file():
        print(
            f"the {name.upper()} demo starts from the SFT demo's model, which is not in {SFT_DEMO_MODEL}: training "
            f"it first (python -m trainer.sft, about 5 minutes on an idle 2-core CPU; {METHODS['sft'].demo_config})",
            file=sys.stderr,
        )
        code = main([], "sft")
        if code:
            return code
    return main(argv, name)


def main(argv: list[str], stage: str) -> int:
    """The command of `stage` (`python -m trainer.dpo` is stage dpo): a config file and flags, or nothing for the
    embedded default."""
    method = METHODS[stage]
    if not argv or (
        argv[0].startswith("--")
        and "--help" not in argv
        and "-h" not in argv
        and not any(a.split("=")[0] in ("--model", "--data", "--dataset_name") for a in argv)
    ):
        argv = [str(method.demo_config)] + argv  # the embedded default; flags still win
    if method.sets_stage:
        argv = (
            [*argv[:1], "--stage", stage, *argv[1:]]
            if argv and not argv[0].startswith("-")
            else ["--stage", stage, *argv]
        )
    try:
        return _run(argv, stage)
    except KeyboardInterrupt:
        print(
            f"interrupted; to resume from the newest checkpoint, if any:\n    {resume_command(argv, stage)}",
            file=sys.stderr,
        )
        return 130
    except Exception as exc:
        if world()[1] > 1:  # the other ranks would wait for this one in their next collective
            return end_on_error(exc)
        if isinstance(exc, TrainingError):  # the run cannot go on; the message says why and what is on disk
            print(f"error: {exc}", file=sys.stderr)
            return 1
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            # OutOfSpaceError from a checkpoint (it removed its partial copy), or any other write on a full disk
            print(
                f"error: {exc.strerror if isinstance(exc, OutOfSpaceError) else exc}; free space, then resume from "
                f"the newest checkpoint with:\n    {resume_command(argv, stage)}",
                file=sys.stderr,
            )
            return 1
        raise


def _run(argv: list[str], stage: str) -> int:
    try:
        # the method argv asks for (--stage, a config's `stage:`) reads its options in place of the others' (dpo's
        # and grpo's both have beta and loss_type)
        method = METHODS.get(stage_of(argv, stage), METHODS[stage])
        args, sft, method_args = parse_args(
            argv, extra_dataclasses=(SFTArguments, method.arguments), prog=f"python -m {METHODS[stage].command}"
        )
        check_run(args, sft, method_args)
        inputs = read_inputs(args, sft, method_args)  # every file read and checked before the summary, build or write
        with hold_output_dir(args.output_dir, rank=int(os.environ.get("RANK", "0"))):  # one run per output_dir
            return train(args, sft, method_args, argv, inputs)
    except (ConfigError, DataError, ModelError, TokenizerError, CheckpointError) as exc:
        return _user_error(exc)


def stage_of(argv: list[str], default: str) -> str:
    """The stage argv asks for: --stage's value, else a config file's `stage` key, else `default` (the command's)."""
    for i, arg in enumerate(argv):
        if arg == "--stage" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--stage="):
            return arg.partition("=")[2]
    if argv and argv[0].endswith((".yaml", ".yml", ".json")) and Path(argv[0]).is_file():
        data = read_config_file(argv[0])
        if isinstance(data, dict) and isinstance(data.get("stage"), str):
            return data["stage"]
    return default


def _user_error(exc: Exception) -> int:
    """Print a user error in one line; exit code 2. Under a launcher (WORLD_SIZE > 1) only rank 0 prints it:
    every rank reads the same arguments and files and meets the same error, and one copy per rank would bury it
    under the launcher's report. (An error only a non-zero rank meets, e.g. a file missing on another node,
    then shows only as that rank's exit code 2 in the launcher's report.) Every rank returns 2."""
    rank, world_size = world()
    if world_size == 1:  # the process group is not up yet (bad arguments) or there is none
        rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(f"error: {exc}", file=sys.stderr)
    if world_size > 1:  # a rank still waiting in a collective with this one fails at once instead of hanging
        with contextlib.suppress(Exception):
            torch.distributed.destroy_process_group()
    return 2


def read_inputs(args, sft: SFTArguments, method_args) -> RunInputs:
    """Every file the run reads, read and checked before the argument summary, the model build or any write to
    output_dir, each problem one line (exit 2): the model directory's files (`build.read_model_files`: config.json,
    the tokenizer, every safetensors header), then the method's reader: its training and eval data tokenised (read
    from the shared data cache when it holds them, else written there: content-addressed, it is never output_dir's),
    the val_size split, the batch plan the arguments make of that data, and the held-out conversations of the
    exact-match check."""
    _, tokenizer = read_model_files(sft.model, sft.model_impl)  # a hub id not yet here is downloaded first
    return METHODS[sft.stage].read_inputs(args, sft, method_args, tokenizer)


def resume_command(argv: list[str], stage: str) -> str:
    """The command line that continues a stopped run: the same arguments with --resume_from_checkpoint auto."""
    kept, skip_value = [], False
    for arg in argv:
        if skip_value:
            skip_value = False
        elif arg in ("--resume_from_checkpoint", "--stage"):  # the command names the stage
            skip_value = True
        elif not arg.startswith(("--resume_from_checkpoint=", "--stage=")):
            kept.append(arg)
    return shlex.join(["python", "-m", METHODS[stage].command, *kept, "--resume_from_checkpoint", "auto"])


def train(args, sft: SFTArguments, method_args, argv: list[str], inputs: RunInputs) -> int:
    """Build, train and report, on every rank; rank 0 writes the run's files and prints the report."""
    method = METHODS[sft.stage]
    requested = run_arguments(args, sft, method_args)  # before anything in args is resolved (check_run compares it)
    rank, world_size = init_distributed()  # several processes under torchrun/accelerate; (0, 1) otherwise
    args.resolve_world(world_size)  # gradient_accumulation_steps from global_batch_size, before the summary shows it
    out = Path(args.output_dir)
    if rank == 0:
        print(args.summary(), file=sys.stderr)
        leftovers = clean_leftovers(out)  # this run holds output_dir's lock: nothing else is writing there
        if leftovers:
            print(f"output_dir: removed what an interrupted run left: {', '.join(leftovers)}", file=sys.stderr)
        if args.overwrite_output_dir and not args.resume_from_checkpoint:
            aside = move_aside_previous_run(out)
            if aside is not None:
                print(
                    f"overwrite_output_dir: moved the earlier run's checkpoints and model files in {out} to "
                    f"{aside.name}/ (delete it when you no longer need them)",
                    file=sys.stderr,
                )
    eval_ds, conversations = inputs.eval_ds, inputs.conversations
    if rank == 0:
        print(f"train data: {inputs.loaded[0].summary_text()}", file=sys.stderr)
        if eval_ds is not None:
            print(f"eval data: {len(eval_ds)} {method.data_noun}", file=sys.stderr)
    set_seed(args.seed)
    # every model of the run (a method's reference model too) is built as the policy is
    build = functools.partial(
        build_model,
        dtype=sft.model_dtype,
        attn_backend=ATTN_IMPLEMENTATIONS[sft.attn_implementation],
        model_impl=sft.model_impl,
    )
    model, _ = build(sft.model, args)
    if rank == 0:
        print(model_line(model), file=sys.stderr)
    if isinstance(unwrap(model), TransformersModel):  # a stage its head cannot run: one line, before any evaluation
        unwrap(model).check_stage(sft.stage)
    tokenizer = inputs.tokenizer  # saved with the model: the template the data was rendered with
    before = exact_match_accuracy(model, tokenizer, conversations) if conversations else None
    if before is not None and rank == 0:
        print(
            f"exact match before training: {before:.1%} of {len(conversations)} held-out conversations", file=sys.stderr
        )
    trainer = method.trainer(
        model=model,
        args=args,
        train_dataset=inputs.train_ds,
        eval_dataset=eval_ds,
        processing_class=tokenizer,
        **method.trainer_options(args, method_args, build),
    )
    score = method.score if eval_ds is not None else None
    scored = score.measure(trainer, eval_ds) if score is not None else None
    if scored is not None and rank == 0:
        print(
            f"{score.key.replace('_', ' ')} before training: {scored:.1%} of {len(eval_ds)} held-out {score.of_what}",
            file=sys.stderr,
        )
    started = time.perf_counter()
    output = trainer.train()
    state = trainer.state
    elapsed = time.perf_counter() - started
    if trainer.stop_signal is not None:
        print(
            f"stopped by {trainer.stop_signal.name} at step {state.global_step}; resume with:\n"
            f"    {resume_command(argv, sft.stage)}",
            file=sys.stderr,
        )
        return 128 + trainer.stop_signal
    final = trainer.save_model(args.output_dir)
    summary = {"train_runtime_s": round(elapsed, 1), "global_step": state.global_step}
    summary["train_loss"] = round(output.training_loss, 4)  # the mean over the run's steps, as HF reports it
    train_logs = [h for h in state.log_history if "loss" in h]
    if train_logs:
        summary["final_train_loss"] = train_logs[-1]["loss"]
    if eval_ds is not None:
        summary.update(trainer.evaluate())
    if scored is not None:
        summary.update({f"{score.key}_before": scored, f"{score.key}_after": score.measure(trainer, eval_ds)})
    if before is not None:
        flags = exact_match_flags(model, tokenizer, conversations)
        summary.update({"exact_match_before": before, "exact_match_after": sum(flags) / len(flags)})
        if inputs.embedded:  # the demo's tasks learn at different speeds: say which
            summary.update(exact_match_by_kind(conversations, flags))
        # every rank decodes (a collective under FSDP2); rank 0 prints
        for prompt, answer, reference in sample_answers(model, tokenizer, conversations[:5], sft.max_new_tokens):
            if rank == 0:
                print(f"  {prompt!r} -> {answer!r} (reference {reference!r})", file=sys.stderr)
    if rank != 0:  # the files and the report below are rank 0's
        return 0
    (out / "final_metrics.json").write_text(to_json(summary, indent=2) + "\n")
    requested.update(trainer.checkpoint_arguments)  # what ran: a resume keeps the checkpoint's learning rate, ...
    (out / method.run_args_file).write_text(json.dumps(requested, indent=2, sort_keys=True) + "\n")
    plot = plot_loss_curve(state.log_history, out / "loss_curve.png") if sft.plot else None
    print(
        "\n".join(
            [""]
            + how_to_use(final, sft.model, args.use_peft, quantization_config(args))
            + [
                "final metrics: "
                + json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()}),
            ]
            + (
                [f"loss curve: {plot}" if plot else "loss curve: not plotted (pip install matplotlib)"]
                if sft.plot
                else []
            )
        )
    )
    return 0


def model_line(model) -> str:
    """One line saying which model trains: ours (its type and kernels) or transformers' (`kernel_report`)."""
    inner = unwrap(model)
    if isinstance(inner, TransformersModel):
        return inner.kernel_report()
    ours = causal_lm(model)
    kernels_used = {"kernels": "ours (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy)", "liger": "liger-kernel's"}
    c = ours.config
    used = kernels_used.get(ours.impl, "none (PyTorch ops)")
    line = f"our model: {c.model_type} (trainer.model.causal_lm); kernels: {used}"
    on_gpu = next(ours.parameters()).is_cuda
    if "linear_attention" in c.layer_types and ours.impl == "kernels":
        recurrence = fla_status() if on_gpu else "the chunked reference (CPU)"
        line += f"; Gated DeltaNet: causal conv and gated norm ours, recurrence {recurrence}"
    if c.text_of is not None:
        line += f"; of the {c.text_of} checkpoint its text model only: the vision tower is neither trained nor saved"
    if any(c.layer_moe):
        experts = "our grouped GEMMs" if ours.impl == "kernels" and on_gpu else "the expert loop in PyTorch"
        shared = " beside a gated shared expert" if c.shared_expert_intermediate_size else ""
        aux = (
            f"load-balancing loss x router_aux_loss_coef {c.router_aux_loss_coef:g}"
            if c.output_router_logits
            else "no load-balancing loss (output_router_logits false)"
        )
        line += (
            f"; mixture of experts: {sum(c.layer_moe)} layers of {c.num_experts} experts, {c.num_experts_per_tok} per "
            f"token through {experts}{shared}, {aux}"
        )
    return line


def quantization_config(args) -> str:
    """transformers' `quantization_config=BitsAndBytesConfig(...)` argument that loads the base as the run did (4-bit
    or 8-bit weights), or '' for a full-precision base."""
    if args.load_in_8bit:
        return (
            f", quantization_config=BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold={args.llm_int8_threshold})"
        )
    if not args.load_in_4bit:
        return ""
    dtype = f", bnb_4bit_compute_dtype={args.bnb_4bit_compute_dtype!r}" if args.bnb_4bit_compute_dtype else ""
    return (
        f", quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type={args.bnb_4bit_quant_type!r}"
        f", bnb_4bit_use_double_quant={args.bnb_4bit_use_double_quant}{dtype})"
    )


def how_to_use(final: Path, model: str, lora: bool, quantization: str = "") -> list[str]:
    """The lines printed at the end: where the model (or the LoRA adapter) is, and how to load and try it;
    `quantization`: `quantization_config`'s argument for a base trained in 4 bits."""
    where = str(final.resolve())
    if lora:
        return [
            f"LoRA adapter saved to {where} (adapter_config.json + adapter_model.safetensors, peft's layout)",
            "load it with transformers and peft:",
            "    from peft import PeftModel",
            f"    from transformers import AutoModelForCausalLM{', BitsAndBytesConfig' if quantization else ''}",
            f"    base = AutoModelForCausalLM.from_pretrained(BASE{quantization})",
            f"    model = PeftModel.from_pretrained(base, {where!r})",
            f"  (BASE: a Hugging Face directory of the base model {model!r})",
            f"merge it into a plain model: python -m trainer.merge --model {model} --adapter {final} --output_dir OUT",
            f'or try it here: python -m trainer.generate --model {model} --adapter {final} --prompt "..."',
        ]
    hint = "" if importlib.util.find_spec("transformers") else " (pip install transformers)"
    return [
        f"model saved to {where}",
        f"load it with transformers{hint}:",
        "    from transformers import AutoModelForCausalLM, AutoTokenizer",
        f"    model = AutoModelForCausalLM.from_pretrained({where!r})",
        f"    tokenizer = AutoTokenizer.from_pretrained({where!r})",
        f'or try it here: python -m trainer.generate --model {final} --prompt "..."',
    ]


if __name__ == "__main__":
    raise SystemExit(main())
