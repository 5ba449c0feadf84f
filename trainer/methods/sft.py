"""SFTTrainer: TRL's `SFTTrainer` constructor over the Trainer, for data that is raw or tokenized.

    trainer = SFTTrainer(model="tiny", args=TrainingArguments(output_dir="out", cutoff_len=1024),
                         train_dataset=load_dataset("json", data_files="train.jsonl", split="train"))
    trainer.train()

What it adds to `Trainer` (trainer/loop/trainer.py, which takes tokenized data only), all before the model is built:
- `model` a name (a preset, a Hugging Face directory or a hub id): built by `trainer.build.build_model(model, args)`,
  as `python -m trainer.sft` builds it; a module is taken as it is.
- `processing_class` a `Tokenizer`, a name or path (its tokenizer files), or a transformers tokenizer (read into ours);
  None: the tokenizer of `model` when it is a name (as TRL loads the model's own).
- `train_dataset` / `eval_dataset` raw: a `datasets.Dataset` (a `DatasetDict` as train_dataset: its "train" split;
  as eval_dataset, or a dict: split by split, metrics `eval_<split>_loss`) or a list of records, in any SFT format
  the files take, tokenized by `trainer.data.hf_datasets.tokenize_sft_dataset`: the tokens, labels, drops and
  errors of a JSONL file of the same records. The options are the command's (`python -m trainer.sft`): `cutoff_len`
  (TRL's `max_length`) from `args`, and `data_format`, `train_on_prompt`, `mask_history`, `skip_bad_examples`,
  `dataset_num_proc` here. Tokenized data (a TokenizedDataset, a Dataset with `input_ids`) and anything else go to
  the Trainer as they are.
- `train_dataset` a `datasets.IterableDataset` (streaming): an `SFTStream` (trainer/data/streaming.py) with the same
  options, read and tokenised as training goes, resumed exactly; it needs max_steps (dataset_num_proc does not apply).
  As `eval_dataset` one is read whole first (`trainer.data.hf_datasets.eval_whole`), then tokenized as a Dataset.

What differs from TRL: what TRL's SFTConfig holds is TrainingArguments' here (max_length is cutoff_len; packing is
batching_strategy; LoRA and 4-bit are use_peft and load_in_4bit, not peft_config and quantization_config) or a
keyword argument (dataset_num_proc); the loss is on the assistant's tokens (a completion's) unless train_on_prompt,
where TRL trains on every token of a conversation unless assistant_only_loss; there is no formatting_func,
compute_loss_func or model_init_kwargs; arguments after processing_class are keywords.
"""

from __future__ import annotations

import os

from trainer.build import build_model, resolve_tokenizer
from trainer.config.args import TrainingArguments
from trainer.data.hf_datasets import eval_whole, hf_kind, tokenize_sft_dataset, tokenized_splits
from trainer.data.sft_data import checked_options
from trainer.data.streaming import SFTStream
from trainer.loop.trainer import Trainer


class SFTTrainer(Trainer):
    """TRL's SFTTrainer constructor (module docstring); the rest is the Trainer's."""

    def __init__(
        self,
        model,
        args: TrainingArguments | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        *,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        preprocess_logits_for_metrics=None,
        data_format: str = "auto",
        train_on_prompt: bool = False,
        mask_history: bool = False,
        skip_bad_examples: bool = False,
        dataset_num_proc: int | None = None,
    ):
        if model is None:
            raise ValueError("SFTTrainer: pass a model (a module, or a preset, directory or hub id to build)")
        args = args if args is not None else TrainingArguments()
        checked_options(data_format, args.cutoff_len, train_on_prompt, mask_history, skip_bad_examples)
        # _prepare_dataset reads these three; Trainer.__init__ calls it before it sets its own attributes
        self.args = args
        self.processing_class = resolve_tokenizer(processing_class, model)
        self._sft_options = dict(
            data_format=data_format,
            train_on_prompt=train_on_prompt,
            mask_history=mask_history,
            skip_bad_examples=skip_bad_examples,
            num_proc=dataset_num_proc,
        )
        # the data first: a bad row stops the run before a model is built
        train_dataset = self._prepare_dataset(train_dataset, "train_dataset")
        eval_dataset = self._prepare_dataset(eval_whole(eval_dataset), "eval_dataset")
        if isinstance(model, (str, os.PathLike)):
            model, _ = build_model(str(model), args)
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=self.processing_class,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )

    def _prepare_dataset(self, dataset, name: str):
        """Raw rows tokenized (`tokenize_sft_dataset`, with cutoff_len from the arguments), then the Trainer's
        conversion; also for a dataset given to evaluate() or set as train_dataset later."""
        tokenizer = self.processing_class

        def tokenize(rows, split):
            return tokenize_sft_dataset(
                rows,
                tokenizer,
                split=split,
                cutoff_len=self.args.cutoff_len,
                show_progress=not self.args.disable_tqdm,
                **self._sft_options,
            )

        if name == "train_dataset" and hf_kind(dataset) == "IterableDataset":  # read as training goes (max_steps)
            options = {k: v for k, v in self._sft_options.items() if k != "num_proc"}
            return SFTStream([dataset], tokenizer, names=[name], cutoff_len=self.args.cutoff_len, **options)
        dataset = tokenized_splits(dataset, name, tokenize if tokenizer is not None else None, "input_ids")
        return super()._prepare_dataset(dataset, name)
