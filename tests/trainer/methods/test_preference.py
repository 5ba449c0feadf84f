"""Preference training on the Trainer's loop (trainer/methods/preference.py): a run against a DPO loop written by
hand in plain PyTorch (materialised logits, log_softmax, gather, TRL's sigmoid formula, torch's AdamW), the first step's
known values, the reference's four sources (a frozen copy, a given model, precomputed, LoRA's base model) giving
the same run, reference-free losses, TRL's metric names in the logs and the evaluation, pairs from a datasets.Dataset
as from a file, and the bad settings."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.trainer.loop.test_trainer import small_model as trainer_small_model
from trainer.config.args import ConfigError, TrainingArguments
from trainer.data.preference_data import PreferenceDataset, collate_pairs, load_preference_dataset
from trainer.data.sft_data import DataError, TokenizedDataset
from trainer.data.tasks import generate_tasks, preference_pair
from trainer.data.tokenizer import byte_level_tokenizer
from trainer.methods.preference import PreferenceArguments, PreferenceTrainer
from trainer.model.causal_lm import CausalLM
from trainer.model.offload import ActivationOffloader

datasets = pytest.importorskip("datasets")  # an optional extra (kernelwright[datasets])

STEPS, PAIRS_PER_STEP = 4, 4
LN2 = float(np.log(2.0))


def small_model(seed: int = 0) -> CausalLM:
    """test_trainer's small model with its own LM head, on the plain PyTorch path."""
    return trainer_small_model(seed, tie_word_embeddings=False, use_kernels=False)


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(preference_pair(ex)) + "\n" for ex in generate_tasks(STEPS * PAIRS_PER_STEP, 4)))
    return load_preference_dataset(path, tokenizer, show_progress=False)


def make_args(tmp_path, **overrides) -> TrainingArguments:
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=["jsonl"],
        disable_tqdm=True,
        seed=0,
        optim="adamw_torch",
        train_shuffle=False,
        max_steps=STEPS,
        use_kernels=False,
    )
    values.update(overrides)
    return TrainingArguments(**values)


def run(tmp_path, pairs, tokenizer, model=None, pref=None, **overrides):
    model = model if model is not None else small_model()
    trainer = PreferenceTrainer(
        model=model,
        args=make_args(tmp_path, **overrides),
        pref=pref or PreferenceArguments(),
        train_dataset=pairs,
        processing_class=tokenizer,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return trainer, logs


def answer_logps(model, batch):
    """Plain PyTorch: each row's sum of log p(target) over its answer tokens, from materialised logits."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    targets = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    mask = targets != -100
    logp = logits.log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (logp * mask).sum(-1)


def test_dpo_matches_a_loop_written_by_hand(tmp_path, pairs, tokenizer):
    """Four steps of sigmoid DPO, 2 pairs per micro batch x 2 accumulation: the same losses and weights as a loop
    of plain PyTorch (one batch of all the window's pairs: the window's mean over pairs)."""
    _, logs = run(tmp_path, pairs, tokenizer)
    policy = small_model()
    reference = copy.deepcopy(policy).eval()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3, weight_decay=0.0)
    beta, expected = 0.1, []
    for step in range(STEPS):
        window = [pairs[i] for i in range(step * PAIRS_PER_STEP, (step + 1) * PAIRS_PER_STEP)]
        batch = collate_pairs(window, pad_token_id=tokenizer.pad_token_id)
        with torch.no_grad():
            ref = answer_logps(reference, batch)
        pol = answer_logps(policy, batch)
        k = len(window)
        logits = (pol[:k] - pol[k:]) - (ref[:k] - ref[k:])
        loss = -F.logsigmoid(beta * logits).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    assert logs[0]["loss"] == pytest.approx(LN2, abs=1e-6)  # policy == reference at the first step
    np.testing.assert_allclose([h["loss"] for h in logs], expected, rtol=1e-5, atol=1e-6)
    assert expected[-1] < expected[0]


def test_first_step_metrics_have_trls_names_and_values(tmp_path, pairs, tokenizer):
    trainer, logs = run(tmp_path, pairs, tokenizer, max_steps=1)
    first = logs[0]
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert first[name] == pytest.approx(0.0, abs=1e-7), name  # the policy is the reference
    assert first["rewards/accuracies"] == 0.0  # no pair is ahead yet (strictly greater counts)
    assert first["logps/chosen"] < 0 and first["logps/rejected"] < 0
    assert np.isfinite(first["logits/chosen"]) and np.isfinite(first["logits/rejected"])
    assert first["supervised_tokens_per_second"] > 0
    written = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert any("rewards/margins" in row for row in written)
    metrics = trainer.evaluate(pairs)
    assert {"eval_loss", "eval_rewards/chosen", "eval_rewards/accuracies", "eval_logps/rejected"} <= set(metrics)
    assert "eval_perplexity" not in metrics  # exp(a preference loss) is no perplexity


@pytest.mark.parametrize("source", ["given", "precomputed"])
def test_every_reference_source_trains_the_same(tmp_path, pairs, tokenizer, source):
    """A given reference model, and log-probs precomputed before the first step, equal the default (a frozen
    copy of the starting model)."""
    _, default = run(tmp_path / "default", pairs, tokenizer)
    if source == "given":
        trainer = PreferenceTrainer(
            model=small_model(),
            ref_model=small_model(),
            args=make_args(tmp_path),
            pref=PreferenceArguments(),
            train_dataset=pairs,
            processing_class=tokenizer,
        )
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
    else:
        trainer, logs = run(tmp_path, pairs, tokenizer, pref=PreferenceArguments(precompute_ref_log_probs=True))
        assert trainer.ref_model is None  # nothing of the reference held while training
    np.testing.assert_allclose([h["loss"] for h in logs], [h["loss"] for h in default], rtol=1e-6, atol=1e-7)


def test_lora_reference_is_the_base_model(tmp_path, pairs, tokenizer):
    """With a LoRA adapter the reference is the model with the adapter disabled: no copy; at the first step the
    policy is the base model (B = 0), so the loss is log 2 and the rewards zero; training moves only the adapter."""
    pytest.importorskip("peft")
    from trainer.model.lora import apply_lora, init_adapter_weights

    args = make_args(tmp_path, use_peft=True, lora_r=4, lora_alpha=8, learning_rate=1e-2)
    model = apply_lora(small_model(), args)
    init_adapter_weights(model, seed=0)
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    trainer = PreferenceTrainer(
        model=model, args=args, pref=PreferenceArguments(), train_dataset=pairs, processing_class=tokenizer
    )
    assert trainer.ref_model is None
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs[0]["loss"] == pytest.approx(LN2, abs=1e-6) and logs[0]["rewards/margins"] == pytest.approx(0, abs=1e-7)
    assert logs[-1]["rewards/margins"] != 0  # the adapter moved the policy away from the reference
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())
    assert all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())


@pytest.mark.parametrize(
    "loss_type, extra",
    [("orpo", "nll_loss"), ("simpo", "nll_loss"), ("ipo", None), ("hinge", None), ("apo_zero", None)],
)
def test_other_losses_train(tmp_path, pairs, tokenizer, loss_type, extra):
    trainer, logs = run(tmp_path, pairs, tokenizer, pref=PreferenceArguments(loss_type=loss_type), max_steps=2)
    assert len(logs) == 2 and all(np.isfinite(h["loss"]) for h in logs)
    if extra:
        assert extra in logs[0]
    if loss_type in ("orpo", "simpo"):
        assert trainer.ref_model is None  # reference-free


def test_rpo_alpha_adds_the_chosen_nll(tmp_path, pairs, tokenizer):
    _, plain = run(tmp_path / "a", pairs, tokenizer, max_steps=1)
    _, rpo = run(tmp_path / "b", pairs, tokenizer, pref=PreferenceArguments(rpo_alpha=0.5), max_steps=1)
    assert rpo[0]["loss"] == pytest.approx(plain[0]["loss"] + 0.5 * rpo[0]["nll_loss"], rel=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(loss_type="kto"), "loss_type='kto': expected one of sigmoid"),
        (dict(beta=0.0), "beta=0.0: must be > 0"),
        (dict(loss_type="robust", label_smoothing=0.5), "label_smoothing=0.5: must be in \\[0, 0.5\\)"),
        (dict(loss_type="orpo", rpo_alpha=1.0), "rpo_alpha"),
        (dict(reference_free=True, precompute_ref_log_probs=True), "reference_free"),
    ],
)
def test_bad_settings_are_one_line(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        PreferenceArguments(**kwargs)


def test_sft_data_and_other_batching_are_refused(tmp_path, pairs, tokenizer):
    with pytest.raises(ConfigError, match="batching_strategy='padding_free'"):
        PreferenceTrainer(
            model=small_model(), args=make_args(tmp_path, batching_strategy="padding_free"), train_dataset=pairs
        )
    sft_tokens = TokenizedDataset.from_examples([([1, 2, 3], [-100, 2, 3])])
    with pytest.raises(ValueError, match="^PreferenceTrainer: train_dataset must be preference pairs: a Preference"):
        PreferenceTrainer(model=small_model(), args=make_args(tmp_path), train_dataset=sft_tokens)
    args, sft_rows = make_args(tmp_path), [{"input_ids": [1, 2]}]
    with pytest.raises(DataError, match=r"^train_dataset row 0: cannot tell the data format from the keys \['input"):
        PreferenceTrainer(model=small_model(), args=args, train_dataset=sft_rows, processing_class=tokenizer)


def test_pairs_from_a_dataset_train_as_the_same_pairs_from_a_file(tmp_path, pairs, tokenizer):
    """TRL's conversational records as a datasets.Dataset (the fixture's file holds the same records), with a
    DatasetDict to evaluate on: the same first DPO step, weights and evaluation as the file's pairs; a raw Dataset
    without a processing_class, or with a bad row, is one line."""
    records = [preference_pair(ex) for ex in generate_tasks(STEPS * PAIRS_PER_STEP, 4)]
    rows = datasets.Dataset.from_list(records)
    file_trainer, file_logs = run(tmp_path / "file", pairs, tokenizer, max_steps=1)
    trainer = PreferenceTrainer(
        model=small_model(),
        args=make_args(tmp_path / "rows", max_steps=1),
        train_dataset=rows,
        eval_dataset=datasets.DatasetDict(val=rows.select(range(4))),
        processing_class=tokenizer,
    )
    assert isinstance(trainer.train_dataset, PreferenceDataset) and len(trainer.train_dataset) == len(pairs)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]

    def measured(log):  # the step's numbers, not its timing
        return {k: v for k, v in log.items() if "per_second" not in k and k != "peak_memory_gb"}

    assert len(logs) == 1 and measured(logs[0]) == measured(file_logs[0])
    for (name, got), want in zip(trainer.model.state_dict().items(), file_trainer.model.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
    metrics = trainer.evaluate()
    assert metrics["eval_val_loss"] == file_trainer.evaluate(pairs.select(range(4)))["eval_loss"]
    assert "eval_val_rewards/margins" in metrics
    with pytest.raises(DataError, match=r"^train_dataset: raw records need a processing_class to tokenize them"):
        PreferenceTrainer(model=small_model(), args=make_args(tmp_path), train_dataset=rows)
    bad = datasets.Dataset.from_list(records[:2] + [{**records[2], "rejected": records[2]["chosen"]}])
    with pytest.raises(DataError, match=r"^eval_dataset split 'val' row 2: chosen and rejected are identical"):
        PreferenceTrainer(
            model=small_model(),
            args=make_args(tmp_path),
            train_dataset=pairs,
            eval_dataset={"val": bad},
            processing_class=tokenizer,
        )


def test_trls_tokenized_pair_columns_train_as_the_same_pairs(tmp_path, pairs, tokenizer):
    """A Dataset of TRL's tokenized columns (prompt_input_ids, chosen_input_ids, rejected_input_ids) holding the
    fixture's pairs: the same PreferenceDataset and the same first DPO step; a malformed row or missing column is one
    line naming it."""
    columns = {
        f"{part}_input_ids": [pairs[i][f"{part}_ids"].tolist() for i in range(len(pairs))]
        for part in ("prompt", "chosen", "rejected")
    }
    tokens = datasets.Dataset.from_dict(columns)
    file_trainer, file_logs = run(tmp_path / "file", pairs, tokenizer, max_steps=1)
    trainer = PreferenceTrainer(
        model=small_model(), args=make_args(tmp_path / "tokens", max_steps=1), train_dataset=tokens
    )  # no processing_class needed
    got = trainer.train_dataset
    assert isinstance(got, PreferenceDataset) and all(
        np.array_equal(got.ids[k], pairs.ids[k]) and np.array_equal(got.offsets[k], pairs.offsets[k])
        for k in ("prompt", "chosen", "rejected")
    )
    trainer.processing_class = tokenizer
    trainer.train()
    for (name, p), q in zip(trainer.model.state_dict().items(), file_trainer.model.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    bad = datasets.Dataset.from_dict({**columns, "chosen_input_ids": [[]] + columns["chosen_input_ids"][1:]})
    with pytest.raises(DataError, match=r"^train_dataset row 0: chosen_input_ids is empty"):
        PreferenceTrainer(model=small_model(), args=make_args(tmp_path), train_dataset=bad)
    partial = datasets.Dataset.from_dict({k: v for k, v in columns.items() if k != "rejected_input_ids"})
    with pytest.raises(DataError, match=r"^eval_dataset: no column 'rejected_input_ids'"):
        PreferenceTrainer(model=small_model(), args=make_args(tmp_path), train_dataset=pairs, eval_dataset=partial)


def test_kernels_through_the_interpreter_train_as_plain_pytorch(tmp_path, pairs, tokenizer):
    """use_kernels with the Triton kernels (the fused preference op among them, through the interpreter) against
    the plain PyTorch path: the same two steps."""
    import kernels

    _, plain = run(tmp_path / "plain", pairs, tokenizer, max_steps=2)
    model = small_model()
    model.use_kernels = True
    with kernels.backend("triton"):
        _, fused = run(tmp_path / "fused", pairs, tokenizer, model=model, max_steps=2, use_kernels=True)
    np.testing.assert_allclose([h["loss"] for h in fused], [h["loss"] for h in plain], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        [h["rewards/margins"] for h in fused], [h["rewards/margins"] for h in plain], rtol=1e-4, atol=1e-6
    )


def test_activation_offloading_and_tiled_mlp_under_dpo(tmp_path, pairs, tokenizer):
    """The policy's saves go to the host (the reference runs without grad: nothing saved) and its MLPs run in
    tiles: offloading alone changes no bit; the tiles only the rounding of the weight-gradient sums."""
    plain_trainer, plain = run(tmp_path / "plain", pairs, tokenizer, max_steps=2)
    trainer, offloaded = run(tmp_path / "off", pairs, tokenizer, max_steps=2, activation_offloading=True)
    assert ActivationOffloader.for_model(trainer.model, "cpu").offloaded_bytes > 0  # the one the trainer attached
    numbers = ("loss", "grad_norm", "rewards/margins", "logps/chosen", "logps/rejected")
    assert [[h[k] for k in numbers] for h in offloaded] == [[h[k] for k in numbers] for h in plain]
    for (name, a), b in zip(plain_trainer.model.named_parameters(), trainer.model.parameters()):
        assert torch.equal(a, b), name
    _, tiled = run(tmp_path / "tiled", pairs, tokenizer, max_steps=2, activation_offloading=True, tiled_mlp=True)
    np.testing.assert_allclose([h["loss"] for h in tiled], [h["loss"] for h in plain], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precompute", [False, True])
def test_resume_is_exact(tmp_path, pairs, tokenizer, precompute):
    """A run resumed from its step-2 checkpoint logs the unbroken run's losses and metrics for steps 3-4: the
    reference (a copy of the model as given, or the table precomputed from it) is the starting model's again,
    not the checkpoint's."""
    pref = PreferenceArguments(precompute_ref_log_probs=precompute)
    _, unbroken = run(tmp_path / "a", pairs, tokenizer, pref=pref, save_strategy="steps", save_steps=2)
    trainer = PreferenceTrainer(
        model=small_model(),
        pref=pref,
        train_dataset=pairs,
        processing_class=tokenizer,
        args=make_args(tmp_path / "a", save_strategy="steps", save_steps=2),
    )
    trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-2"))
    resumed = [h for h in trainer.state.log_history if "loss" in h and h["step"] > 2]
    assert [h["step"] for h in resumed] == [3, 4]
    for key in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen"):
        assert [h[key] for h in resumed] == [h[key] for h in unbroken[2:]], key
