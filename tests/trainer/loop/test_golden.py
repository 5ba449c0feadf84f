"""Golden runs: our Trainer against `transformers.Trainer`, and our kernels against plain PyTorch.

The safety net for refactoring the loop (issue 12): the same transformers-written tiny Llama, the same examples in
the same order (sequential sampling), micro batch 4 x accumulation 2, AdamW (torch), a linear schedule with warmup,
weight decay on the matrices only, gradient clipping at 1.0, fp32, 100 optimizer steps. Both trainers normalise
each window's loss by its supervised tokens, so the per-step losses and the final weights must agree to fp32 noise
(rounding differs only in the order of a few sums: measured max |loss difference| and max |weight difference|
are in the assertions' comments).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels
from trainer.build import load_pretrained
from trainer.config.args import TrainingArguments
from trainer.data.sft_data import TokenizedDataset
from trainer.loop.trainer import Trainer

transformers = pytest.importorskip("transformers")

VOCAB, PAD = 300, 0
STEPS = 100


def _examples(n: int = 32, seed: int = 5) -> list[dict]:
    """Token sequences of 6-40 tokens whose first 2-10 tokens are prompt (label -100), as SFT data looks."""
    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(n):
        length = int(rng.integers(6, 41))
        ids = rng.integers(1, VOCAB, size=length)
        labels = ids.copy()
        labels[: int(rng.integers(2, min(11, length)))] = -100
        examples.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return examples


def _pad(batch: list[dict]) -> dict:
    """Right-pad to the longest row: input_ids with PAD, labels with -100, an attention mask of the real tokens."""
    width = max(len(ex["input_ids"]) for ex in batch)
    ids = torch.full((len(batch), width), PAD, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ex in enumerate(batch):
        n = len(ex["input_ids"])
        ids[row, :n] = torch.as_tensor(ex["input_ids"])
        labels[row, :n] = torch.as_tensor(ex["labels"])
        mask[row, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path


COMMON = dict(
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    learning_rate=3e-3,
    lr_scheduler_type="linear",
    warmup_steps=10,
    weight_decay=0.1,
    max_grad_norm=1.0,
    max_steps=STEPS,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    seed=0,
    optim="adamw_torch",
    train_sampling_strategy="sequential",
    disable_tqdm=True,
)


def _hf_run(path, examples, out):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    args = transformers.TrainingArguments(
        output_dir=str(out), use_cpu=True, remove_unused_columns=False, dataloader_num_workers=0, **COMMON
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=examples, data_collator=_pad)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _our_run(path, examples, out, use_kernels=False, **overrides):
    model = load_pretrained(path, use_kernels=use_kernels)
    args = TrainingArguments(output_dir=str(out), use_kernels=use_kernels, **{**COMMON, **overrides})
    trainer = Trainer(model=model, args=args, train_dataset=TokenizedDataset.from_examples(examples))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_100_steps_match_transformers_trainer(hf_dir, tmp_path):
    examples = _examples()
    hf_losses, hf_weights = _hf_run(hf_dir, examples, tmp_path / "hf")
    our_losses, our_weights = _our_run(hf_dir, examples, tmp_path / "ours")
    assert len(hf_losses) == len(our_losses) == STEPS
    assert our_losses[-1] < 0.8 * our_losses[0]  # it learned, so the comparison covers a moving run
    # Measured: max |difference| of the loss curves 8.3e-7 (losses 5.73 -> 0.73), of the weights 4.8e-7.
    np.testing.assert_allclose(our_losses, hf_losses, rtol=1e-5, atol=1e-6)
    assert our_weights.keys() >= {k for k in hf_weights if "rotary" not in k}
    for name, hf_value in hf_weights.items():
        torch.testing.assert_close(our_weights[name], hf_value, rtol=1e-4, atol=1e-5, msg=name)


def test_kernels_on_and_off_train_the_same(hf_dir, tmp_path):
    """Six steps with the Triton kernels (through the interpreter) against the plain PyTorch path."""
    examples = _examples(n=16)
    plain_losses, plain_weights = _our_run(hf_dir, examples, tmp_path / "plain", max_steps=6)
    with kernels.backend("triton"):
        kernel_losses, kernel_weights = _our_run(hf_dir, examples, tmp_path / "kernels", use_kernels=True, max_steps=6)
    np.testing.assert_allclose(kernel_losses, plain_losses, rtol=1e-5, atol=1e-6)
    for name, value in plain_weights.items():
        torch.testing.assert_close(kernel_weights[name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_eval_loss_with_label_smoothing_matches_transformers_with_and_without_compute_metrics(hf_dir, tmp_path):
    """One eval-loss path (issue 23 item 4): with label_smoothing_factor the eval loss is transformers' (its
    LabelSmoother applies in evaluation too), whether or not compute_metrics asks for the predictions. One eval
    batch, so transformers' mean of batch means is the token-weighted mean we report. Before the fix the
    predictions path computed plain cross-entropy: 5.8319 without compute_metrics, 5.8359 with."""
    examples = _examples(n=8, seed=9)
    settings = dict(COMMON, label_smoothing_factor=0.1, per_device_eval_batch_size=len(examples))

    def compute_metrics(pred):
        return {"rows": float(len(pred.label_ids))}

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")
    hf_args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), use_cpu=True, remove_unused_columns=False, dataloader_num_workers=0, **settings
    )
    hf_loss = transformers.Trainer(model=model, args=hf_args, data_collator=_pad, eval_dataset=examples).evaluate()[
        "eval_loss"
    ]
    ours = {}
    for name, metrics_fn in (("plain", None), ("metrics", compute_metrics)):
        args = TrainingArguments(output_dir=str(tmp_path / name), **settings)
        trainer = Trainer(
            model=load_pretrained(hf_dir, use_kernels=False),
            args=args,
            eval_dataset=TokenizedDataset.from_examples(examples),
            compute_metrics=metrics_fn,
        )
        ours[name] = trainer.evaluate()
    assert ours["metrics"]["eval_rows"] == len(examples)
    assert ours["plain"]["eval_loss"] == pytest.approx(hf_loss, rel=1e-5)
    assert ours["metrics"]["eval_loss"] == pytest.approx(hf_loss, rel=1e-5)
