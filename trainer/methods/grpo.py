"""GRPO (TRL's `GRPOTrainer`) on the Trainer's loop: sample completions of a batch of prompts, score them, and take
policy-gradient steps on them; with TRL's num_iterations and steps_per_generation, several steps on one generation.

    trainer = GRPOTrainer(model=model, reward_funcs=["exact_match"], args=TrainingArguments(...),
                          grpo=GRPOArguments(num_generations=8), train_dataset=[{"prompt": [...]}, ...],
                          processing_class=tokenizer)
    trainer.train()

The generation cycle (TRL's `_prepare_inputs` and `_buffered_inputs`). A generation batch is
generation_batch_size = per_device_train_batch_size x processes x steps_per_generation completions
(steps_per_generation S a multiple of gradient_accumulation_steps GA, default GA; `check_grpo_batch`). It makes
S / GA optimizer steps, each a window of GA micro batches of its own rows, and with num_iterations mu it is trained
on mu times: S mu / GA optimizer steps per generation, then the next. The loader (`_GenerationLoader`) hands each
rank's prompts of a generation batch out for the S mu micro steps of its cycle, as TRL's RepeatSampler repeats them.

At the cycle's first step (`_generate`):
1. The prompts: per_device_train_batch_size x S / num_generations of them on each rank, drawn as TRL's RepeatSampler
   draws them: shuffled by data_seed, incomplete batches dropped.
2. Generation (`trainer.methods.grpo_sampling.sample_completions`): num_generations completions per prompt from the
   current policy with the KV cache, the prompt's prefill shared; the random draws keyed by (seed, step, the
   completion's index in the global generation batch), so the completions do not depend on the number of processes
   or micro batches.
3. Rewards (`trainer.methods.grpo_rewards.score`, TRL's call signature, each rank its rows) and advantages
   (`grpo_advantages`) over the whole generation batch, all ranks' rewards gathered first, as TRL does.
4. Every rank's rows are gathered (ids, masks, advantages: small beside the generation), so each rank holds the
   whole batch (`_Generation`); when several steps share it (S > GA) its rows are shuffled before they are dealt
   to the steps, as TRL's shuffle_sequence_dict does, by a permutation keyed by (seed, step) of the whole batch
   (TRL shuffles each process's rows with the global torch generator: a deliberate difference, so that the rows a
   step takes, and the update, do not depend on the number of processes). Step j of each pass takes rows
   [j W, (j + 1) W) of that order (W = per_device_train_batch_size x processes x GA), rank r the r-th share.
5. The old policy's per-token log-probs (TRL's old_per_token_logps), when the batch is trained on after an update
   (mu > 1 or S > GA; otherwise the loss takes the policy's own, detached, as TRL), and the reference's (beta > 0),
   under no_grad through the model's head (`kernels.fused_linear_logprob`), each rank its rows in the very micro
   batches its steps will train on, then summed over the ranks into the buffer (`_buffered_logps`). At the first
   step of the first pass the importance ratio is then 1 (bit for bit on the CPU: the update equals
   num_iterations 1's); later the clipping acts and the clip_ratio metrics move.

Each step (`_forward_backward`): the loss of each micro batch of per_device_train_batch_size rows through the
model's final hidden states and `fused_grpo_loss` (the LM head over the completion rows only, never the (rows,
vocabulary) logits), divided by a normaliser over all ranks fixed before the micro batches: for grpo, bnpo and
dr_grpo the window's (`grpo_normalizer` of its rows), for dapo and cispo TRL's, the generation batch's completion
tokens / (S / GA). The update is then that of one batch holding the window, whatever the split into micro batches
and processes (a difference from TRL on purpose for bnpo with unequal micro batches; trainer/methods/grpo_loss.py
says which types TRL divides otherwise).

Checkpoints and resume: a checkpoint taken inside a cycle holds the buffered generation (`_method_state`:
method_state.pt, with completions, masks, advantages, order, old and reference log-probs) and the loader's place
in the cycle; a resumed run trains the cycle's remaining steps on it, bit for bit as the unbroken run
(regenerating would be wrong: the policy that sampled it is gone). A resume under another cycle
(steps_per_generation x num_iterations) is refused in one line.

The reference, with beta > 0, is a frozen copy of the model as it was given, or with a LoRA adapter the model with
the adapter disabled. Logged with the loss, grad_norm and learning_rate, TRL's names, each the mean over the values
recorded since the last log, as TRL's: once per generation (so only at a log that follows a generation, as TRL)
reward, reward_std, frac_reward_zero_std, rewards/<function>/mean|std, completions/mean_length|min_length|
max_length, completions/clipped_ratio, over the whole generation batch; once per micro batch kl (beta > 0),
entropy, clip_ratio/* (cispo_clip_ratio). `log_completions` writes each generation's prompts, completions,
rewards and advantages to output_dir/completions.jsonl (rank 0, `step` the step that generated them).

Under FSDP2 and DeepSpeed (ZeRO-2/3) the generation holds the whole weights for its duration (the engine's
`full_weights()`: FSDP2's units unsharded from the prefill on, ZeRO-3's partitions gathered once with its hooks off),
so decoding makes no collective and ranks whose completions end early stop alone; the loss and the log-probs run
through the sharded engine; the reference is sharded like the policy (`trainer.build.frozen_copy`; DeepSpeed's
`frozen`, as DPO's).

Evaluation (`evaluate`, and the loop's eval schedule with an eval_dataset: prompt records like train_dataset's, or a
dict of them), as TRL's: every eval prompt once, num_generations_eval (default num_generations) completions each,
sampled, scored and put through the loss with the policy as its own old policy, in batches of
per_device_eval_batch_size completions a process; reports eval_loss and TRL's metrics with the eval_ prefix
(eval_reward, eval_completions/mean_length, eval_kl, ...). Its draws are keyed apart from training's, so training
with evaluations between its steps is bit for bit the training without them.

Not here (yet), each refused in one line: FSDP2's CPU offload (untested: it needs a GPU); a steps_per_generation
that is not a multiple of gradient_accumulation_steps (TRL allows it: a step would then span two generations);
vLLM, tools and multimodal prompts, which this project does not have.
"""

import functools
import json
import time
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

import kernels
from trainer.build import causal_lm, frozen_copy
from trainer.checkpoint_hf import CheckpointError
from trainer.config.args import ConfigError, _arg
from trainer.data.batching import BatchLoader
from trainer.data.hf_datasets import eval_whole, hf_kind
from trainer.data.sft_data import DataError, resolve_data_files
from trainer.loop.checkpoint import METHOD_STATE
from trainer.loop.trainer import Trainer, _Window
from trainer.methods.grpo_loss import (
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_TYPES,
    SCALE_REWARDS,
    completion_length_metrics,
    fused_grpo_loss,
    grpo_advantages,
    grpo_normalizer,
)
from trainer.methods.grpo_rewards import load_reward_function, reward_name, score
from trainer.methods.grpo_sampling import sample_completions
from trainer.model.lora import adapters_disabled, has_adapter
from trainer.parallel.transforms import full_weights, gradient_sync, unwrap

COMPLETIONS_FILE = "completions.jsonl"
# what GRPOTrainer.evaluate always reports, as eval_<name> (with rewards/<function>/mean|std, and clip_ratio/* from
# the loss)
EVAL_METRICS = (
    "loss",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "kl",
    "entropy",
    "runtime",
    "samples_per_second",
)
# evaluation's sampling key: the step word's top bit set, so its draws are never training's (steps < 2**31)
EVAL_STEP = 1 << 31


@dataclass
class GRPOArguments:
    """TRL's GRPOConfig names and defaults (trl 1.16) for what GRPO adds to TrainingArguments (no `from __future__
    import annotations` in this module: the argument parser reads these annotations as types)."""

    num_generations: int = _arg(8, "grpo", "Completions sampled per prompt (the group).")
    num_generations_eval: int | None = _arg(
        None, "grpo", "Completions sampled per prompt in evaluation (default: num_generations)."
    )
    max_completion_length: int = _arg(512, "grpo", "Longest completion, in tokens.")
    temperature: float = _arg(1.0, "grpo", "Sampling temperature (also divides the logits of the log-probs).")
    top_p: float = _arg(1.0, "grpo", "Nucleus sampling: keep the most likely tokens up to this probability.")
    top_k: int = _arg(0, "grpo", "Keep the k most likely tokens (0: all).")
    min_p: float | None = _arg(None, "grpo", "Drop tokens below min_p times the most likely one's probability.")
    repetition_penalty: float = _arg(1.0, "grpo", "transformers' repetition penalty (1: none).")
    beta: float = _arg(0.0, "grpo", "KL coefficient against the reference model (0: no reference is held).")
    epsilon: float = _arg(0.2, "grpo", "Lower clipping range of the importance ratio.")
    epsilon_high: float | None = _arg(None, "grpo", "Upper clipping range (default: epsilon); cispo's cap.")
    delta: float | None = _arg(None, "grpo", "Two-sided clipping: cap the unclipped ratio at delta.")
    loss_type: str = _arg("dapo", "grpo", "The GRPO loss's normalisation.", choices=LOSS_TYPES)
    importance_sampling_level: str = _arg(
        "token", "grpo", "Importance ratio per token, or per sequence (GSPO).", choices=IMPORTANCE_SAMPLING_LEVELS
    )
    scale_rewards: str = _arg(
        "group", "grpo", "Divide advantages by the reward std of the group, the batch, or not.", choices=SCALE_REWARDS
    )
    use_bias_correction_kl: bool = _arg(True, "grpo", "Weight the KL term by the importance ratio (TRL's default).")
    reward_funcs: list[str] | None = _arg(
        None,
        "grpo",
        "Reward functions, each (in this order of resolution): exact_match, format (the embedded tasks'), TRL's "
        "accuracy_reward, reasoning_accuracy_reward (these two need math_verify), think_format_reward, "
        "get_soft_overlong_punishment (1280 tokens, a cache of 256, as TRL's script); path.py:function, "
        "module:function or TRL's dotted module.function (imported from the working directory, then sys.path); or a "
        "sequence-classification model directory. Default exact_match.",
    )
    reward_weights: list[float] | None = _arg(None, "grpo", "One weight per reward function (default 1 each).")
    mask_truncated_completions: bool = _arg(
        False, "grpo", "Leave completions that reached max_completion_length without EOS out of the loss."
    )
    top_entropy_quantile: float = _arg(
        1.0, "grpo", "Train only on the completion tokens in this top share of entropy (1: all)."
    )
    log_completions: bool = _arg(False, "grpo", "Write every step's completions and rewards to completions.jsonl.")
    num_iterations: int = _arg(
        1, "grpo", "Passes over each generation batch (TRL's mu): each pass takes its optimizer steps again."
    )
    steps_per_generation: int | None = _arg(
        None,
        "grpo",
        "Micro steps per generation batch on each process, a multiple of gradient_accumulation_steps (its "
        "default); not with generation_batch_size.",
    )
    generation_batch_size: int | None = _arg(
        None,
        "grpo",
        "Completions per generation batch over all processes: per_device_train_batch_size x processes x "
        "steps_per_generation (default: the global batch); not with steps_per_generation.",
    )

    def __post_init__(self):
        for name, choices in (
            ("loss_type", LOSS_TYPES),
            ("importance_sampling_level", IMPORTANCE_SAMPLING_LEVELS),
            ("scale_rewards", SCALE_REWARDS),
        ):
            if getattr(self, name) not in choices:
                raise ConfigError(f"{name}={getattr(self, name)!r}: expected one of {', '.join(choices)}")
        if not isinstance(self.num_generations, int) or self.num_generations < 2:
            raise ConfigError(
                f"num_generations={self.num_generations!r}: expected an int >= 2 (advantages compare a prompt's "
                "completions with each other)"
            )
        if self.num_generations_eval is not None and (
            not isinstance(self.num_generations_eval, int) or self.num_generations_eval < 1
        ):
            raise ConfigError(f"num_generations_eval={self.num_generations_eval!r}: expected an int >= 1")
        if not isinstance(self.max_completion_length, int) or self.max_completion_length < 1:
            raise ConfigError(f"max_completion_length={self.max_completion_length!r}: expected an int >= 1")
        if not self.temperature > 0:
            raise ConfigError(f"temperature={self.temperature!r}: must be > 0 (GRPO samples its completions)")
        if self.beta < 0:
            raise ConfigError(f"beta={self.beta!r}: must be >= 0")
        if not self.epsilon > 0 or (self.epsilon_high is not None and not self.epsilon_high > 0):
            raise ConfigError(f"epsilon={self.epsilon!r}, epsilon_high={self.epsilon_high!r}: must be > 0")
        if self.delta is not None and not self.delta > 1:
            raise ConfigError(f"delta={self.delta!r}: must be > 1 (it caps the importance ratio)")
        if not 0 < self.top_entropy_quantile <= 1:
            raise ConfigError(f"top_entropy_quantile={self.top_entropy_quantile!r}: must be in (0, 1]")
        if not isinstance(self.num_iterations, int) or self.num_iterations < 1:
            raise ConfigError(f"num_iterations={self.num_iterations!r}: expected an int >= 1")
        for name in ("steps_per_generation", "generation_batch_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name}={value!r}: expected an int >= 1")
        if self.steps_per_generation is not None and self.generation_batch_size is not None:
            raise ConfigError(
                f"steps_per_generation={self.steps_per_generation} and generation_batch_size="
                f"{self.generation_batch_size}: set one of them (generation_batch_size = "
                "per_device_train_batch_size x processes x steps_per_generation)"
            )
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs or ["exact_match"]):
            raise ConfigError(
                f"reward_weights: {len(self.reward_weights)} weights for "
                f"{len(self.reward_funcs or ['exact_match'])} reward functions (one weight per function)"
            )

    @property
    def epsilon_upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def check_grpo_batch(args, grpo: GRPOArguments, world_size: int) -> int:
    """What GRPO's generation batch takes of the TrainingArguments (the trainer's and the CLI's check), each a
    one-line ConfigError: a generation batch of whole optimizer steps whose completions per process num_generations
    divides, normal batches, no FSDP2 CPU offload. Returns steps_per_generation as given or implied (TRL's
    GRPOConfig: generation_batch_size = per_device_train_batch_size x processes x steps_per_generation, default
    gradient_accumulation_steps)."""
    micro, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
    steps = grpo.steps_per_generation or accum
    if grpo.generation_batch_size is not None:
        if grpo.generation_batch_size % (micro * world_size):
            raise ConfigError(
                f"generation_batch_size={grpo.generation_batch_size}: must be a multiple of "
                f"per_device_train_batch_size x processes = {micro} x {world_size} = {micro * world_size}"
            )
        steps = grpo.generation_batch_size // (micro * world_size)
    if steps % accum:
        given = (
            f"steps_per_generation={steps}"
            if grpo.generation_batch_size is None
            else f"generation_batch_size={grpo.generation_batch_size} (steps_per_generation {steps})"
        )
        raise ConfigError(
            f"{given}: must be a multiple of gradient_accumulation_steps ({accum}): each optimizer step takes "
            "whole micro batches of one generation batch"
        )
    rows = micro * steps
    if rows % grpo.num_generations:
        raise ConfigError(
            f"num_generations={grpo.num_generations}: must divide the completions of a generation batch on each "
            f"process, per_device_train_batch_size x steps_per_generation = {micro} x {steps} = {rows}"
        )
    if (args.dist_config or {}).get("name") == "fsdp2" and args.dist_config.get("offload_params"):
        raise ConfigError(
            "dist_config fsdp2 with offload_params: stage grpo does not support FSDP2's CPU offload yet (generation "
            "holds the whole weights on the accelerator; untested, FSDP2's offload needs a GPU)"
        )
    if args.batching_strategy != "normal":
        raise ConfigError(f"batching_strategy={args.batching_strategy!r}: stage grpo batches prompts 'normal'ly only")
    return steps


def check_grpo_eval(args, grpo: GRPOArguments) -> int:
    """The evaluation's group size, num_generations_eval (default num_generations), which must divide
    per_device_eval_batch_size so that each process samples whole groups (one-line ConfigError). TRL asks it of
    the global eval batch only, and gathers a group split across processes; here a group never is."""
    G = grpo.num_generations_eval or grpo.num_generations
    if args.per_device_eval_batch_size % G:
        raise ConfigError(
            f"per_device_eval_batch_size={args.per_device_eval_batch_size}: must be a multiple of "
            f"num_generations_eval={G} (each process samples whole groups of completions of its prompts)"
        )
    return G


class PromptDataset:
    """Prompts to sample from: records with a "prompt" (text, or a conversation whose assistant turn is to come,
    rendered with the chat template and its generation prompt, as TRL does) and any other columns, which reach the
    reward functions as keyword arguments (a "solution" for exact_match, say)."""

    def __init__(self, records: list[dict], tokenizer, wheres=None, name: str = "train_dataset"):
        self.records, self.prompt_ids = [], []
        self.source = name  # what summary_text names (the CLI sets its files)
        for i, record in enumerate(records):
            prompt = record.get("prompt") if isinstance(record, dict) else None
            if isinstance(prompt, str) and prompt:
                ids = tokenizer.encode(prompt, add_special_tokens=True)
            elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "content" in m for m in prompt):
                ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            else:
                where = wheres[i] if wheres is not None else f"{name}[{i}]"
                raise DataError(f"{where}: no prompt (expected a 'prompt' holding text or a list of messages)")
            self.records.append(dict(record))
            self.prompt_ids.append(list(ids))
        if not self.records:
            raise DataError(f"{name}: no prompts")
        self.lengths = np.array([len(ids) for ids in self.prompt_ids], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.records)

    def summary_text(self) -> str:
        return f"{len(self)} prompts from {self.source}, {int(self.lengths.sum()):,} prompt tokens"

    def __getitem__(self, i: int) -> dict:
        return self.records[i]


def read_prompt_records(paths) -> tuple[list[dict], list[str]]:
    """(records, where each came from as file:line) of JSONL files, or JSON files holding a list of records; a line
    that is not a JSON object is a one-line DataError naming its file and line."""
    records, wheres = [], []
    for path in resolve_data_files(paths):
        path = Path(path)
        if path.suffix == ".json":
            try:
                rows = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
            if not isinstance(rows, list):
                raise DataError(f"{path}: expected a list of prompt records")
            pairs = [(f"{path}[{i}]", row) for i, row in enumerate(rows)]
        elif path.suffix == ".jsonl":
            pairs = []
            with open(path) as f:
                for line_no, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            pairs.append((f"{path}:{line_no}", json.loads(line)))
                        except json.JSONDecodeError:
                            raise DataError(f"{path}:{line_no}: invalid JSON") from None
        else:
            raise DataError(f"{path}: GRPO reads prompts from .jsonl or .json files")
        for where, row in pairs:
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object with a 'prompt'")
            records.append(row)
            wheres.append(where)
    return records, wheres


def prompts_from_conversations(conversations: list[list[dict]]) -> list[dict]:
    """Prompt records of conversations that end with the assistant's answer: the messages before it as the prompt, the
    answer as the "solution" column (what exact_match compares with)."""
    return [{"prompt": messages[:-1], "solution": messages[-1]["content"]} for messages in conversations]


class _GenerationLoader:
    """The loop's train loader for GRPO: each item of the inner loader (one rank's prompts of a generation batch) is
    handed out `repeats` times, steps_per_generation x num_iterations, one per micro step of its generation cycle
    (TRL's RepeatSampler repeat_count), with its position in the cycle; GRPOTrainer._forward_backward generates
    from the item at position 0 and trains on the buffered generation at the others. Lengths and the data position
    are counted in micro steps; the position inside the cycle is saved with the inner loader's state, and a loader
    restored inside a cycle first hands out its remaining micro steps (without prompts: the checkpoint holds the
    generation)."""

    def __init__(self, inner: BatchLoader, accum: int, repeats: int):
        self.inner, self.accum, self.repeats = inner, accum, repeats
        self.max_tokens = None
        self.handed = 0  # micro steps of the current item handed out

    @property
    def epoch(self) -> int:
        return self.inner.epoch

    @property
    def inside_cycle(self) -> bool:
        """Whether the micro steps handed out stop inside a generation cycle (a checkpoint then needs its buffer)."""
        return 0 < self.handed < self.repeats

    def __len__(self) -> int:
        return len(self.inner) * self.repeats

    def global_batches(self, epoch: int) -> list:
        return [b for b in self.inner.global_batches(epoch) for _ in range(self.repeats)]

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)
        self.handed = 0

    def __iter__(self):
        for position in range(self.handed if self.inside_cycle else self.repeats, self.repeats):
            self.handed = position + 1
            yield {"indices": None, "position": position}
        for item in self.inner:
            for position in range(self.repeats):
                self.handed = position + 1
                yield {**item, "position": position}

    def state_dict(self) -> dict:
        return {**self.inner.state_dict(), "handed": self.handed, "repeats": self.repeats}

    def load_state_dict(self, state: dict) -> None:
        repeats = state.get("repeats", self.accum)  # saved before generation cycles: one optimizer step each
        if repeats != self.repeats:
            raise ValueError(
                f"cannot resume the data loader: a generation batch was {repeats} micro steps (steps_per_generation "
                f"x num_iterations), is {self.repeats}; resume with the GRPO arguments the checkpoint was saved with"
            )
        self.inner.load_state_dict(state)
        self.handed = int(state.get("handed", 0))


@dataclass
class _Generation:
    """One generation batch, whole: every process's rows in global completion order (row i is completion i % G of
    prompt i // G), as the optimizer steps that share it train on it (TRL's _buffered_inputs), and as a checkpoint
    inside its cycle saves it (the policy that sampled it is gone by then). CPU tensors."""

    prompt_index: torch.Tensor  # (N,) long: each row's prompt in the train dataset
    completion_ids: torch.Tensor  # (N, L) long, pad_token_id after a completion's end
    completion_mask: torch.Tensor  # (N, L) long, truncated completions zeroed with mask_truncated_completions
    advantages: torch.Tensor  # (N,) float32, over the whole generation batch
    order: torch.Tensor  # (N,) long: the rows in the order the steps take them, window after window
    old_logps: torch.Tensor | None  # (N, L) float32, the policy's at generation (None: trained on at once)
    ref_logps: torch.Tensor | None  # (N, L) float32, the reference's (beta > 0)

    def state_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _pad_cat(parts: list[torch.Tensor], value: int) -> torch.Tensor:
    """(sum n_i, max L_i): the (n_i, L_i) tensors stacked, each padded on the right with `value`."""
    L = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, L - p.shape[1]), value=value) for p in parts])


def _head_logps(hidden, weight, *, target, columns, temperature, softcap=None):
    out = kernels.fused_linear_logprob(hidden, weight, target, temperature=temperature, softcap=softcap)
    return None, {"logps": out.logps[:, columns]}


def _columns(logps: torch.Tensor | None, part: np.ndarray, batch: dict, device) -> torch.Tensor | None:
    """The buffered (N, L) log-probs of a micro batch's rows, trimmed to its completion columns, on the device."""
    if logps is None:
        return None
    return logps[part, : batch["completion_mask"].shape[1]].to(device)


class GRPOTrainer(Trainer):
    """The Trainer with GRPO's generation, rewards, loss and evaluation (module docstring). `reward_funcs`: a
    function, a spec string (`trainer.methods.grpo_rewards.load_reward_function`) or a list of them (TRL's
    argument); train_dataset and eval_dataset: prompt records (`_prompt_dataset`)."""

    stage = "grpo"

    def __init__(
        self, model=None, reward_funcs=None, args=None, grpo: GRPOArguments | None = None, train_dataset=None, **kwargs
    ):
        for name in ("data_collator", "compute_metrics", "preprocess_logits_for_metrics"):
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"GRPOTrainer: {name} is not supported (prompts are collated here; the logits are never formed; "
                    "evaluation reports the rewards of sampled completions)"
                )
        super().__init__(model=model, args=args, train_dataset=train_dataset, **kwargs)
        self.grpo = grpo or GRPOArguments()
        g, a = self.grpo, self.args
        if self.processing_class is None:
            raise ValueError("GRPOTrainer: processing_class (the tokenizer) is needed to decode completions")
        specs = reward_funcs if reward_funcs is not None else (g.reward_funcs or ["exact_match"])
        specs = specs if isinstance(specs, (list, tuple)) else [specs]
        self.reward_funcs = [load_reward_function(f) if isinstance(f, str) else f for f in specs]
        self.reward_names = [reward_name(f) for f in self.reward_funcs]
        weights = g.reward_weights or [1.0] * len(self.reward_funcs)
        if len(weights) != len(self.reward_funcs):
            raise ConfigError(
                f"reward_weights: {len(weights)} weights for {len(self.reward_funcs)} reward functions "
                "(one weight per function)"
            )
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)
        self.steps_per_generation = check_grpo_batch(a, g, self.world_size)  # resolved again when training starts
        self.train_dataset = self._prompt_dataset(self.train_dataset, "train_dataset")
        if self.eval_dataset is not None:
            check_grpo_eval(a, g)
            self.eval_dataset = self._prompt_dataset(self.eval_dataset, "eval_dataset")
        self.ref_model = None
        if g.beta > 0 and not has_adapter(unwrap(self.model)):
            self.ref_model = frozen_copy(unwrap(self.model), a)  # sharded alike under FSDP2
        self._ref_prepared = False  # whether the reference went through the engine's `frozen` (_reference_logps)
        self._metrics: dict[str, list[torch.Tensor]] = {}
        self._generation: _Generation | None = None  # the generation batch the current cycle trains on

    # ---- data -------------------------------------------------------------------------------------------------
    def _prepare_dataset(self, dataset, name: str):
        return dataset  # prompts are read once the tokenizer is known (_prompt_dataset)

    def _prompt_dataset(self, dataset, name: str):
        """`dataset` as a PromptDataset: a list of prompt records or a `datasets.Dataset` of them; as eval_dataset a
        dict (or DatasetDict) of them too, evaluated split by split (metrics eval_<split>_<name>, as Trainer's)."""
        if isinstance(dataset, PromptDataset):
            return dataset
        if name == "eval_dataset" and (isinstance(dataset, dict) or hf_kind(dataset) == "DatasetDict"):
            return {key: self._prompt_dataset(part, f"{name}[{key!r}]") for key, part in dataset.items()}
        if hf_kind(dataset) == "Dataset":
            dataset = dataset.to_list()
        if not isinstance(dataset, (list, tuple)):
            raise ValueError(
                f"GRPOTrainer: {name} must be a list of prompt records, a datasets.Dataset of them or a "
                f"trainer.methods.grpo.PromptDataset, got {type(dataset).__name__}"
            )
        return PromptDataset(list(dataset), self.processing_class, name=name)

    def _train_loader(self, micro: int):
        a, g = self.args, self.grpo
        self.steps_per_generation = check_grpo_batch(a, g, self.world_size)  # after train() settled the batch
        inner = BatchLoader(
            self.train_dataset,
            micro_batch_size=micro * self.steps_per_generation // g.num_generations,
            shuffle=a.train_shuffle,
            seed=a.data_seed if a.data_seed is not None else a.seed,
            drop_last=True,  # TRL's RepeatSampler yields whole generation batches only
            rank=self.rank,
            world_size=self.world_size,
        )
        inner.collate = lambda indices, is_padding=False: {"indices": [int(i) for i in indices]}
        accum = a.gradient_accumulation_steps
        return _GenerationLoader(inner, accum, self.steps_per_generation * g.num_iterations)

    @property
    def windows_per_generation(self) -> int:
        """Optimizer steps in one pass over a generation batch: steps_per_generation / gradient_accumulation_steps."""
        return self.steps_per_generation // self.args.gradient_accumulation_steps

    # ---- one step -----------------------------------------------------------------------------------------------
    def _forward_backward(self, run, micro_batches: list) -> _Window:
        g, model, device = self.grpo, run.model, run.device
        accum = len(micro_batches)
        place = micro_batches[0]["position"] // accum  # this optimizer step's place in its generation cycle
        if place == 0:
            self._generation = self._generate(run, micro_batches[0]["indices"], accum)
        gen = self._generation
        window, rows = self._window_rows(gen, place % self.windows_per_generation)
        if g.loss_type in ("dapo", "cispo"):  # TRL: the generation batch's tokens, shared by the steps it makes
            normalizer = grpo_normalizer(g.loss_type, gen.completion_mask) / self.windows_per_generation
        else:
            normalizer = grpo_normalizer(g.loss_type, gen.completion_mask[window], g.max_completion_length)
        # each rank's loss is world_size x its share (DDP's mean)
        normalizer = (normalizer / self.world_size).to(device)

        model.train()
        window_loss = torch.zeros((), device=device, dtype=torch.float32)
        window_tokens = 0
        parts = np.array_split(rows, accum)
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            batch = self._rows_batch(gen, part)
            head = self._loss_head(
                batch,
                gen.advantages[part],
                _columns(gen.old_logps, part, batch, device),
                _columns(gen.ref_logps, part, batch, device),
                normalizer,
                device,
            )
            with gradient_sync(model, last):
                with self._autocast(device, train=True):
                    out = model(
                        input_ids=batch["input_ids"].to(device),
                        attention_mask=batch["attention_mask"].to(device),
                        head=head,
                    )
                loss = out.loss
                if out.get("aux_loss") is not None:  # a mixture of experts' router loss, as TRL adds it: / accum
                    loss = loss + causal_lm(model).config.router_aux_loss_coef * out.aux_loss / accum
                    self._record_aux_loss(out)
                run.engine.backward(loss, last)
            window_loss += loss.detach().float()
            self._record(out.metrics)
            if not last:
                self._fire("on_substep_end")
            tokens = int(batch["attention_mask"].sum())
            run.throughput.add(tokens, int(batch["completion_mask"].sum()))
            window_tokens += tokens
        return self._window(window_loss, window_tokens, device)

    def _loss_head(self, batch: dict, advantages, old_logps, ref_logps, normalizer, device):
        """The model's head for a micro batch's GRPO loss (`fused_grpo_loss` with the GRPO arguments): old_logps None
        takes the policy's own, detached (ratio 1); ref_logps the reference's where beta > 0."""
        g = self.grpo
        return functools.partial(
            fused_grpo_loss,
            target=batch["target"],
            advantages=advantages.to(device),
            completion_mask=batch["completion_mask"].to(device),
            completion_columns=batch["columns"],
            temperature=g.temperature,
            old_logps=old_logps,
            ref_logps=ref_logps,
            loss_type=g.loss_type,
            beta=g.beta,
            epsilon=g.epsilon,
            epsilon_high=g.epsilon_upper,
            delta=g.delta,
            importance_sampling_level=g.importance_sampling_level,
            top_entropy_quantile=g.top_entropy_quantile,
            use_bias_correction_kl=g.use_bias_correction_kl,
            max_completion_length=g.max_completion_length,
            normalizer=normalizer,
        )

    def _generate(self, run, indices: list[int], accum: int) -> _Generation:
        """A generation batch from this rank's prompts (`indices`): sampled, scored, its advantages over every
        rank's rewards, every rank's rows gathered, shuffled when several steps share it, and the old policy's and
        the reference's log-probs where the loss needs them. Records the generation's metrics (TRL's, once per
        generation) and, with log_completions, writes its rows."""
        g, args, device, tok = self.grpo, self.args, run.device, self.processing_class
        records = [self.train_dataset[i] for i in indices]
        prompt_ids = [self.train_dataset.prompt_ids[i] for i in indices]
        G, step = g.num_generations, self.state.global_step
        ids, mask, truncated, rewards = self._sample_and_score(
            records, prompt_ids, G, step, self.rank * len(prompt_ids) * G, device
        )
        N = ids.shape[0]
        rows = [r // G for r in range(N)]  # row r's prompt among this rank's
        advantages, rewards, reward_metrics = self._advantages(rewards, device)
        prompt_index = torch.tensor([indices[p] for p in rows])
        everyone = self._gather({"prompt_index": prompt_index, "ids": ids, "mask": mask, "truncated": truncated})
        ids = _pad_cat([e["ids"] for e in everyone], tok.pad_token_id)  # (N all ranks, L)
        mask = _pad_cat([e["mask"] for e in everyone], 0)
        truncated = torch.cat([e["truncated"] for e in everyone])
        prompt_index = torch.cat([e["prompt_index"] for e in everyone])
        lengths = mask.sum(1)
        self._record(reward_metrics)
        self._record(completion_length_metrics(lengths.float()))
        self._record({"completions/clipped_ratio": truncated.float().mean()})
        if g.log_completions and self.rank == 0:
            self._log_completions(step, prompt_index, ids, lengths, rewards, advantages)
        if g.mask_truncated_completions:
            mask = mask * (~truncated).long()[:, None]
        order = torch.arange(ids.shape[0])
        if self.windows_per_generation > 1:  # TRL shuffles the rows before dealing them to the steps
            order = torch.from_numpy(np.random.default_rng([args.seed, step]).permutation(ids.shape[0]))
        gen = _Generation(prompt_index, ids, mask, advantages, order, None, None)
        run.model.train()
        gen.old_logps, gen.ref_logps = self._buffered_logps(gen, device, accum)
        return gen

    def _sample_and_score(self, records, prompt_ids, G: int, step: int, first_completion_index: int, device):
        """(completion_ids, completion_mask, truncated, rewards (N, F)) of G completions of each prompt, sampled from
        the policy with its whole weights (FSDP2's units unsharded, ZeRO-3's partitions gathered: decoding then
        makes no collective, so ranks whose completions end early stop without the others waiting on them), the
        draws keyed by (seed, step, global completion index), and scored by the reward functions (host tensors)."""
        g, tok = self.grpo, self.processing_class
        weights = self.engine.full_weights() if self.engine is not None else full_weights(unwrap(self.model))
        with weights as policy, self._autocast(device, train=False):
            sampled = sample_completions(
                policy,
                prompt_ids,
                G,
                g.max_completion_length,
                temperature=g.temperature,
                top_p=g.top_p,
                top_k=g.top_k,
                min_p=g.min_p,
                repetition_penalty=g.repetition_penalty,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
                seed=self.args.seed,
                step=step,
                first_completion_index=first_completion_index,
            )
        ids, mask = sampled.completion_ids.cpu(), sampled.completion_mask.cpu()
        N = ids.shape[0]
        rows = [r // G for r in range(N)]  # row r's prompt
        lengths = mask.sum(1)
        texts = [tok.decode(ids[r, : int(lengths[r])].tolist()) for r in range(N)]
        prompts = [records[p]["prompt"] for p in rows]
        completions = [
            [{"role": "assistant", "content": t}] if isinstance(pr, list) else t for pr, t in zip(prompts, texts)
        ]
        columns = {k: [records[p].get(k) for p in rows] for k in records[0] if k != "prompt"}
        rewards = score(
            self.reward_funcs,
            prompts,
            completions,
            [ids[r, : int(lengths[r])].tolist() for r in range(N)],
            columns,
            trainer_state=self.state,
        )
        return ids, mask, sampled.truncated.cpu(), rewards

    def _window_rows(self, gen: _Generation, window: int) -> tuple[torch.Tensor, np.ndarray]:
        """The rows of the generation batch that optimizer step `window` of a pass trains on: every rank's, and this
        rank's share (per_device_train_batch_size x gradient_accumulation_steps of them)."""
        n = gen.order.shape[0] // self.windows_per_generation
        rows = gen.order[window * n : (window + 1) * n]
        share = n // self.world_size
        return rows, rows[self.rank * share : (self.rank + 1) * share].numpy()

    def _rows_batch(self, gen: _Generation, part: np.ndarray) -> dict:
        prompts = [self.train_dataset.prompt_ids[i] for i in gen.prompt_index[part].tolist()]
        return self._micro_batch(
            prompts, gen.completion_ids[part], gen.completion_mask[part], self.processing_class.pad_token_id
        )

    @torch.no_grad()
    def _buffered_logps(self, gen: _Generation, device, accum: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(old, ref) per-token log-probs of every row of the generation batch, (N, L) or None where the loss needs
        none: the policy's as it is now, before any step on the batch (TRL's old_per_token_logps, needed when
        num_iterations > 1 or several steps share the batch; else the loss takes the policy's own, detached), and
        the reference's (beta > 0). Each rank computes its rows in the micro batches its steps will train on
        (the same padding, so the first pass's ratio is 1 to the last bit where the two ops agree); the sum over
        ranks, whose other rows are zeros, gathers them exactly."""
        g = self.grpo
        need_old = g.num_iterations > 1 or self.windows_per_generation > 1
        if not need_old and g.beta == 0:
            return None, None
        shape = gen.completion_ids.shape
        old = torch.zeros(shape) if need_old else None
        ref = torch.zeros(shape) if g.beta > 0 else None
        for window in range(self.windows_per_generation):
            for part in np.array_split(self._window_rows(gen, window)[1], accum):
                batch = self._rows_batch(gen, part)
                T = batch["completion_mask"].shape[1]
                if old is not None:
                    with self._autocast(device, train=True):
                        old[part, :T] = self._logps(unwrap(self.model), batch, device).cpu()
                if ref is not None:
                    ref[part, :T] = self._reference_logps(batch, device).cpu()
        if self.world_size > 1:
            for t in (old, ref):
                if t is not None:
                    total = t.to(device)
                    torch.distributed.all_reduce(total)
                    t.copy_(total.cpu())
        return old, ref

    def _advantages(self, rewards: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(advantages, rewards, metrics) of the whole generation batch: every rank's rewards gathered first, as TRL
        does (a group's statistics, and with scale_rewards batch the batch's, are those of the whole batch)."""
        everyone = rewards
        if self.world_size > 1:
            gathered = [torch.empty_like(rewards, device=device) for _ in range(self.world_size)]
            torch.distributed.all_gather(gathered, rewards.to(device))
            everyone = torch.cat(gathered).cpu()
        advantages, metrics = grpo_advantages(
            everyone,
            self.grpo.num_generations,
            reward_weights=self.reward_weights,
            scale_rewards=self.grpo.scale_rewards,
            reward_func_names=self.reward_names,
        )
        return advantages, everyone, metrics

    def _gather(self, obj) -> list:
        """Every rank's `obj`, in rank order."""
        if self.world_size == 1:
            return [obj]
        everyone = [None] * self.world_size
        torch.distributed.all_gather_object(everyone, obj)
        return everyone

    @staticmethod
    def _micro_batch(prompts: list[list[int]], ids: torch.Tensor, mask: torch.Tensor, pad: int) -> dict:
        """Rows of left-padded prompt + completion (trimmed to the micro batch's longest), the host target that puts
        completion token t at column P - 1 + t (ignore_index elsewhere), and those columns."""
        L = max(int(mask.sum(1).max()), 1)
        ids, mask = ids[:, :L], mask[:, :L]
        P = max(len(p) for p in prompts)
        n = len(prompts)
        prompt = torch.full((n, P), pad, dtype=torch.long)
        prompt_mask = torch.zeros(n, P, dtype=torch.long)
        for r, p in enumerate(prompts):
            prompt[r, P - len(p) :] = torch.tensor(p, dtype=torch.long)
            prompt_mask[r, P - len(p) :] = 1
        target = torch.full((n, P + L), -100, dtype=torch.long)
        target[:, P - 1 : P - 1 + L] = torch.where(mask.bool(), ids, -100)
        return {
            "input_ids": torch.cat([prompt, ids], 1),
            "attention_mask": torch.cat([prompt_mask, mask], 1),
            "target": target,
            "completion_mask": mask,
            "columns": slice(P - 1, P - 1 + L),
        }

    def _logps(self, model, batch: dict, device) -> torch.Tensor:
        """`model`'s per-token log-probs of a micro batch's completions, (n, T) (under the caller's no_grad)."""
        head = functools.partial(
            _head_logps, target=batch["target"], columns=batch["columns"], temperature=self.grpo.temperature
        )
        inputs = dict(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device))
        return model(**inputs, head=head).metrics["logps"]

    @torch.no_grad()
    def _reference_logps(self, batch: dict, device) -> torch.Tensor:
        """The reference's per-token log-probs of a micro batch's completions (beta > 0)."""
        with self._autocast(device, train=False):
            if self.ref_model is not None:
                if not self._ref_prepared and self.engine is not None:  # under DeepSpeed its own inference engine
                    self.ref_model, self._ref_prepared = self.engine.frozen(self.ref_model), True
                return self._logps(self.ref_model, batch, device)
            policy = unwrap(self.model)
            with adapters_disabled(policy):
                return self._logps(policy, batch, device)

    # ---- evaluation ---------------------------------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        """TRL's GRPO evaluation: every prompt of the eval set once, in order, in eval batches of
        per_device_eval_batch_size completions on each process (num_generations_eval of each prompt); each batch
        sampled (draws keyed by (seed, EVAL_STEP | global_step, the completion's index in the eval set), so they
        neither depend on the batch size or the number of processes nor touch training's), scored, its advantages
        over the batch of every process, and its loss with the policy as its own old policy (ratio 1: the loss is
        the advantages' term and beta times the KL to the reference), normalised over the batch of every process.
        Reports <prefix>_loss (the batches' losses weighted by their completions, as Trainer's eval loss), TRL's
        generation and loss metrics (reward, reward_std, frac_reward_zero_std, rewards/<f>/mean|std,
        completions/*, kl, entropy, clip_ratio/*: each the mean over the batches, as TRL's log), runtime and
        samples_per_second (completions)."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("GRPOTrainer.evaluate: no eval_dataset")
        dataset = self._prompt_dataset(eval_whole(dataset), "eval_dataset")
        if isinstance(dataset, dict):
            metrics = {}
            for name, part in dataset.items():
                metrics.update(self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        G = check_grpo_eval(self.args, self.grpo)
        model, device = self.model, self._device(self.model)
        was_training = unwrap(model).training  # a DeepSpeed engine's own flag stays True through eval()
        model.eval()
        start = time.perf_counter()
        width = self.args.per_device_eval_batch_size // G * self.world_size  # prompts of one eval batch
        loss_sum, completions, values = 0.0, 0, {}
        for first in range(0, len(dataset), width):
            loss, rows, metrics = self._eval_batch(dataset, first, min(first + width, len(dataset)), G, device)
            loss_sum, completions = loss_sum + loss * rows, completions + rows
            for name, value in metrics.items():
                values.setdefault(name, []).append(value)
        if was_training:
            model.train()
        runtime = time.perf_counter() - start
        out = {f"{metric_key_prefix}_loss": loss_sum / completions}
        for name, seen in sorted(values.items()):  # NaN (a reward function's None for a whole batch) left out, as TRL
            kept = [v for v in seen if v == v]
            out[f"{metric_key_prefix}_{name}"] = sum(kept) / len(kept) if kept else float("nan")
        out[f"{metric_key_prefix}_runtime"] = runtime
        out[f"{metric_key_prefix}_samples_per_second"] = completions / max(runtime, 1e-9)
        return out

    @torch.no_grad()
    def _eval_batch(self, dataset: PromptDataset, lo: int, hi: int, G: int, device) -> tuple[float, int, dict]:
        """(loss, completions, metrics) of the eval batch of prompts [lo, hi) over all processes, each process its
        share of per_device_eval_batch_size / G prompts. A process with no prompt left in the last batch samples
        and runs the batch's first one, counted nowhere, so that every process makes the same forwards (FSDP2's and
        ZeRO-3's are collectives)."""
        g, per_rank = self.grpo, self.args.per_device_eval_batch_size // G
        mine = list(range(lo + self.rank * per_rank, min(lo + (self.rank + 1) * per_rank, hi)))
        counted = bool(mine)
        mine = mine or [lo]
        records = [dataset[i] for i in mine]
        prompt_ids = [dataset.prompt_ids[i] for i in mine]
        ids, mask, truncated, rewards = self._sample_and_score(
            records, prompt_ids, G, EVAL_STEP | self.state.global_step, mine[0] * G, device
        )
        n = ids.shape[0] if counted else 0
        lengths = mask.sum(1)
        if g.mask_truncated_completions:
            mask = mask * (~truncated).long()[:, None]
        everyone = self._gather(
            {"rewards": rewards[:n], "lengths": lengths[:n], "truncated": truncated[:n], "tokens": int(mask[:n].sum())}
        )
        all_rewards = torch.cat([e["rewards"] for e in everyone])
        advantages, metrics = grpo_advantages(
            all_rewards,
            G,
            reward_weights=self.reward_weights,
            scale_rewards=g.scale_rewards,
            reward_func_names=self.reward_names,
        )
        lengths = torch.cat([e["lengths"] for e in everyone])
        metrics.update(completion_length_metrics(lengths.float()))
        metrics["completions/clipped_ratio"] = torch.cat([e["truncated"] for e in everyone]).float().mean()
        offset = sum(e["rewards"].shape[0] for e in everyone[: self.rank])
        mine_advantages = advantages[offset : offset + n] if counted else torch.zeros(ids.shape[0])
        N = all_rewards.shape[0]
        if g.loss_type == "grpo":
            normalizer = float(N)
        elif g.loss_type == "dr_grpo":
            normalizer = float(N * g.max_completion_length)
        else:
            normalizer = max(float(sum(e["tokens"] for e in everyone)), 1.0)
        batch = self._micro_batch(
            [dataset.prompt_ids[mine[r // G]] for r in range(ids.shape[0])],
            ids,
            mask,
            self.processing_class.pad_token_id,
        )
        ref_logps = self._reference_logps(batch, device) if g.beta > 0 else None
        head = self._loss_head(batch, mine_advantages, None, ref_logps, torch.tensor(normalizer, device=device), device)
        with self._autocast(device, train=False):
            out = self.model(
                input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device), head=head
            )
        # the loss's metrics (kl, entropy, clip ratios): each process's over its completions, weighted by them
        mine_metrics = {k: float(v) for k, v in out.metrics.items()} if counted else {}
        shared = self._gather({"loss": float(out.loss) if counted else 0.0, "rows": n, "metrics": mine_metrics})
        for name in out.metrics:
            parts = [(e["metrics"][name], e["rows"]) for e in shared if e["rows"]]
            metrics[name] = sum(v * w for v, w in parts) / sum(w for _, w in parts)
        return sum(e["loss"] for e in shared), N, {k: float(v) for k, v in metrics.items()}

    # ---- checkpoints --------------------------------------------------------------------------------------------
    def _method_state(self, run) -> dict | None:
        """The buffered generation when the checkpoint falls inside its cycle: the steps left train on it, and the
        policy that sampled it is gone (regenerating would sample from the current one)."""
        if not run.loader.inside_cycle:
            return None
        return {"grpo_generation": self._generation.state_dict()}

    def _load_method_state(self, run, state: dict | None, resume: Path) -> None:
        if not run.loader.inside_cycle:
            return
        saved = (state or {}).get("grpo_generation")
        if saved is None:
            raise CheckpointError(
                f"resume_from_checkpoint: {resume} was saved inside a generation cycle but holds no buffered "
                f"generation ({METHOD_STATE})"
            )
        gen = _Generation(**saved)
        rows = self.args.per_device_train_batch_size * self.world_size * self.steps_per_generation
        if gen.order.shape[0] != rows:
            raise CheckpointError(
                f"resume_from_checkpoint: {resume} holds a generation batch of {gen.order.shape[0]} completions, "
                f"this run's is {rows} (per_device_train_batch_size x processes x steps_per_generation)"
            )
        self._generation = gen

    # ---- metrics and completions ----------------------------------------------------------------------------------
    def _record(self, metrics: dict | None) -> None:
        for name, value in (metrics or {}).items():
            self._metrics.setdefault(name, []).append(torch.as_tensor(value).detach().float())  # no host sync

    def _extra_logs(self) -> dict:
        """Each metric's mean over the values recorded since the last log (TRL's), averaged over the ranks."""
        if not self._metrics:
            return {}
        names, device = sorted(self._metrics), self._device(self.model)
        # one host copy at the log step: the rewards' metrics were made on the host, the loss's on the device
        values = torch.stack([torch.stack([v.to(device) for v in self._metrics[n]]).nanmean() for n in names])
        values = values.double()
        self._metrics = {}
        if self.world_size > 1:
            torch.distributed.all_reduce(values)
            values = values / self.world_size
        return dict(zip(names, values.tolist()))

    def _log_completions(self, step: int, prompt_index, ids, lengths, rewards, advantages) -> None:
        """A generation batch's rows (every rank's; rank 0 writes them) into completions.jsonl, `step` its step."""
        tok = self.processing_class
        rows = []
        for r in range(ids.shape[0]):
            prompt = self.train_dataset[int(prompt_index[r])]["prompt"]
            rows.append(
                {
                    "step": step + 1,
                    "prompt": prompt if isinstance(prompt, str) else prompt[-1]["content"],
                    "completion": tok.decode(ids[r, : int(lengths[r])].tolist()),
                    **{name: (None if v != v else v) for name, v in zip(self.reward_names, rewards[r].tolist())},
                    "advantage": float(advantages[r]),
                }
            )
        path = Path(self.args.output_dir) / COMPLETIONS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
