"""What a method declares to the command line, and what the methods' plug-ins share.

Every command (`python -m trainer.sft`, `trainer.dpo`, `trainer.grpo`) is one run of the conductor, trainer/cli.py:
parse -> check -> read inputs -> hold output_dir -> build -> train -> report, the same for every method. What differs
is one `Method` record, in the method's own module (methods/sft_method.py, dpo_method.py, grpo_method.py), that
trainer/cli_args.py names in METHODS, where `--stage` and a config's `stage:` key choose from. A new method (KTO,
reward modelling) is one more such module and one more entry there; the conductor and the common checks name none.

Shared here: `RunInputs` (what a method's reader hands the conductor), `read_datasets` (the reader of the methods that
train on tokenised examples, sft's conversations and dpo's pairs: files, `--dataset_name` sources or a stream, the
eval split, the batch plan) and the small helpers the plug-ins and the common checks both use.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainer.coerce import ConfigError
from trainer.data.batching import BatchLoader
from trainer.data.cache import cache_root
from trainer.data.hf_sources import split_names
from trainer.data.sft_data import TokenizedDataset, split_dataset
from trainer.data.streaming import StreamLoader, open_stream
from trainer.data.task_eval import held_out_conversations
from trainer.data.tasks import EVAL_FILE, TRAIN_FILE

CONFIGS = Path(__file__).parent.parent / "configs"  # the demos' arguments (trainer/configs/*.yaml)
# What the eval-data check asks for when training evaluates without eval data (a method that reads them otherwise
# says so in its own Method.eval_sources)
EVAL_SOURCES = "--eval_data FILE, --val_size N (held out of --data) or --dataset_test_split"


@dataclass
class RunInputs:
    """What a method's reader read and checked before anything was written: the tokenised data (train and eval, after
    a val_size split), the datasets as loaded (each read from or written to the shared data cache), and the held-out
    conversations of the exact-match check."""

    train_ds: TokenizedDataset
    eval_ds: TokenizedDataset | None
    loaded: list[TokenizedDataset]
    conversations: list[list[dict]]
    embedded: bool  # the embedded tasks (no --data)
    tokenizer: object  # the one the data was rendered with (a ChatML template adopted, when it had none)


@dataclass(frozen=True)
class Score:
    """A share a method reports on its eval data before training (a line) and after (final metrics
    `<key>_before`, `<key>_after`): DPO's preference accuracy."""

    key: str
    measure: Callable  # (trainer, eval_ds) -> float
    of_what: str  # what the line counts, after "of N held-out"


def _none(*_) -> None:
    """No check of a method's own."""


def _no_options(*_) -> dict:
    return {}


@dataclass(frozen=True, kw_only=True)
class Method:
    """A method as the command line runs it, `python -m <command>` or `--stage <name>` (a config's `stage:`); its
    fields in the order the conductor asks for them."""

    name: str
    command: str  # the module of its command line: `prog` in --help, the resume command
    sets_stage: bool = True  # its command passes --stage (a config's `stage:` cannot change it)
    demo_config: Path  # what its command runs with no --model, --data or --dataset_name
    after_sft_demo: bool = False  # its demo starts from the SFT demo's model (trained first when missing)
    # parse
    arguments: type  # the dataclass of its options, parsed after TrainingArguments and SFTArguments
    arguments_saved: bool = True  # its options are part of the run's arguments (run_args_file)
    # check (trainer.cli_args.check_run), each refusal one line (ConfigError)
    check: Callable  # (args, sft, method_args): its own, right after the model's name
    data_formats: tuple[str, ...]  # the values of --data_format it reads
    check_sources: Callable = _none  # (sft): of --dataset_name's options
    streams: bool = False  # it reads --streaming data
    check_streaming: Callable = _none  # (args, sft, method_args): of a stream
    eval_metrics: tuple[str, ...]  # what its evaluation reports (metric_for_best_model names one of them)
    eval_metric_families: tuple[str, ...] = ()  # and what it reports per function, as "<prefix>/<function>/..."
    eval_sources: str = EVAL_SOURCES  # what to give where training evaluates without eval data
    # read
    read_inputs: Callable  # (args, sft, method_args, tokenizer) -> RunInputs, every file read and checked
    data_noun: str  # what one row of its data is ("eval data: 40 pairs")
    # train
    trainer: type  # its Trainer, made with the model, the arguments, the data, the tokenizer and trainer_options
    trainer_options: Callable = _no_options  # (args, method_args, build) -> its own keyword arguments of trainer;
    # build(name, args) builds a model as the policy was built
    # report
    run_args_file: str  # output_dir's record of a finished run's arguments (a run with the same may write there again)
    score: Score | None = None  # a share of its eval data, before and after training


def evaluates(args) -> list[str]:
    """The arguments that ask for evaluation during training, as `name=value` (none: it evaluates only at the end,
    where there is eval data)."""
    return [
        f"{name}={getattr(args, name)!r}"
        for name, off in (("eval_strategy", "no"), ("eval_on_start", False))
        if getattr(args, name) != off
    ]


def interleave_probs(sft) -> list[float] | None:
    """--interleave_probs as numbers: a list, or one comma-separated string (LlamaFactory's "0.7,0.3")."""
    if not isinstance(sft.interleave_probs, str):
        return sft.interleave_probs
    values = split_names([sft.interleave_probs])
    try:
        return [float(v) for v in values]
    except ValueError:
        raise ConfigError(
            f"interleave_probs={sft.interleave_probs!r}: expected numbers, one per dataset_name"
        ) from None


def data_files(sft) -> tuple[bool, list[str], list[str] | None]:
    """(embedded: no --data or --dataset_name, the training files, the eval files): the embedded tasks' files where
    nothing else is given."""
    embedded = not sft.data and not sft.dataset_name
    return embedded, sft.data or [str(TRAIN_FILE)], sft.eval_data or ([str(EVAL_FILE)] if embedded else None)


def data_cache(args, sft) -> dict:
    """The shared cache (trainer.data.cache): an entry is written as soon as it is tokenised (under its lock, so that of
    several ranks one tokenises and the others read), never into output_dir."""
    return dict(cache_dir=cache_root(sft.data_cache_dir), show_progress=not args.disable_tqdm)


def data_seed(args) -> int:
    return args.data_seed if args.data_seed is not None else args.seed


def exact_match_conversations(sft, embedded: bool, eval_files) -> list[list[dict]]:
    """The held-out conversations of the exact-match check: --exact_match_examples of the eval files, where
    --eval_exact_match asks (by default: for the embedded tasks)."""
    check_exact = sft.eval_exact_match if sft.eval_exact_match is not None else embedded
    return held_out_conversations(eval_files, sft.exact_match_examples) if check_exact and eval_files else []


def read_datasets(args, sft, tokenizer, *, load, load_sources, stream_class, stream_options: dict) -> RunInputs:
    """The inputs of a method that trains on tokenised examples, read one of three ways with the method's readers:
    `load(files)` (--data, or the embedded tasks; --eval_data too), `load_sources(source, seed)` (--dataset_name:
    load_dataset's sources, -> (train, eval or None, every split read)) or `stream_class` with `stream_options`
    (--streaming: read and tokenised as training goes, no cache; the eval data whole). Then the val_size split, the
    batch plan every rank will make (the world size from the launcher's: one that trains nothing is one line) and the
    exact-match conversations."""
    embedded, train_files, eval_files = data_files(sft)
    seed = data_seed(args)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # --dataset_name's sources as load_dataset reads them (trainer.data.hf_sources), for every method and for streams
    source = dict(config=sft.dataset_config, data_files=sft.data_files, train_split=sft.dataset_train_split)
    if sft.streaming:
        train_ds = open_stream(
            stream_class,
            tokenizer,
            data=None if sft.dataset_name else train_files,
            dataset_name=sft.dataset_name,
            **source,
            mix_strategy=sft.mix_strategy,
            interleave_probs=interleave_probs(sft),
            seed=seed,
            show_progress=not args.disable_tqdm,
            **stream_options,
        )
        StreamLoader.from_args(train_ds, args, args.per_device_train_batch_size, world_size=world_size)
        loaded, eval_ds = [train_ds], None
    elif sft.dataset_name:
        train_ds, eval_ds, loaded = load_sources(dict(**source, test_split=sft.dataset_test_split), seed)
    else:
        train_ds = load(train_files)
        loaded, eval_ds = [train_ds], None
    if eval_files:  # --eval_data (beside --data or --dataset_name), or the embedded tasks'
        eval_ds = load(eval_files)
        loaded.append(eval_ds)
    elif sft.val_size:
        val = int(sft.val_size) if sft.val_size >= 1 else sft.val_size
        train_ds, eval_ds = split_dataset(train_ds, val, seed=seed)
    if not sft.streaming:
        BatchLoader.from_args(train_ds, args, args.per_device_train_batch_size, train=True, world_size=world_size)
    conversations = exact_match_conversations(sft, embedded, eval_files)
    return RunInputs(train_ds, eval_ds, loaded, conversations, embedded, tokenizer)
