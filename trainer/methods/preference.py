"""Preference training (DPO, IPO, hinge, robust, APO-zero, ORPO, SimPO) on the Trainer's loop: a different batch and
loss, nothing else.

    trainer = PreferenceTrainer(model=model, args=TrainingArguments(...), pref=PreferenceArguments(beta=0.1),
                                train_dataset=load_preference_dataset(files, tokenizer), processing_class=tokenizer)
    trainer.train()

What differs from SFT, and how (the rest, from schedule to checkpoints and resume, is the Trainer's):
- Batches: a micro batch of k pairs is 2k rows, the chosen sequences then the rejected ones
  (`trainer.data.preference_data.collate_pairs`), labels on the answers only. `num_items` is k: the loop's window
  normaliser then makes each window's loss the mean over its pairs, whatever the accumulation and the ranks
  (Hugging Face's TRL averages micro-batch means instead; the two agree when micro batches hold equal pair counts).
- Loss: the model returns TRL's loss and metrics of the pairs without forming the logits
  (`CausalLM.forward(..., preference_loss={...})`, `kernels.fused_linear_preference_loss`: the loss inside the
  op, its gradient formed chunk by chunk of whole pairs), given the reference's per-sequence log-probs
  (`CausalLM.forward(..., sequence_logps=True)`, `kernels.fused_linear_preference`, forward only).
- The reference: none for reference-free losses (`reference_free`, orpo, simpo); else precomputed once over the
  training set before the first step (`precompute_ref_log_probs`, a table indexed by pair), or a forward of
  `ref_model` under no_grad, or, for a model with a LoRA adapter, the same model with the adapter disabled (no
  second copy of the weights), or a frozen copy of the model as it was given (TRL's default).
- Metrics: TRL's names (rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen,
  logps/rejected, logits/chosen, logits/rejected, nll_loss when the loss has it), means over the pairs since the
  last log, beside loss, grad_norm and learning_rate; evaluation reports them with the eval_ prefix.
  They accumulate on the device and reach the host at the log step only.
"""

from dataclasses import dataclass

import numpy as np
import torch

import kernels
from kernels.fused_linear_preference import LOSS_TYPES
from trainer.build import frozen_copy, resolve_tokenizer
from trainer.config.args import ConfigError, TrainingArguments, _arg
from trainer.data.batching import IGNORE_INDEX
from trainer.data.hf_datasets import hf_kind, tokenize_preference_dataset, tokenized_pairs, tokenized_splits
from trainer.data.preference_data import PREFERENCE_FORMATS, TRUNCATION_MODES, PreferenceDataset, collate_pairs
from trainer.data.streaming import PairStream, is_stream
from trainer.loop.evaluation import forward_params
from trainer.loop.trainer import Trainer
from trainer.model.causal_lm import HostLabels
from trainer.model.lora import adapters_disabled, has_adapter
from trainer.parallel.transforms import is_fsdp, unwrap

REFERENCE_FREE_LOSSES = ("orpo", "simpo")
# What evaluate() reports, as eval_<name> (metric_for_best_model may name any): the loss, the evaluation's timing,
# and kernels.preference_loss's metrics (nll_loss with rpo_alpha, orpo and simpo; the log odds with orpo)
EVAL_METRICS = (
    "loss",
    "runtime",
    "samples_per_second",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "nll_loss",
    "log_odds_ratio",
    "log_odds_chosen",
)


@dataclass
class PreferenceArguments:
    """TRL's DPOConfig (and CPOConfig/ORPOConfig) names for what preference training adds to TrainingArguments (no
    `from __future__ import annotations` in this module: the argument parser reads these annotations as types)."""

    beta: float = _arg(
        0.1, "dpo", "The loss's beta: the reference's pull for DPO types, lambda for orpo, the reward scale for simpo."
    )
    loss_type: str = _arg(
        "sigmoid", "dpo", "The preference loss (sigmoid = DPO; orpo and simpo need no reference).", choices=LOSS_TYPES
    )
    label_smoothing: float = _arg(0.0, "dpo", "Conservative DPO / robust DPO's assumed label noise, in [0, 0.5).")
    reference_free: bool = _arg(False, "dpo", "Use no reference model (a uniform one: its log-probs are zero).")
    ref_model: str | None = _arg(
        None,
        "dpo",
        "The reference model (a path or preset); default: the starting model, "
        "frozen (with LoRA: the base model, adapter disabled).",
    )
    precompute_ref_log_probs: bool = _arg(
        False,
        "dpo",
        "Compute the reference's log-probs of every training pair "
        "once before training, and hold no reference model while training.",
    )
    rpo_alpha: float | None = _arg(None, "dpo", "Add rpo_alpha x the chosen answers' NLL to a DPO-type loss (RPO).")
    simpo_gamma: float = _arg(0.5, "dpo", "SimPO's target reward margin.")
    cpo_alpha: float = _arg(
        1.0, "dpo", "Weight of the chosen answers' NLL in simpo (TRL's CPOConfig; the SimPO paper: 0)."
    )
    # TRL's max_length is the command's cutoff_len (max_length is its alias): the longest prompt + answer sequence
    max_prompt_length: int | None = _arg(None, "dpo", "Longest prompt, in tokens (its end is kept).")
    truncation_mode: str = _arg(
        "keep_start", "dpo", "Which end of a too long sequence to keep.", choices=TRUNCATION_MODES
    )

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"loss_type={self.loss_type!r}: expected one of {', '.join(LOSS_TYPES)}")
        if not self.beta > 0:
            raise ConfigError(f"beta={self.beta!r}: must be > 0")
        high = 0.5 if self.loss_type == "robust" else 1.0
        if not 0.0 <= self.label_smoothing < high or (high == 1.0 and self.label_smoothing > 1.0):
            raise ConfigError(
                f"label_smoothing={self.label_smoothing!r}: must be in [0, {high}) for loss_type {self.loss_type!r}"
            )
        if self.rpo_alpha and self.loss_type in REFERENCE_FREE_LOSSES:
            raise ConfigError(
                f"rpo_alpha: adds an NLL term to DPO-type losses; loss_type {self.loss_type!r} has its "
                "own (cpo_alpha for simpo, built into orpo)"
            )
        if self.uses_reference and self.reference_free and (self.ref_model or self.precompute_ref_log_probs):
            raise ConfigError(
                "reference_free: no reference model is used, so ref_model and precompute_ref_log_probs "
                "do not apply; set one or the other"
            )

    @property
    def uses_reference(self) -> bool:
        return self.loss_type not in REFERENCE_FREE_LOSSES

    @property
    def needs_reference(self) -> bool:
        return self.uses_reference and not self.reference_free


class PreferenceTrainer(Trainer):
    """The Trainer with preference batches and loss (module docstring); `ref_model` an nn.Module or None."""

    stage = "dpo"

    def __init__(
        self,
        model=None,
        args=None,
        pref: PreferenceArguments | None = None,
        ref_model=None,
        *,
        data_format: str = "auto",
        skip_bad_examples: bool = False,
        **kwargs,
    ):
        for name in ("data_collator", "compute_metrics", "preprocess_logits_for_metrics"):
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"PreferenceTrainer: {name} is not supported (pairs are collated by "
                    "trainer.data.preference_data.collate_pairs; the logits are never formed)"
                )
        if data_format not in PREFERENCE_FORMATS:
            raise ValueError(f"data_format={data_format!r}: expected one of {', '.join(PREFERENCE_FORMATS)}")
        # _prepare_dataset reads these; Trainer.__init__ calls it before it sets its own attributes
        self.args = args if args is not None else TrainingArguments()
        self.pref = pref or PreferenceArguments()
        self.processing_class = kwargs["processing_class"] = resolve_tokenizer(kwargs.get("processing_class"))
        self._pair_options = dict(data_format=data_format, skip_bad_examples=skip_bad_examples)
        super().__init__(model=model, args=self.args, **kwargs)
        if self.args.batching_strategy != "normal":
            raise ConfigError(
                f"batching_strategy={self.args.batching_strategy!r}: preference training batches pairs "
                "with batching_strategy='normal' only"
            )
        for name, ds in (("train_dataset", self.train_dataset), ("eval_dataset", self.eval_dataset)):
            for part in ds.values() if name == "eval_dataset" and isinstance(ds, dict) else [ds]:
                if part is not None and not isinstance(part, (PreferenceDataset, PairStream)):
                    raise ValueError(
                        f"PreferenceTrainer: {name} must be preference pairs: a PreferenceDataset "
                        "(load_preference_dataset), a datasets.Dataset or a list of pair records, or (to train on) "
                        f"a datasets.IterableDataset of them, got {type(part).__name__}"
                    )
        if is_stream(self.train_dataset) and self.pref.needs_reference and self.pref.precompute_ref_log_probs:
            raise ConfigError(
                "precompute_ref_log_probs: the training pairs are a stream, read as training goes, so there is no "
                "table to precompute before it; drop precompute_ref_log_probs (the reference then runs on each batch)"
            )
        # The reference model: the one given, else (unless precomputing, which reads the model before its first
        # step, or LoRA, whose base model is the reference) a frozen copy of the model as it was given
        self.ref_model = None
        if self.pref.needs_reference:
            if ref_model is not None:
                self.ref_model = self._frozen(self._configure_model(ref_model))
            elif not self.pref.precompute_ref_log_probs and not has_adapter(unwrap(self.model)):
                self.ref_model = self._frozen(frozen_copy(unwrap(self.model), self.args))  # sharded alike (FSDP2)
        self._ref_prepared = False  # whether the reference went through the engine's `frozen` (_reference_model)
        self._ref_tables: dict[int, np.ndarray] = {}  # id(dataset) -> (pairs, 2) fp32 reference logps, precomputed
        self._sums: dict[str, dict] = {}  # "train"/"eval" -> metric name -> device sum over pairs; "pairs" -> count

    # ---- the batch ------------------------------------------------------------------------------------------
    def _prepare_dataset(self, dataset, name: str):
        """Raw pairs (a `datasets.Dataset`, split by split for a DatasetDict, or a list of records) tokenized as files
        of the same records are (`tokenize_preference_dataset`: max_length is args.cutoff_len, max_prompt_length and
        truncation_mode the pref's); a Dataset of TRL's tokenized pair columns taken as it is (`tokenized_pairs`); an
        IterableDataset to train on, of either, as a `PairStream` (the same tokenisation, read as training goes;
        max_steps needed); one to evaluate on arrives here read whole, as a Dataset (`eval_whole`)."""
        tokenizer = self.processing_class
        if name == "train_dataset" and hf_kind(dataset) == "IterableDataset":
            return PairStream(
                [dataset],
                tokenizer,
                names=[name],
                max_length=self.args.cutoff_len,
                max_prompt_length=self.pref.max_prompt_length,
                truncation_mode=self.pref.truncation_mode,
                **self._pair_options,
            )

        def tokenize(rows, split):
            return tokenize_preference_dataset(
                rows,
                tokenizer,
                split=split,
                max_length=self.args.cutoff_len,
                max_prompt_length=self.pref.max_prompt_length,
                truncation_mode=self.pref.truncation_mode,
                show_progress=not self.args.disable_tqdm,
                **self._pair_options,
            )

        dataset = tokenized_splits(dataset, name, tokenize if tokenizer is not None else None, "chosen_input_ids")
        return super()._prepare_dataset(tokenized_pairs(dataset, name), name)

    def _loader(self, dataset, micro: int, train: bool):
        loader = super()._loader(dataset, micro, train)
        pad_id = getattr(self.processing_class, "pad_token_id", None)
        pad_id = 0 if pad_id is None else pad_id
        table = self._ref_tables.get(id(dataset))

        def collate(pairs, indices, is_padding=False):
            batch = collate_pairs([pairs[int(i)] for i in indices], pad_id, self.args.pad_to_multiple_of)
            if is_padding:  # a filler batch that keeps ranks in step: nothing to train on
                batch["labels"][:] = IGNORE_INDEX
                batch["num_pairs"] = 0
            batch["num_items"] = batch["num_pairs"]  # the loop's normaliser: the window's loss is a mean over pairs
            if table is not None:
                rows = table[np.asarray(indices, dtype=np.int64)]  # (k, 2)
                batch["ref_logps"] = torch.from_numpy(np.concatenate([rows[:, 0], rows[:, 1]]))
            return batch

        if is_stream(dataset):  # a StreamLoader: each buffer of pairs planned by its own BatchLoader
            loader.collate = lambda planner, indices: collate(planner.dataset, indices)
        else:
            loader.collate = lambda indices, is_padding=False: collate(dataset, indices, is_padding)
        return loader

    # ---- the loss -------------------------------------------------------------------------------------------
    def _forward(self, model, batch, device, **kwargs):
        """The model's forward on the batch with its labels (sequence_logps=True or preference_loss=...)."""
        accepted = forward_params(model)  # inspect.signature: once per call, not once per key
        inputs = {
            k: batch[k].to(device, non_blocking=True)
            for k in ("input_ids", "attention_mask", "position_ids")
            if k in accepted or "**" in accepted
        }
        # labels stay on the host (the fused op skips the prompt rows without a device sync); FSDP2 moves
        # tensor arguments, so they travel in a holder (see Trainer._compute_loss)
        labels = HostLabels(batch["labels"]) if is_fsdp(model) else batch["labels"]
        return model(**inputs, labels=labels, **kwargs)

    def _sequence_logps(self, model, batch, device) -> kernels.PreferenceLogps:
        """Each row's answer log-probability sum, count and mean logit, through the model's forward."""
        return self._forward(model, batch, device, sequence_logps=True).sequence_logps

    def _reference_logps(self, batch, device) -> torch.Tensor | None:
        if not self.pref.needs_reference:
            return None
        if "ref_logps" in batch:
            return batch["ref_logps"].to(device, non_blocking=True)
        if self.ref_model is None and not has_adapter(unwrap(self.model)) and self.state.global_step > 0:
            raise ValueError(
                "precompute_ref_log_probs: this dataset's reference log-probs were not precomputed "
                "before training, and the model has trained since (pass it as eval_dataset)"
            )
        with torch.no_grad():
            if self.ref_model is not None:
                return self._sequence_logps(self._reference_model(), batch, device).logps
            # the base model under the LoRA adapter, or (precomputing, before any step) the model as given
            with adapters_disabled(unwrap(self.model)):
                return self._sequence_logps(self.model, batch, device).logps

    def _compute_loss(self, model, batch, num_items, device):
        """The batch's pairs' loss sum / num_items (the window's pairs), metrics added to the running sums."""
        ref = self._reference_logps(batch, device)
        # the loss inside the model's forward: with use_kernels kernels.fused_linear_preference_loss forms its
        # gradient in one pass over the answer rows (6 K H V matmul FLOPs); else the same formulas on the logits
        options = dict(
            ref_logps=ref,
            loss_type=self.pref.loss_type,
            beta=self.pref.beta,
            label_smoothing=self.pref.label_smoothing,
            rpo_alpha=self.pref.rpo_alpha or None,
            simpo_gamma=self.pref.simpo_gamma,
            cpo_alpha=self.pref.cpo_alpha,
        )
        out = self._forward(model, batch, device, preference_loss=options)
        self._record_aux_loss(out)
        loss, metrics = out.loss, out.metrics
        pairs = int(batch["num_pairs"])
        if pairs:
            # unwrap: DeepSpeed's engine.eval() switches its module, not the engine's own `training`
            sums = self._sums.setdefault("train" if unwrap(model).training else "eval", {"pairs": 0})
            sums["pairs"] += pairs
            for name, value in metrics.items():
                sums[name] = sums.get(name, 0) + value.detach() * pairs
        return loss * (pairs / num_items)

    # ---- the metrics ----------------------------------------------------------------------------------------
    def _take_metrics(self, mode: str, prefix: str = "") -> dict:
        """The mean of each metric over the pairs since the last call (one host copy), and start over."""
        sums = self._sums.pop(mode, None)
        if not sums or not sums["pairs"]:
            return {}
        pairs = sums.pop("pairs")
        names = sorted(sums)
        values = torch.stack([sums[n].double() for n in names])
        if self.world_size > 1:
            counts = torch.tensor([float(pairs)], dtype=torch.float64, device=values.device)
            both = torch.cat([values, counts])
            torch.distributed.all_reduce(both)
            values, pairs = both[:-1], both[-1].item()
        return {f"{prefix}{n}": v / pairs for n, v in zip(names, values.tolist())}

    def _extra_logs(self) -> dict:
        return self._take_metrics("train")

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        """The Trainer's evaluation (the mean preference loss over the pairs) with TRL's metrics; no perplexity,
        which exp(a preference loss) is not (TRL's DPOTrainer reports none)."""
        self._sums.pop("eval", None)
        metrics = super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        metrics.pop(f"{metric_key_prefix}_perplexity", None)
        return {**metrics, **self._take_metrics("eval", f"{metric_key_prefix}_")}

    @torch.no_grad()
    def preference_accuracy(self, dataset: PreferenceDataset) -> float:
        """The fraction of `dataset`'s pairs whose chosen answer the model finds likelier than the rejected one (the
        sums of the answer tokens' log-probabilities): the demo's before/after figure, free of the reference."""
        model, device = self.model, self._device(self.model)
        was_training = unwrap(model).training  # a DeepSpeed engine's own flag stays True
        model.eval()
        counts = torch.zeros(2, dtype=torch.float64, device=device)  # (pairs ahead, pairs)
        try:
            for batch in self._eval_loader(dataset):
                with self._autocast(device, train=False):
                    logps = self._sequence_logps(model, batch, device).logps
                k = int(batch["num_pairs"])
                chosen, rejected = logps[:k], logps[len(logps) // 2 : len(logps) // 2 + k]
                counts += torch.stack([(chosen > rejected).sum().double(), torch.tensor(float(k), device=device)])
        finally:
            model.train(was_training)
        if self.world_size > 1:
            torch.distributed.all_reduce(counts)
        ahead, total = counts.tolist()
        return ahead / max(total, 1.0)

    # ---- the reference ----------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None):
        if self.pref.needs_reference and self.pref.precompute_ref_log_probs and not self._ref_tables:
            evals = (
                self.eval_dataset.values()
                if isinstance(self.eval_dataset, dict)
                else [self.eval_dataset]
                if self.eval_dataset is not None
                else []
            )
            for ds in (self.train_dataset, *evals):
                self._ref_tables[id(ds)] = self.reference_table(ds)
            self.ref_model = None  # nothing of the reference is held while training
        return super().train(resume_from_checkpoint)

    @torch.no_grad()
    def reference_table(self, dataset: PreferenceDataset) -> np.ndarray:
        """(pairs, 2) fp32: the reference's chosen and rejected answer log-probs of every pair of `dataset`, by a
        pass in dataset order before any training step (the model as it was given, or `ref_model`)."""
        model = self.model
        device = self._device(model)
        loader = self._eval_loader(dataset)
        was_training = unwrap(model).training  # a DeepSpeed engine's own flag stays True
        model.eval()
        out = np.zeros((len(dataset), 2), dtype=np.float32)
        plan = loader.global_batches(loader.epoch)
        try:
            # every rank runs as many forwards (the loader evens them out with filler batches: sharded models
            # gather in each), and rank r's k-th batch is the plan's batch r + k * world_size
            for k, batch in enumerate(loader):
                with self._autocast(device, train=False):
                    logps = self._reference_logps(batch, device)
                j = self.rank + k * self.world_size
                if j < len(plan):
                    indices = np.asarray(plan[j], dtype=np.int64)
                    out[indices] = logps.float().view(2, len(indices)).T.cpu().numpy()
        finally:
            model.train(was_training)
        if self.world_size > 1:  # each rank filled its share of the pairs; the rest are zeros
            table = torch.from_numpy(out).to(device)
            torch.distributed.all_reduce(table)
            out = table.cpu().numpy()
        return out

    def _reference_model(self):
        """The reference model a forward runs. Under DeepSpeed, once the policy's engine exists, the frozen reference
        goes through DeepSpeed too (`DeepSpeedRun.frozen`, as TRL prepares its reference): in the policy's dtype,
        and under ZeRO-3 its parameters partitioned over the ranks like the policy's and gathered module by module
        in each forward. Every rank makes its first reference forward at the same micro step, so they wrap it
        together (a collective)."""
        if self.engine is not None and not self._ref_prepared:
            self.ref_model = self.engine.frozen(self.ref_model)
            self._ref_prepared = True
        return self.ref_model

    def _frozen(self, model):
        model.to(self._device(self.model)).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        return model
