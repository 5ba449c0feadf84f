"""Stage grpo, `python -m trainer.grpo`: GRPO (online RL with verifiable rewards) as the command line runs it.

Its plug-in (`GRPO`, a `methods.base.Method`): `GRPOArguments` (TRL's GRPOConfig names), prompt records in place of
SFT's data options (`--data`, `--eval_data`; the embedded demo: new prompts of the tasks), the generation batch checked
as `GRPOTrainer` will make it, the reward functions imported before anything is built, and `GRPOTrainer`
(trainer/methods/grpo.py, docs/grpo.md).
"""

from __future__ import annotations

import os

from trainer.coerce import ConfigError
from trainer.data.sft_data import DataError
from trainer.data.task_eval import held_out_conversations
from trainer.data.tasks import KINDS, kind_of, unseen_tasks
from trainer.methods.base import (
    CONFIGS,
    Method,
    RunInputs,
    data_files,
    evaluates,
    exact_match_conversations,
)
from trainer.methods.grpo import (
    EVAL_METRICS,
    GRPOArguments,
    GRPOTrainer,
    PromptDataset,
    check_grpo_batch,
    check_grpo_eval,
    prompts_from_conversations,
    read_prompt_records,
)
from trainer.methods.grpo_rewards import load_reward_functions

# The GRPO demo's prompts: new "add" prompts (trainer.data.tasks.unseen_tasks), the one task the SFT demo leaves far
# from solved (52.5%; the other four at 90-100%). Measured (docs/grpo.md): new prompts of all five tasks, 300-600
# steps, moved the held-out exact match by -1 to +1 point; of add and sort, 900 steps, add +2.5 and sort +7.5; of add
# alone, 900 steps, add +17.5 and sort -5.
GRPO_DEMO_KINDS = ("add",)
GRPO_DEMO_PROMPTS = 5000


def check(args, sft, grpo: GRPOArguments) -> None:
    """What stage grpo cannot take: SFT's data options (it reads prompts, --data and --eval_data); its generation batch
    and, where it evaluates, its eval batch; reward functions that do not import."""
    for name in ("train_on_prompt", "mask_history", "dataset_name", "val_size"):
        if getattr(sft, name):
            raise ConfigError(
                f"{name}: stage grpo samples answers to prompts (--data: JSONL records with a 'prompt'); leave it off"
            )
    if sft.data_format != "auto":
        raise ConfigError(f"data_format={sft.data_format!r}: stage grpo reads prompt records; leave it at auto")
    check_grpo_batch(args, grpo, int(os.environ.get("WORLD_SIZE", "1")))
    if sft.eval_data or evaluates(args):
        check_grpo_eval(args, grpo)
    if grpo.reward_funcs:
        load_reward_functions(grpo.reward_funcs, grpo.reward_weights)  # each imports, or one line (exit 2)


def read_inputs(args, sft, grpo: GRPOArguments, tokenizer) -> RunInputs:
    """Prompt records (--data; the embedded default: new prompts of the tasks, their answers as the solution column),
    tokenised, and the window plan checked as GRPOTrainer will make it."""
    embedded, _, eval_files = data_files(sft)
    if embedded:  # new prompts of the embedded tasks: the SFT demo never saw them, the reward checks the answers
        n = GRPO_DEMO_PROMPTS * len(KINDS) // len(GRPO_DEMO_KINDS)  # unseen_tasks takes the kinds in turn
        new = [ex["messages"] for ex in unseen_tasks(n) if kind_of(ex["messages"][0]["content"]) in GRPO_DEMO_KINDS]
        records, wheres = prompts_from_conversations(new), None
    else:
        records, wheres = read_prompt_records(sft.data)
    prompts = PromptDataset(records, tokenizer, wheres=wheres)
    prompts.source = (
        f"new {'/'.join(GRPO_DEMO_KINDS)} prompts of the embedded tasks" if embedded else ", ".join(sft.data)
    )
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    steps = check_grpo_batch(args, grpo, world_size)
    generation_prompts = args.per_device_train_batch_size * steps * world_size // grpo.num_generations
    if len(prompts) < generation_prompts:
        raise DataError(
            f"{len(prompts)} prompts, but a generation batch samples {grpo.num_generations} completions each of "
            f"{generation_prompts} prompts (per_device_train_batch_size x steps_per_generation x processes / "
            "num_generations); give more prompts or a smaller batch"
        )
    eval_prompts = None
    if sft.eval_data:
        records, wheres = read_prompt_records(sft.eval_data)
        eval_prompts = PromptDataset(records, tokenizer, wheres=wheres, name="eval_data")
    elif embedded and evaluates(args):  # the embedded tasks' eval conversations, their answers as the solution
        eval_prompts = PromptDataset(
            prompts_from_conversations(held_out_conversations(eval_files, 10**9)), tokenizer, name="eval_data"
        )
    conversations = exact_match_conversations(sft, embedded, eval_files)
    return RunInputs(prompts, eval_prompts, [prompts], conversations, embedded, tokenizer)


GRPO = Method(
    name="grpo",
    command="trainer.grpo",
    demo_config=CONFIGS / "grpo_demo.yaml",
    after_sft_demo=True,
    arguments=GRPOArguments,
    check=check,
    data_formats=("auto",),
    eval_metrics=EVAL_METRICS,
    eval_metric_families=("rewards/<function>/mean|std",),
    eval_sources="--eval_data FILE (prompt records)",
    read_inputs=read_inputs,
    data_noun="prompts",
    trainer=GRPOTrainer,
    trainer_options=lambda args, grpo, build: {"grpo": grpo},
    run_args_file="grpo_args.json",
)
