"""Stage sft, `python -m trainer.sft`: supervised fine-tuning on conversations, as the command line runs it.

Its plug-in (`SFT`, a `methods.base.Method`): no options of its own (the preference ones are parsed only to be
refused by name), the SFT data formats, conversations read by `methods.base.read_datasets` through
trainer.data.sft_data / hf_sources / streaming, and the loop's own `Trainer`. Its command is LlamaFactory's one
command: a config's `stage:` key chooses the method (trainer/cli.py).
"""

from __future__ import annotations

import dataclasses

from trainer.coerce import ConfigError
from trainer.data.hf_sources import load_sft_sources
from trainer.data.sft_data import load_sft_dataset
from trainer.data.streaming import SFTStream
from trainer.loop.evaluation import EVAL_METRICS
from trainer.loop.trainer import Trainer
from trainer.methods.base import CONFIGS, Method, RunInputs, data_cache, interleave_probs, read_datasets
from trainer.methods.preference import PreferenceArguments

SFT_FORMATS = ("auto", "messages", "sharegpt", "alpaca", "prompt_completion", "text")


def check(args, sft, pref) -> None:
    """The preference options are not silently ignored in an sft run, and the data format is one it reads."""
    given = [f.name for f in dataclasses.fields(pref) if getattr(pref, f.name) != f.default]
    if given:
        raise ConfigError(
            f"{', '.join(given)}: preference options, but stage is sft; use python -m trainer.dpo (or --stage dpo)"
        )
    if sft.data_format not in SFT_FORMATS:
        raise ConfigError(
            f"data_format={sft.data_format!r}: a preference format; stage sft reads {', '.join(SFT_FORMATS)}"
        )


def read_inputs(args, sft, _, tokenizer) -> RunInputs:
    """Conversations (or text), tokenised the same way from files (--data), load_dataset's sources (--dataset_name,
    a mixture too) and streams."""
    tokenisation = dict(
        data_format=sft.data_format,
        cutoff_len=args.cutoff_len,
        train_on_prompt=sft.train_on_prompt,
        mask_history=sft.mask_history,
        skip_bad_examples=sft.skip_bad_examples,
    )
    options = dict(**tokenisation, num_proc=sft.dataset_num_proc, **data_cache(args, sft))

    def load_sources(source: dict, seed: int):
        sources = load_sft_sources(
            sft.dataset_name,
            tokenizer,
            **source,
            mix_strategy=sft.mix_strategy,
            interleave_probs=interleave_probs(sft),
            seed=seed,
            **options,
        )
        return sources.train, sources.eval, [sources.train, *sources.tokenized]

    return read_datasets(
        args,
        sft,
        tokenizer,
        load=lambda files: load_sft_dataset(files, tokenizer, **options),
        load_sources=load_sources,
        stream_class=SFTStream,
        stream_options=tokenisation,
    )


SFT = Method(
    name="sft",
    command="trainer.sft",
    sets_stage=False,
    demo_config=CONFIGS / "demo.yaml",
    arguments=PreferenceArguments,  # none of its own: the preference options are read only to be refused by name
    arguments_saved=False,
    check=check,
    data_formats=SFT_FORMATS,
    streams=True,
    eval_metrics=EVAL_METRICS,
    read_inputs=read_inputs,
    data_noun="examples",
    trainer=Trainer,
    run_args_file="sft_args.json",
)
