"""GRPOTrainer (trainer/methods/grpo.py, issue 31 items 1, 3, 5): a step's completions, rewards and update on the tiny
model; the update independent of the split into micro batches (exact accumulation), a resumed run equal to an
unbroken one, TRL's logged names, completions.jsonl, and the one-line refusals."""

import json

import pytest
import torch

from trainer.build import build_model, build_preset
from trainer.config.args import ConfigError, TrainingArguments
from trainer.data.tasks import TRAIN_FILE
from trainer.methods.grpo import GRPOArguments, GRPOTrainer, PromptDataset, prompts_from_conversations
from trainer.methods.grpo_rewards import RewardError
from trainer.sft import held_out_conversations


def distinct_chars(completions, **kwargs):
    """A reward that differs between completions of one prompt, so that the advantages are not all zero."""
    return [float(len(set(c[0]["content"]))) for c in completions]


@pytest.fixture(scope="module")
def prompts():
    return prompts_from_conversations(held_out_conversations([str(TRAIN_FILE)], 16))


def _trainer(tmp_path, prompts, reward=distinct_chars, micro=8, accum=1, steps=2, seed=0, **grpo):
    torch.manual_seed(seed)
    model, tok = build_preset("tiny")
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum,
        max_steps=steps,
        learning_rate=0.1,
        optim="sgd",  # a step proportional to the gradient: Adam's would magnify fp32 noise in near-zero entries
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=seed,
    )
    options = dict(num_generations=4, max_completion_length=6, **grpo)
    return GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        grpo=GRPOArguments(**options),
        train_dataset=prompts,
        processing_class=tok,
    )


def _weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize(
    "options",
    [
        {"loss_type": "dapo"},
        {"loss_type": "bnpo"},
        {"loss_type": "grpo", "scale_rewards": "batch"},
        {"loss_type": "dr_grpo", "importance_sampling_level": "sequence"},
        {"loss_type": "dapo", "beta": 0.04},
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_the_update_does_not_depend_on_the_micro_batch_split(tmp_path, prompts, options):
    """8 completions x 1 micro step and 4 x 2 (and 2 x 4): the same completions, and the same weights after two
    steps to fp32 noise, for each normalisation (bnpo divides by the window's tokens here, TRL by each micro
    batch's), and with the KL term against the reference."""
    runs = []
    for micro, accum in ((8, 1), (4, 2), (2, 4)):
        trainer = _trainer(tmp_path / f"{micro}x{accum}", prompts, micro=micro, accum=accum, **options)
        trainer.train()
        runs.append((_weights(trainer), trainer.state.log_history))
    (w0, logs0), *others = runs
    assert logs0[0]["reward_std"] > 0  # the advantages are not all zero: the update is real
    for w, logs in others:
        assert logs[0]["reward"] == logs0[0]["reward"]  # the same completions
        for name in w0:
            torch.testing.assert_close(w[name], w0[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    changed = _trainer(tmp_path / "before", prompts, **options).model.state_dict()
    assert any(not torch.equal(changed[k], w0[k]) for k in w0)


def test_masked_truncated_completions_leave_nothing_to_learn(tmp_path, prompts):
    """The tiny random model never says EOS within 6 tokens: every completion is truncated, and with
    mask_truncated_completions none is in the loss (TRL's): the loss and the update are zero."""
    trainer = _trainer(tmp_path, prompts, steps=1, mask_truncated_completions=True)
    before = _weights(trainer)
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["completions/clipped_ratio"] == 1.0 and logged["loss"] == 0.0
    after = _weights(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_resumed_run_ends_as_the_unbroken_one(tmp_path, prompts):
    """Completions are keyed by (seed, step, completion index): a run resumed from its step-2 checkpoint samples
    what the unbroken run sampled and ends with the same weights, bit for bit."""
    unbroken = _trainer(tmp_path / "a", prompts, steps=4)
    unbroken.train()
    first = _trainer(tmp_path / "b", prompts, steps=4)
    first.args.save_strategy, first.args.save_steps, first.args.max_steps = "steps", 2, 4
    first.args.save_total_limit = None
    first.control_stop_at = 2

    class StopAt2:
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                control.should_training_stop = True
            return control

    first.add_callback(StopAt2())
    first.train()
    assert (tmp_path / "b" / "checkpoint-2").is_dir()
    resumed = _trainer(tmp_path / "b", prompts, steps=4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))
    a, b = _weights(unbroken), _weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_trl_metric_names_and_the_completions_file(tmp_path, prompts):
    trainer = _trainer(tmp_path, prompts, beta=0.04, log_completions=True)
    trainer.train()
    logged = trainer.state.log_history[0]
    for name in (
        "loss",
        "grad_norm",
        "learning_rate",
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "rewards/distinct_chars/mean",
        "rewards/distinct_chars/std",
        "completions/mean_length",
        "completions/min_length",
        "completions/max_length",
        "completions/clipped_ratio",
        "kl",
        "entropy",
        "clip_ratio/low_mean",
        "clip_ratio/high_max",
        "clip_ratio/region_mean",
    ):
        assert name in logged, name
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 8 and {r["step"] for r in rows} == {1, 2}
    assert set(rows[0]) == {"step", "prompt", "completion", "distinct_chars", "advantage"}
    assert rows[0]["prompt"] == prompts[0]["prompt"][-1]["content"] or rows[0]["prompt"] in {
        p["prompt"][-1]["content"] for p in prompts
    }
    assert rows[0]["distinct_chars"] == float(len(set(rows[0]["completion"])))


def test_a_reward_function_that_fails_is_one_line_before_any_update(tmp_path, prompts):
    def broken(completions, **kwargs):
        return [1.0] * (len(completions) - 1)

    trainer = _trainer(tmp_path, prompts, reward=broken)
    before = _weights(trainer)
    with pytest.raises(RewardError, match="reward function 'broken' returned 7 rewards for 8 completions"):
        trainer.train()
    after = _weights(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"micro": 6}, "num_generations=4: must divide the completions of a step on each process"),
        ({"num_iterations": 2}, "num_iterations=2: only 1 is supported yet"),
        ({"steps_per_generation": 4}, "steps_per_generation=4: only gradient_accumulation_steps"),
        ({"loss_type": "sapo"}, "loss_type='sapo': expected one of grpo, bnpo, dr_grpo, dapo, cispo"),
        ({"num_generations": 1}, "num_generations=1: expected an int >= 2"),
        ({"reward": "nowhere:fn"}, "reward function 'nowhere:fn'"),
    ],
)
def test_bad_arguments_are_one_line(tmp_path, prompts, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        if "num_generations" in kwargs:
            GRPOArguments(**kwargs)
        else:
            _trainer(tmp_path, prompts, **kwargs)


def test_a_record_without_a_prompt_names_its_place(prompts):
    _, tok = build_preset("tiny")
    with pytest.raises(ValueError, match=r"train_dataset\[1\]: no prompt"):
        PromptDataset([prompts[0], {"question": "x"}], tok)


def test_lora_samples_through_the_adapter_and_takes_the_base_as_reference(tmp_path, prompts):
    """With a LoRA adapter (peft) the policy samples through it, the reference is the same model with the adapter
    disabled (no copy), only the adapter trains, and the first step's KL is 0 (policy = reference at the start)."""
    pytest.importorskip("peft")
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        max_steps=2,
        learning_rate=0.1,
        optim="sgd",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_peft=True,
        lora_r=4,
    )
    model, tok = build_model("tiny", args)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=distinct_chars,
        args=args,
        grpo=GRPOArguments(num_generations=4, max_completion_length=6, beta=0.04),
        train_dataset=prompts,
        processing_class=tok,
    )
    assert trainer.ref_model is None
    frozen = {k: v.clone() for k, v in trainer.model.state_dict().items() if "lora_" not in k}
    trainer.train()
    logs = trainer.state.log_history
    assert logs[0]["kl"] == 0.0 and logs[1]["kl"] > 0
    after = trainer.model.state_dict()
    assert all(torch.equal(frozen[k], after[k]) for k in frozen)
