"""Stage dpo, `python -m trainer.dpo`: preference training (DPO and its family) as the command line runs it.

Its plug-in (`DPO`, a `methods.base.Method`): `PreferenceArguments` (TRL's DPOConfig names), the pair formats,
preference pairs read by `methods.base.read_datasets` through trainer.data.preference_data / hf_sources / streaming
(the embedded demo: the tasks' conversations turned into pairs in memory), `PreferenceTrainer` with a reference model
built like the policy when one is named, and the preference accuracy before and after training.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from trainer.build import check_model_name
from trainer.coerce import ConfigError
from trainer.data.hf_sources import load_preference_sources
from trainer.data.preference_data import PREFERENCE_FORMATS, load_preference_dataset, pairs_dataset
from trainer.data.sft_data import read_examples
from trainer.data.streaming import PairStream
from trainer.data.tasks import preference_pair
from trainer.methods.base import CONFIGS, Method, RunInputs, Score, data_cache, data_files, read_datasets
from trainer.methods.preference import EVAL_METRICS, PreferenceArguments, PreferenceTrainer


def check(args, sft, pref) -> None:
    """What stage dpo cannot take, each one line: SFT's formats and masking, a batching other than 'normal'; and the
    reference model's name."""
    if sft.data_format not in PREFERENCE_FORMATS:
        raise ConfigError(
            f"data_format={sft.data_format!r}: stage dpo reads preference pairs: {', '.join(PREFERENCE_FORMATS)}"
        )
    for name in ("train_on_prompt", "mask_history"):
        if getattr(sft, name):
            raise ConfigError(f"{name}: stage dpo trains on the answers of preference pairs only; leave it off")
    if args.batching_strategy != "normal":
        raise ConfigError(
            f"batching_strategy={args.batching_strategy!r}: stage dpo batches pairs with "
            "batching_strategy='normal' only"
        )
    if pref.ref_model:
        check_model_name(pref.ref_model)


def check_sources(sft) -> None:
    """Its pairs are tokenised in one process, and several --dataset_name sources are read one after the other."""
    if sft.dataset_num_proc not in (None, 1):
        raise ConfigError("dataset_num_proc: stage dpo tokenises its pairs in one process; leave it unset")
    if sft.dataset_name and not sft.data and sft.mix_strategy != "concat":
        raise ConfigError(
            f"mix_strategy={sft.mix_strategy!r}: stage dpo reads several --dataset_name sources one after the other "
            "(concat) only"
        )


def check_streaming(args, sft, pref) -> None:
    """A stream of pairs that are read (not the embedded ones, made in memory), with the reference run on each batch."""
    if not sft.data and not sft.dataset_name:
        raise ConfigError(
            "streaming: the embedded demo's pairs are made in memory from its tasks; give the pairs to stream as "
            "--data FILE or --dataset_name"
        )
    if pref.needs_reference and pref.precompute_ref_log_probs:
        raise ConfigError(
            "precompute_ref_log_probs: not with --streaming (the pairs are read as training goes, so there is no "
            "table to precompute before it); drop it (the reference then runs on each batch)"
        )


def read_inputs(args, sft, pref, tokenizer) -> RunInputs:
    """Preference pairs, truncated the same way from files (--data), load_dataset's sources (--dataset_name, one after
    the other) and streams; the embedded tasks each with a plausible wrong answer rejected (trainer.data.tasks)."""
    embedded = data_files(sft)[0]
    cache_dir = data_cache(args, sft)["cache_dir"]
    pair_truncation = dict(
        max_length=args.cutoff_len, max_prompt_length=pref.max_prompt_length, truncation_mode=pref.truncation_mode
    )
    truncation = dict(**pair_truncation, show_progress=not args.disable_tqdm)
    records = dict(data_format=sft.data_format, skip_bad_examples=sft.skip_bad_examples)

    def load(files):
        if embedded:
            pairs = [preference_pair(ex) for ex in read_examples(files)]
            return pairs_dataset(pairs, Path(files[0]).name, tokenizer, **truncation)
        return load_preference_dataset(files, tokenizer, **records, **truncation, cache_dir=cache_dir)

    def load_sources(source: dict, seed: int):
        train_ds, eval_ds = load_preference_sources(
            sft.dataset_name, tokenizer, **source, **records, cache_dir=cache_dir, **truncation
        )
        return train_ds, eval_ds, [train_ds] + ([eval_ds] if eval_ds is not None else [])

    return read_datasets(
        args,
        sft,
        tokenizer,
        load=load,
        load_sources=load_sources,
        stream_class=PairStream,
        stream_options=dict(**records, **pair_truncation),
    )


def trainer_options(args, pref, build) -> dict:
    """Its options and the reference model: one given by name is built like the policy, without its LoRA adapter."""
    ref_model = None if not pref.ref_model else build(pref.ref_model, dataclasses.replace(args, use_peft=False))[0]
    return dict(pref=pref, ref_model=ref_model)


DPO = Method(
    name="dpo",
    command="trainer.dpo",
    demo_config=CONFIGS / "dpo_demo.yaml",
    after_sft_demo=True,
    arguments=PreferenceArguments,
    check=check,
    data_formats=PREFERENCE_FORMATS,
    check_sources=check_sources,
    streams=True,
    check_streaming=check_streaming,
    eval_metrics=EVAL_METRICS,
    read_inputs=read_inputs,
    data_noun="pairs",
    trainer=PreferenceTrainer,
    trainer_options=trainer_options,
    run_args_file="dpo_args.json",
    score=Score(
        key="preference_accuracy",
        measure=lambda trainer, eval_ds: trainer.preference_accuracy(eval_ds),
        of_what="pairs (the chosen answer likelier than the rejected one)",
    ),
)
