"""LoRA through peft (trainer/model/lora.py): the arguments (TRL's names, LlamaFactory's aliases), training only the
adapter, equality with a LoRA loop written by hand with peft over our model, the settings under peft, the adapter
files in peft's layout and their round trip through peft + transformers, exact resume, merging and generation.
All on CPU with the 2-layer model of test_trainer.py and a few steps (the files' tests: a transformers-written tiny
Llama). Tolerances: runs that do the same fp32 operations in the same order are compared exactly or to 1e-6;
merged weights (W + s B A rounded once) against the unmerged forward to 1e-5.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import peft
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file

from tests.trainer.loop.test_trainer import _env, _sft, dataset, losses, make_args, small_model, tokenizer  # noqa: F401 (fixtures)
from trainer import generate as generate_cli
from trainer import merge
from trainer.build import load_pretrained, load_tokenizer
from trainer.config.args import ConfigError, TrainingArguments, parse_args
from trainer.data.batching import BatchLoader
from trainer.data.tokenizer import byte_level_tokenizer
from trainer.loop.callbacks import TrainerCallback
from trainer.loop.trainer import Trainer
from trainer.model.causal_lm import MLP, RMSNorm, generate
from trainer.model.lora import apply_lora, load_adapter

LORA = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0)


def lora_args(tmp_path, **overrides) -> TrainingArguments:
    return make_args(tmp_path, **{**LORA, **overrides})


def train_curve(trainer: Trainer) -> list[float]:
    trainer.train()
    return losses(trainer.state)


def adapter_state(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


# ---- arguments ------------------------------------------------------------------------------------------------
def test_trl_names_and_llamafactory_aliases_from_flags_and_yaml(tmp_path):
    (args,) = parse_args(
        [
            "--use_peft",
            "--lora_r",
            "8",
            "--lora_alpha",
            "16",
            "--lora_dropout",
            "0.1",
            "--lora_target_modules",
            "q_proj",
            "v_proj",
            "--lora_modules_to_save",
            "norm",
            "--use_rslora",
            "--use_dora",
        ]
    )
    assert (args.use_peft, args.lora_r, args.lora_alpha, args.lora_dropout) == (True, 8, 16, 0.1)
    assert (args.lora_target_modules, args.lora_modules_to_save, args.use_rslora, args.use_dora) == (
        ["q_proj", "v_proj"],
        ["norm"],
        True,
        True,
    )
    config = tmp_path / "run.yaml"
    config.write_text("finetuning_type: lora\nlora_rank: 8\nlora_target: all\nadditional_target: norm\n")
    (args,) = parse_args([str(config)])
    assert (args.use_peft, args.lora_r, args.lora_target_modules, args.lora_modules_to_save) == (
        True,
        8,
        ["all-linear"],
        ["norm"],
    )
    config.write_text("finetuning_type: lora\nlora_target: q_proj,v_proj\n")
    assert parse_args([str(config)])[0].lora_target_modules == ["q_proj", "v_proj"]
    assert parse_args(["--finetuning_type", "full"])[0].use_peft is False
    saved = TrainingArguments(**LORA, lora_target_modules=["all-linear"])
    assert TrainingArguments.from_dict(saved.to_dict()) == saved


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--use_peft", "--lora_r", "0"], "lora_r=0: must be a positive integer"),
        (["--use_peft", "--lora_alpha", "-1"], "lora_alpha=-1: must be > 0"),
        (["--use_peft", "--lora_dropout", "1"], "lora_dropout=1.0: must be in"),
        (["--lora_r", "8"], "lora_r=8 is a LoRA setting, but use_peft is off"),
        (["--finetuning_type", "freeze"], "finetuning_type='freeze': expected one of lora, full"),
        (["--use_peft", "--finetuning_type", "full"], "finetuning_type='full' contradicts use_peft=True"),
    ],
)
def test_bad_lora_arguments_are_one_line_errors(argv, message):
    with pytest.raises(ConfigError, match=message) as info:
        parse_args(argv)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "option, message",
    [
        ({"lora_target_modules": ["qkv_proj"]}, "lora_target_modules: 'qkv_proj' matches no linear layer"),
        ({"lora_target_modules": ["lm_head"]}, "lora_target_modules: 'lm_head' cannot take an adapter"),
        ({"lora_modules_to_save": ["nope"]}, "lora_modules_to_save: 'nope' matches no module"),
    ],
)
def test_targets_that_match_nothing_are_refused_before_training(tmp_path, dataset, option, message):
    trainer = Trainer(model=small_model(), args=lora_args(tmp_path, max_steps=1, **option), train_dataset=dataset)
    with pytest.raises(ConfigError, match=message):
        trainer.train()


def test_the_cli_checks_the_targets_before_building_anything(tmp_path, capsys):
    from trainer import sft

    code = sft.main(
        ["--model", "tiny", "--output_dir", str(tmp_path / "out"), "--use_peft", "--lora_target_modules", "q_projj"]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "lora_target_modules: 'q_projj' matches no linear layer" in err
    assert "Training arguments" not in err and not (tmp_path / "out").exists()


# ---- training -------------------------------------------------------------------------------------------------
def test_a_lora_run_learns_and_trains_only_the_adapter(tmp_path, dataset, capsys):
    model = small_model()
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(
        model=model, args=lora_args(tmp_path, max_steps=8, lora_target_modules=["all-linear"]), train_dataset=dataset
    )
    curve = train_curve(trainer)
    assert curve[-1] < curve[0] - 0.1  # 5.66 -> 5.2 here
    for name, param in model.named_parameters():
        if "lora_" in name:
            assert param.requires_grad
        else:
            assert not param.requires_grad
            torch.testing.assert_close(param, base[name.replace(".base_layer", "")], rtol=0, atol=0)
    in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for n, p in model.named_parameters() if "lora_" in n}
    assert len(trainer.optimizer.state) == len(in_optimizer)  # Adam moments for the adapter only
    adapter = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    total = sum(p.numel() for p in model.parameters())
    assert (
        f"trainable params: {adapter:,d} || all params: {total:,d} || trainable%: {100 * adapter / total:.4f}"
        in capsys.readouterr().err
    )


def test_three_lora_steps_equal_a_loop_written_by_hand_with_peft(tmp_path, dataset):
    args = lora_args(tmp_path, max_steps=3, train_shuffle=False, lora_target_modules=["q_proj", "v_proj"])
    ours = small_model()
    trainer = Trainer(model=ours, args=args, train_dataset=dataset)
    start = adapter_state(apply_lora(small_model(), args))  # the adapter our run starts from (seeded)
    curve = train_curve(trainer)

    model = small_model()
    peft.inject_adapter_in_model(
        peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]), model
    )
    model.load_state_dict(start, strict=False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / 3)  # linear, no warmup
    loader = BatchLoader(dataset, micro_batch_size=4, shuffle=False, seed=7)
    loader.set_epoch(0)
    by_hand = []
    for _, batch in zip(range(3), loader):
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "labels", "attention_mask", "position_ids")}
        loss = model(**inputs, num_items=max(int(batch["num_items"]), 1)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        by_hand.append(loss.item())
    assert curve == pytest.approx(by_hand, rel=1e-6, abs=1e-6)
    for name, value in adapter_state(model).items():
        torch.testing.assert_close(dict(ours.named_parameters())[name], value, rtol=1e-5, atol=1e-6)


def _first_loss(tmp_path, dataset, **settings) -> float:
    trainer = Trainer(model=small_model(), args=make_args(tmp_path, max_steps=1, **settings), train_dataset=dataset)
    return train_curve(trainer)[0]


@pytest.mark.parametrize("setting", [{"label_smoothing_factor": 0.1}, {"neftune_noise_alpha": 5.0}, {"z_loss": 1e-2}])
def test_label_smoothing_neftune_and_z_loss_change_the_lora_loss_as_without(tmp_path, dataset, setting):
    # B starts at zero, so the first step's loss is the base model's: with LoRA exactly as without, setting or not.
    plain = _first_loss(tmp_path, dataset, **LORA)
    with_setting = _first_loss(tmp_path, dataset, **LORA, **setting)
    assert abs(with_setting - plain) > 1e-4
    assert with_setting == pytest.approx(_first_loss(tmp_path, dataset, **setting), rel=1e-6)


@pytest.mark.parametrize("task_type", [None, "CAUSAL_LM"])
def test_settings_reach_our_model_inside_a_peft_model(tmp_path, dataset, task_type):
    # Issue 14: written onto the PeftModel, label smoothing, z-loss and use_kernels=False would be lost; our
    # CausalLM inside it gets them. task_type="CAUSAL_LM" (PeftModelForCausalLM) used to fail on construction.
    def eval_loss(model, **settings):
        args = make_args(tmp_path, per_device_eval_batch_size=8, **settings)
        return Trainer(model=model, args=args, eval_dataset=dataset).evaluate()["eval_loss"]

    config = dict(r=4, target_modules=["q_proj"], task_type=task_type)
    settings = dict(label_smoothing_factor=0.1, z_loss=1e-2, use_kernels=False)
    wrapped = peft.get_peft_model(small_model(), peft.LoraConfig(**config))
    assert eval_loss(wrapped, **settings) == pytest.approx(eval_loss(small_model(), **settings), abs=1e-6)
    assert abs(eval_loss(small_model(), **settings) - eval_loss(small_model())) > 1e-3
    ours = wrapped.base_model.model
    assert (ours.label_smoothing, ours.z_loss, ours.use_kernels) == (0.1, 1e-2, False)


@pytest.mark.parametrize(
    "variant", [{"gradient_checkpointing": True}, {"use_kernels": False}, {"batching_strategy": "padding_free"}]
)
def test_checkpointing_kernels_and_batching_train_lora_as_the_default(tmp_path, dataset, variant):
    def run(**extra):
        args = lora_args(tmp_path, max_steps=3, train_shuffle=False, **extra)
        return train_curve(Trainer(model=small_model(), args=args, train_dataset=dataset))

    assert run(**variant) == pytest.approx(run(), rel=1e-5)


def test_liger_kernel_runs_every_op_under_lora(tmp_path, dataset):
    # liger's ops act on activations (RMSNorm, SwiGLU of gate_proj/up_proj outputs) and on lm_head.weight, which is
    # never adapted: LoRA's layers stay in the path. Its Triton kernels need CUDA, so only the wiring is checked here.
    pytest.importorskip("liger_kernel")
    model = small_model()
    trainer = Trainer(
        model=model, args=lora_args(tmp_path, use_liger_kernel=True, lora_modules_to_save=["post_attention_layernorm"])
    )
    apply_lora(model, trainer.args)
    assert model.impl == "liger"
    switched = [m for m in model.modules() if isinstance(m, (RMSNorm, MLP))]
    assert len(switched) == 9 and all(m.impl == "liger" for m in switched)  # 2 MLPs, 5 norms, 2 copies to save


# ---- adapter files --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A transformers-written tiny Llama (untied head, vocab 320) with the byte-level tokenizer's files."""
    config = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=256,
        eos_token_id=258,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    byte_level_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def trained_adapter(hf_dir, dataset, tokenizer, tmp_path_factory):
    """(our trained model, its output_dir): 3 LoRA steps on every linear layer and the final norm as a module to
    save, saved by Trainer.save_model, with a checkpoint at step 2."""
    out = tmp_path_factory.mktemp("lora-run")
    model = load_pretrained(hf_dir)
    model.name_or_path = str(hf_dir)
    args = lora_args(
        out,
        output_dir=str(out),
        max_steps=3,
        learning_rate=5e-2,
        save_strategy="steps",
        save_steps=2,
        lora_target_modules=["all-linear"],
        lora_modules_to_save=["norm"],
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    trainer.save_model()
    return model.eval(), out


def _ids():
    return torch.tensor([[5, 17, 99, 3, 250, 42, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8]])


def test_the_adapter_is_saved_in_peft_layout_and_loads_in_peft_and_transformers(hf_dir, trained_adapter, tmp_path):
    ours, out = trained_adapter
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert not (out / "model.safetensors").exists() and not (out / "config.json").exists()
    saved = json.loads((out / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(hf_dir)
    assert (saved["peft_type"], saved["task_type"], saved["r"], saved["lora_alpha"]) == ("LORA", "CAUSAL_LM", 4, 8)
    assert saved["modules_to_save"] == ["norm"] and "lm_head" not in saved["target_modules"]

    # peft's own save of the same adapter over transformers' model: the same keys and config fields
    reference = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(hf_dir), peft.LoraConfig.from_pretrained(str(out))
    )
    reference.save_pretrained(tmp_path / "ref")

    def keys(directory):
        with safe_open(str(directory / "adapter_model.safetensors"), framework="pt") as f:
            return set(f.keys())

    assert keys(out) == keys(tmp_path / "ref")
    assert set(json.loads((tmp_path / "ref" / "adapter_config.json").read_text())) == set(saved)

    theirs = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(hf_dir), str(out)).eval()
    with torch.no_grad():
        expected = ours(_ids()).logits
        base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()(_ids()).logits
        torch.testing.assert_close(theirs(input_ids=_ids()).logits, expected, rtol=1e-5, atol=1e-5)
    assert (expected - base).abs().max() > 1e-2  # the adapter changed the model


def test_the_adapter_loads_back_into_our_model(hf_dir, trained_adapter):
    ours, out = trained_adapter
    again = load_adapter(load_pretrained(hf_dir), out).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(_ids()).logits, ours(_ids()).logits, rtol=0, atol=0)


def test_a_lora_checkpoint_holds_the_adapter_and_the_training_state(trained_adapter):
    _, out = trained_adapter
    names = {p.name for p in (out / "checkpoint-2").iterdir()}
    assert {
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.pt",
        "scheduler.pt",
        "rng_state.pth",
        "data_state.json",
        "trainer_state.json",
        "training_args.json",
    } <= names
    assert "model.safetensors" not in names


# ---- resume ---------------------------------------------------------------------------------------------------
def test_a_lora_resume_is_bitwise_the_unbroken_run(tmp_path, dataset):
    # LoRA dropout and NEFTune draw random numbers every step: the checkpoint's RNG state must carry them on.
    common = dict(
        LORA,
        lora_dropout=0.1,
        neftune_noise_alpha=5.0,
        max_steps=6,
        save_strategy="steps",
        save_steps=3,
        gradient_accumulation_steps=2,
        optim="adamw_fused",
    )
    model = small_model()
    full = Trainer(model=model, args=make_args(tmp_path / "full", **common), train_dataset=dataset)
    full_curve, full_adapter = train_curve(full), adapter_state(model)

    class StopAt3(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            control.should_training_stop = state.global_step == 3

    Trainer(
        model=small_model(), args=make_args(tmp_path / "part", **common), train_dataset=dataset, callbacks=[StopAt3()]
    ).train()
    model = small_model()
    resumed = Trainer(
        model=model, args=make_args(tmp_path / "part", **common, resume_from_checkpoint="auto"), train_dataset=dataset
    )
    assert train_curve(resumed) == full_curve  # steps 1-3 from the checkpoint's log history, 4-6 trained again
    for name, value in adapter_state(model).items():
        assert torch.equal(value, full_adapter[name]), name


@pytest.mark.slow  # three CLI processes: ~70 s on 2 shared cores, mostly start-up
def test_sigkill_then_resume_of_a_lora_run_gives_the_same_adapter(tmp_path):
    lora = ("--use_peft", "--lora_r", "4", "--lora_target_modules", "all-linear", "--learning_rate", "1e-2")
    full = tmp_path / "full"
    subprocess.run(_sft(full, *lora), check=True, env=_env(), cwd=tmp_path, capture_output=True, timeout=300)
    part = tmp_path / "part"
    proc = subprocess.Popen(
        _sft(part, *lora), env=_env(), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 240
    while (
        not (part / "checkpoint-2" / "trainer_state.json").exists()
        and time.monotonic() < deadline
        and proc.poll() is None
    ):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = subprocess.run(
        _sft(part, *lora, "--resume_from_checkpoint", "auto"),
        env=_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (
        "LoRA adapter saved to" in done.stderr + done.stdout and "python -m trainer.merge" in done.stderr + done.stdout
    )
    a, b = load_file(str(full / "adapter_model.safetensors")), load_file(str(part / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((part / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny"


# ---- merge and generate ---------------------------------------------------------------------------------------
def test_merge_writes_a_plain_model_transformers_loads_with_the_adapters_logits(hf_dir, trained_adapter, tmp_path):
    ours, out = trained_adapter
    assert merge.main(["--model", str(hf_dir), "--adapter", str(out), "--output_dir", str(tmp_path / "m")]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "m").iterdir()}
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert not any("lora" in n or "base_layer" in n for n, _ in plain.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=_ids()).logits, ours(_ids()).logits, rtol=1e-5, atol=1e-5)


def test_merge_refuses_a_directory_without_an_adapter(hf_dir, tmp_path, capsys):
    assert merge.main(["--model", str(hf_dir), "--adapter", str(hf_dir), "--output_dir", str(tmp_path / "m")]) == 2
    assert "adapter_config.json not found" in capsys.readouterr().err


def test_a_truncated_adapter_is_one_line_naming_the_file(hf_dir, trained_adapter, tmp_path, capsys):
    """Issue 21 item 7 for adapters: a cut-short adapter_model.safetensors was safetensors' traceback."""
    _, out = trained_adapter
    cut = tmp_path / "cut"
    cut.mkdir()
    for f in out.iterdir():
        if f.is_file():
            data = f.read_bytes()
            (cut / f.name).write_bytes(data[:500] if f.name == "adapter_model.safetensors" else data)
    assert generate_cli.main(["--model", str(hf_dir), "--adapter", str(cut), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"error: adapter: {cut / 'adapter_model.safetensors'}: not a complete safetensors file"
    ), err


def test_generate_with_an_adapter_answers_as_the_trained_model(hf_dir, trained_adapter, capsys):
    ours, out = trained_adapter
    assert (
        generate_cli.main(
            ["--model", str(hf_dir), "--adapter", str(out), "--prompt", "hi", "--raw", "--max_new_tokens", "6"]
        )
        == 0
    )
    tokenizer = load_tokenizer(out)
    expected = generate(ours, tokenizer.encode("hi"), 6, eos_token_id=tokenizer.eos_token_id)
    assert capsys.readouterr().out == tokenizer.decode(expected) + "\n"
