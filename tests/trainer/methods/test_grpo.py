"""GRPOTrainer (trainer/methods/grpo.py, issue 31 items 1, 3, 5): a step's completions, rewards and update on the tiny
model; the update independent of the split into micro batches (exact accumulation), a resumed run equal to an
unbroken one, TRL's logged names, completions.jsonl, evaluation, and the one-line refusals."""

import json

import pytest
import torch

from trainer.build import build_model, build_preset
from trainer.checkpoint_hf import CheckpointError
from trainer.config.args import ConfigError, TrainingArguments
from trainer.data.task_eval import held_out_conversations
from trainer.data.tasks import TRAIN_FILE
from trainer.loop.checkpoint import METHOD_STATE
from trainer.methods.grpo import GRPOArguments, GRPOTrainer, PromptDataset, prompts_from_conversations
from trainer.methods.grpo_rewards import RewardError

datasets = pytest.importorskip("datasets")  # an optional extra (kernelwright[datasets])


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
        {"loss_type": "dapo", "num_iterations": 2, "steps": 3},
        {"loss_type": "bnpo", "generation_batch_size": 16, "steps": 3},
        {"loss_type": "dapo", "steps_per_generation_x": 2, "num_iterations": 2, "beta": 0.04, "steps": 4},
        {"loss_type": "grpo", "steps_per_generation_x": 2, "importance_sampling_level": "sequence", "steps": 3},
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_the_update_does_not_depend_on_the_micro_batch_split(tmp_path, prompts, options):
    """8 completions x 1 micro step and 4 x 2 (and 2 x 4): the same completions, and the same weights after two
    steps to fp32 noise, for each normalisation (bnpo divides by the window's tokens here, TRL by each micro
    batch's), with the KL term against the reference, and with a generation batch reused (num_iterations 2) or
    shared by two optimizer steps (steps_per_generation 2 x gradient_accumulation_steps, or generation_batch_size 16
    = 8 x 2): the rows each step takes do not depend on the split either."""
    options = dict(options)
    factor = options.pop("steps_per_generation_x", None)
    runs = []
    for micro, accum in ((8, 1), (4, 2), (2, 4)):
        more = {"steps_per_generation": factor * accum} if factor else {}
        trainer = _trainer(tmp_path / f"{micro}x{accum}", prompts, micro=micro, accum=accum, **options, **more)
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


def test_num_iterations_reuses_the_generation_and_its_ratios_clip(tmp_path, prompts):
    """num_iterations 2: step 1 samples and scores (the reward is logged once, at the generation, as TRL's), step 2
    trains on the same completions again, against the old policy's log-probs taken at generation: those equal the
    starting model's (an independent log_softmax of its logits), step 1 updates as num_iterations 1 does (ratio 1),
    and step 2's ratios have moved, some out of the clip range."""
    start = _trainer(tmp_path / "start", prompts).model  # the same seed: the starting weights
    once = _trainer(tmp_path / "once", prompts, steps=1)
    once.train()
    twice = _trainer(tmp_path / "twice", prompts, steps=1, num_iterations=2)
    twice.train()
    a, b = _weights(once), _weights(twice)
    for name in a:  # step 1: the importance ratio is exp(0) and its gradient is the num_iterations 1 one
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
    gen = twice._generation
    for r in range(gen.order.shape[0]):
        prompt = twice.train_dataset.prompt_ids[int(gen.prompt_index[r])]
        T = int(gen.completion_mask[r].sum())
        ids = torch.tensor([prompt + gen.completion_ids[r, :T].tolist()])
        with torch.no_grad():
            logits = start(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0]
        torch.testing.assert_close(gen.old_logps[r, :T], expected, rtol=0, atol=2e-5)
    full = _trainer(tmp_path / "full", prompts, steps=2, num_iterations=2, log_completions=True)
    full.train()
    first, second = full.state.log_history[:2]
    assert "reward" in first and "reward" not in second and "completions/mean_length" not in second
    assert first["clip_ratio/region_mean"] == 0.0 and second["clip_ratio/region_mean"] > 0
    rows = [json.loads(line) for line in (tmp_path / "full" / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and {r["step"] for r in rows} == {1}  # one generation for both steps


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


class _StopAt:
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


@pytest.mark.parametrize(
    "stop, options",
    [
        (2, {}),
        (1, {"num_iterations": 2}),
        (1, {"steps_per_generation": 2}),
        (3, {"steps_per_generation": 2, "num_iterations": 2, "beta": 0.04}),
    ],
    ids=["one-step-generations", "mid-iterations", "mid-generation", "second-pass"],
)
def test_a_resumed_run_ends_as_the_unbroken_one(tmp_path, prompts, stop, options):
    """Completions are keyed by (seed, step, completion index): a run resumed from its checkpoint samples what the
    unbroken run sampled and ends with the same weights, bit for bit. A checkpoint inside a generation cycle (after
    the first of num_iterations passes, or the first of the steps that share a generation batch) holds the buffered
    generation (method_state.pt: completions, advantages, the old policy's and the reference's log-probs), and the
    resumed run trains on it; one at the end of a cycle holds none."""
    unbroken = _trainer(tmp_path / "a", prompts, steps=4, **options)
    unbroken.train()
    first = _trainer(tmp_path / "b", prompts, steps=4, **options)
    first.args.save_strategy, first.args.save_steps, first.args.save_total_limit = "steps", 1, None
    first.add_callback(_StopAt(stop))
    first.train()
    checkpoint = tmp_path / "b" / f"checkpoint-{stop}"
    cycle = options.get("steps_per_generation", 1) * options.get("num_iterations", 1)
    assert (checkpoint / METHOD_STATE).is_file() == (stop % cycle != 0)
    resumed = _trainer(tmp_path / "b", prompts, steps=4, **options)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    a, b = _weights(unbroken), _weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    after = [
        [log.get("clip_ratio/region_mean") for log in t.state.log_history if log["step"] > stop and "loss" in log]
        for t in (unbroken, resumed)
    ]
    assert after[0] == after[1] and len(after[0]) == 4 - stop


def test_a_resume_with_another_generation_cycle_is_one_line(tmp_path, prompts):
    """The loader's place inside a generation cycle is counted in micro steps of steps_per_generation x
    num_iterations: a checkpoint resumed under another cycle is refused in one line naming both."""
    first = _trainer(tmp_path, prompts, steps=4, num_iterations=2)
    first.args.save_strategy, first.args.save_steps = "steps", 1
    first.add_callback(_StopAt(1))
    first.train()
    other = _trainer(tmp_path, prompts, steps=4)
    with pytest.raises(CheckpointError, match="a generation batch was 2 micro steps .* is 1; resume with the GRPO"):
        other.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))


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


def test_evaluation_reports_trls_metrics_and_leaves_training_as_it_is(tmp_path, prompts):
    """An eval_dataset evaluated at every step (TRL's eval_ metrics in the log) and before and after training: the
    weights end bit for bit as those of the run without evaluation (its draws are keyed apart from training's), the
    KL to the reference is 0 before the first update and not after, and an evaluation repeated at the same step
    samples the same completions."""
    plain = _trainer(tmp_path / "plain", prompts, beta=0.04)
    plain.train()
    evaluated = _trainer(tmp_path / "evaluated", prompts, beta=0.04)
    evaluated.eval_dataset = evaluated._prompt_dataset(prompts[8:12], "eval_dataset")
    evaluated.args.eval_strategy, evaluated.args.eval_steps = "steps", 1
    before = evaluated.evaluate()
    assert before["eval_kl"] == 0.0 and before == {**evaluated.evaluate(), **_timing(before)}
    evaluated.train()
    after = _weights(evaluated)
    assert all(torch.equal(after[k], v) for k, v in _weights(plain).items())
    logs = [row for row in evaluated.state.log_history if "eval_loss" in row]
    assert [row["step"] for row in logs] == [1, 2]
    for name in (
        "eval_loss",
        "eval_reward",
        "eval_reward_std",
        "eval_frac_reward_zero_std",
        "eval_rewards/distinct_chars/mean",
        "eval_completions/mean_length",
        "eval_completions/clipped_ratio",
        "eval_kl",
        "eval_entropy",
        "eval_clip_ratio/region_mean",
        "eval_runtime",
        "eval_samples_per_second",
    ):
        assert name in logs[0], name
    assert logs[-1]["eval_kl"] > 0 and logs[-1]["eval_clip_ratio/region_mean"] == 0.0  # its own old policy: ratio 1
    assert not any(k.startswith("eval_") for row in evaluated.state.log_history if "loss" in row for k in row)


def _timing(metrics: dict) -> dict:
    return {k: metrics[k] for k in ("eval_runtime", "eval_samples_per_second")}


def test_eval_completions_do_not_depend_on_the_eval_batch(tmp_path, prompts):
    """The eval draws are keyed by each completion's index in the eval set: batches of 8 completions and of 4 sample
    the same completions (the same mean reward and length over equal batches); a dict of eval sets is evaluated
    split by split (a streamed one read whole first), and a record without a prompt names its place."""
    trainer = _trainer(tmp_path, prompts)
    eval_set = prompts[8:12]
    trainer.args.per_device_eval_batch_size = 8
    eight = trainer.evaluate(eval_set)
    trainer.args.per_device_eval_batch_size = 4
    four = trainer.evaluate({"add": eval_set})
    for name in ("reward", "rewards/distinct_chars/mean", "completions/mean_length", "completions/clipped_ratio"):
        assert four[f"eval_add_{name}"] == pytest.approx(eight[f"eval_{name}"], abs=1e-12), name
    streamed = trainer.evaluate({"add": datasets.Dataset.from_list(eval_set).to_iterable_dataset()})  # read whole
    assert {k: v for k, v in streamed.items() if "runtime" not in k and "per_second" not in k} == {
        k: v for k, v in four.items() if "runtime" not in k and "per_second" not in k
    }
    with pytest.raises(ValueError, match=r"eval_dataset\[1\]: no prompt"):
        trainer.evaluate([prompts[0], {"question": "x"}])
    trainer.args.per_device_eval_batch_size = 6
    with pytest.raises(ConfigError, match="per_device_eval_batch_size=6: must be a multiple of num_generations_eval=4"):
        trainer.evaluate(eval_set)


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
        ({"micro": 6}, "num_generations=4: must divide the completions of a generation batch on each process"),
        (
            {"micro": 2, "generation_batch_size": 6},
            "num_generations=4: must divide the completions of a generation batch on each process, "
            "per_device_train_batch_size x steps_per_generation = 2 x 3 = 6",
        ),
        (
            {"micro": 4, "accum": 2, "steps_per_generation": 3},
            r"steps_per_generation=3: must be a multiple of gradient_accumulation_steps \(2\)",
        ),
        (
            {"generation_batch_size": 12},
            r"generation_batch_size=12: must be a multiple of per_device_train_batch_size x processes = 8 x 1 = 8",
        ),
        ({"loss_type": "sapo"}, "loss_type='sapo': expected one of grpo, bnpo, dr_grpo, dapo, cispo"),
        ({"reward": "nowhere:fn"}, "reward function 'nowhere:fn'"),
    ],
)
def test_bad_arguments_are_one_line(tmp_path, prompts, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        _trainer(tmp_path, prompts, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_generations": 1}, "num_generations=1: expected an int >= 2"),
        ({"num_iterations": 0}, "num_iterations=0: expected an int >= 1"),
        ({"num_generations_eval": 0}, "num_generations_eval=0: expected an int >= 1"),
        ({"steps_per_generation": 0}, "steps_per_generation=0: expected an int >= 1"),
        (
            {"steps_per_generation": 2, "generation_batch_size": 16},
            "steps_per_generation=2 and generation_batch_size=16: set one of them",
        ),
    ],
)
def test_bad_grpo_arguments_are_one_line(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        GRPOArguments(**kwargs)


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
