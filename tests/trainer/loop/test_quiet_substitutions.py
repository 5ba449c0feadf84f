"""Issue 21, items 11, 12 and 14: what a run used to substitute or accept without a word.

- a model directory without a chat template: ChatML is said, used and saved with the model (item 11);
- a resume with arguments that differ from the checkpoint's: one line each with the value that applies, refused
  before the build when the saved state cannot follow, and the files record what ran (item 12);
- cutoff_len beyond the model's max_position_embeddings: a warning line; beyond what RoPE represents: exit 2
  (item 14; the attention memory part is tests/trainer/model/test_attention.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer import cli_args, sft
from trainer import generate as generate_cli
from trainer.build import build_preset, load_tokenizer, save_pretrained
from trainer.config.args import parse_args
from trainer.data.tokenizer import DEFAULT_CHAT_TEMPLATE
from trainer.methods.preference import PreferenceArguments

ROOT = Path(__file__).resolve().parents[3]
QUICK = [
    "--per_device_train_batch_size",
    "4",
    "--logging_steps",
    "1",
    "--disable_tqdm",
    "true",
    "--eval_strategy",
    "no",
    "--eval_exact_match",
    "false",
    "--plot",
    "false",
    "--save_strategy",
    "steps",
    "--save_total_limit",
    "5",
]
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "reverse: abc"},
    {"role": "assistant", "content": "cba"},
]


def _cli(argv, timeout=150) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KERNELS_BACKEND")}
    return subprocess.run(
        [sys.executable, "-m", "trainer.sft", *argv],
        cwd=ROOT,
        text=True,
        capture_output=True,
        env={**env, "OMP_NUM_THREADS": "1"},
        timeout=timeout,
    )


def _chat_data(path: Path, n: int = 16) -> Path:
    path.write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": f"reverse: w{i}"}, {"role": "assistant", "content": f"{i}w"}]}
            )
            + "\n"
            for i in range(n)
        )
    )
    return path


# ---- item 11: no chat template -------------------------------------------------------------------------------
@pytest.fixture
def model_without_template(tmp_path):
    model, tokenizer = build_preset("tiny")
    tokenizer.chat_template = None
    save_pretrained(model, tmp_path / "base", tokenizer=tokenizer)
    assert "chat_template" not in json.loads((tmp_path / "base" / "tokenizer_config.json").read_text())
    assert not (tmp_path / "base" / "chat_template.jinja").exists()
    return tmp_path / "base"


def test_chatml_in_place_of_a_missing_template_is_said_and_saved(model_without_template, tmp_path, caplog, monkeypatch):
    out = tmp_path / "out"
    argv = [
        "--model",
        str(model_without_template),
        "--data",
        str(_chat_data(tmp_path / "chat.jsonl")),
        "--output_dir",
        str(out),
        "--max_steps",
        "1",
        *QUICK,
    ]
    assert sft.main(argv) == 0
    said = [r.getMessage() for r in caplog.records if "has no chat template" in r.getMessage()]  # data.py's logger
    assert len(said) == 1 and str(model_without_template) in said[0] and "ChatML" in said[0], said
    assert (out / "chat_template.jinja").read_text() == DEFAULT_CHAT_TEMPLATE
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == DEFAULT_CHAT_TEMPLATE
    ours = load_tokenizer(out)
    assert ours.chat_template == DEFAULT_CHAT_TEMPLATE

    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(out)
    for messages, prompt in ((MESSAGES, False), (MESSAGES[:2], True)):
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        assert text == ours.apply_chat_template(messages, add_generation_prompt=prompt)
    # python -m trainer.generate feeds the model the prompt transformers renders
    fed = []

    def record(model, prompt, *args, **kwargs):
        fed.append(prompt[0].tolist())
        return prompt

    monkeypatch.setattr(generate_cli, "generate", record)
    assert generate_cli.main(["--model", str(out), "--system", "be brief", "--prompt", "reverse: abc"]) == 0
    expected = hf.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True)
    assert fed == [ours.encode(expected)]


def test_plain_text_training_adds_no_template(model_without_template, tmp_path, caplog):
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(8)))
    out = tmp_path / "out"
    argv = [
        "--model",
        str(model_without_template),
        "--data",
        str(data),
        "--output_dir",
        str(out),
        "--max_steps",
        "1",
        *QUICK,
    ]
    assert sft.main(argv) == 0
    assert "chat template" not in caplog.text
    assert load_tokenizer(out).chat_template is None and not (out / "chat_template.jinja").exists()


# ---- item 12: a resume with changed arguments -----------------------------------------------------------------
@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A run of 2 steps with its checkpoint-2 (learning_rate 1e-3, weight_decay 0.01, seed 42). PyTorch's ops, not
    the Triton kernels: under the tests' interpreter the run's final evaluation alone took 115 s of the suite, and
    what these tests check (which resumed value applies) is the loop's, not the kernels'."""
    out = tmp_path_factory.mktemp("resume") / "out"
    argv = [
        "--use_kernels",
        "false",
        "--output_dir",
        str(out),
        "--max_steps",
        "2",
        "--save_steps",
        "2",
        "--learning_rate",
        "1e-3",
        "--weight_decay",
        "0.01",
        "--lr_scheduler_type",
        "linear",
        "--warmup_steps",
        "0",
        *QUICK,
    ]
    assert sft.main(argv) == 0
    return out, argv


def test_a_resume_says_which_value_applies_and_records_it(stopped_run, tmp_path, capsys):
    out, argv = stopped_run
    capsys.readouterr()
    assert (
        sft.main(
            [
                *argv,
                "--resume_from_checkpoint",
                "auto",
                "--max_steps",
                "4",
                "--learning_rate",
                "5e-2",
                "--weight_decay",
                "0.2",
                "--max_grad_norm",
                "0.5",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("resume_from_checkpoint: ")]
    by_name = {line.split()[1]: line for line in lines}
    assert set(by_name) == {"learning_rate", "weight_decay", "max_steps", "max_grad_norm"}, lines
    assert "0.001 applies" in by_name["learning_rate"] and "0.01 applies" in by_name["weight_decay"]
    assert "max_steps 4 applies" in by_name["max_steps"] and "max_grad_norm 0.5 applies" in by_name["max_grad_norm"]
    # what the files say is what ran: the checkpoint's rate and decay, the new max_steps and clipping
    for recorded in (
        json.loads((out / "sft_args.json").read_text()),
        json.loads((out / "training_args.json").read_text()),
        json.loads((out / "checkpoint-4" / "training_args.json").read_text()),
    ):
        assert (recorded["learning_rate"], recorded["weight_decay"]) == (1e-3, 0.01)
        assert (recorded["max_steps"], recorded["max_grad_norm"]) == (4, 0.5)
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [row["learning_rate"] for row in logged if "learning_rate" in row]
    assert rates and max(rates) <= 1e-3  # the schedule's base rate stayed the checkpoint's


FIRST = dict(learning_rate=1e-3, weight_decay=0.01, adam_beta2=0.999, max_steps=2)
CHANGED = dict(learning_rate=5e-2, weight_decay=0.2, adam_beta2=0.9, max_steps=4, warmup_steps=1)


def _applied(trainer) -> dict:
    """The values a resumed trainer runs with, under the arguments' names."""
    groups = trainer.optimizer.param_groups
    return {
        "learning_rate": trainer.lr_scheduler.base_lrs[0],
        "weight_decay": max(g["weight_decay"] for g in groups),
        "adam_beta2": groups[0]["betas"][1],
        "max_steps": trainer.state.max_steps,
    }


def test_which_value_applies_is_what_transformers_trainer_applies(tmp_path):
    """The reference: transformers' Trainer resumed with the same changes. Both run with the checkpoint's learning
    rate, decay and betas; ours says so and its args (training_args.json) hold them, transformers' hold the new ones."""
    import torch

    transformers = pytest.importorskip("transformers")
    from trainer.config.args import TrainingArguments
    from trainer.data.sft_data import TokenizedDataset
    from trainer.loop.trainer import Trainer
    from trainer.model.causal_lm import CausalLM, ModelConfig

    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 64, (16,), generator=gen) for _ in range(32)]
    common = dict(
        per_device_train_batch_size=4,
        save_steps=2,
        save_strategy="steps",
        logging_steps=1,
        lr_scheduler_type="linear",
        report_to=[],
        disable_tqdm=True,
    )

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return {"input_ids": rows[i], "labels": rows[i]}

    def hf_trainer(**kw):
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
        )
        args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True, **common, **kw)
        return transformers.Trainer(model=transformers.LlamaForCausalLM(config), args=args, train_dataset=Rows())

    def our_trainer(**kw):
        model = CausalLM(
            ModelConfig(
                vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
            ),
            use_kernels=False,
        )
        args = TrainingArguments(output_dir=str(tmp_path / "ours"), optim="adamw_torch", **common, **kw)
        data = TokenizedDataset.from_examples([(r.numpy(), r.numpy()) for r in rows])
        return Trainer(model=model, args=args, train_dataset=data)

    applied = {}
    for name, make in (("transformers", hf_trainer), ("ours", our_trainer)):
        make(**FIRST).train()
        resumed = make(**CHANGED)
        resumed.train(
            resume_from_checkpoint=str(tmp_path / ("hf" if name == "transformers" else "ours") / "checkpoint-2")
        )
        applied[name] = _applied(resumed)
        if name == "ours":
            recorded = {k: getattr(resumed.args, k) for k in applied[name]}
    assert applied["ours"] == applied["transformers"] == {**FIRST, "max_steps": CHANGED["max_steps"]}
    assert recorded == applied["ours"]  # transformers' args would say learning_rate=0.05: not what ran


@pytest.mark.slow  # minutes on a 2-core CPU
def test_a_resume_the_saved_state_cannot_follow_stops_first_in_one_line(stopped_run):
    out, argv = stopped_run
    before = sorted(p.name for p in out.rglob("*"))
    for change, name in (
        (["--seed", "7"], "seed"),
        (["--per_device_train_batch_size", "2"], "per_device_train_batch_size"),
        (["--optim", "sgd"], "optim"),
        (["--use_peft"], "use_peft"),
    ):
        run = _cli([*argv, "--resume_from_checkpoint", str(out / "checkpoint-2"), *change])
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), run.stderr[-2000:]
        assert f"{name} is" in lines[0] and "a resume cannot change it" in lines[0], lines[0]
    assert sorted(p.name for p in out.rglob("*")) == before


def test_changed_data_is_one_line_not_a_traceback(stopped_run, tmp_path, capsys):
    out, argv = stopped_run
    data = _chat_data(tmp_path / "other.jsonl", n=40)
    assert sft.main([*argv, "--data", str(data), "--resume_from_checkpoint", str(out / "checkpoint-2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: resume_from_checkpoint: ") and "num_examples" in err[-1], err[-3:]
    assert "Traceback" not in "\n".join(err)


# ---- item 14: cutoff_len against the model's context ---------------------------------------------------------
def test_cutoff_len_beyond_the_model_context_is_a_warning(tmp_path, capsys):
    for cutoff, warned in ((2048, False), (110_000, True)):
        args, extra, pref = parse_args(
            ["--output_dir", str(tmp_path / "o"), "--cutoff_len", str(cutoff)],
            extra_dataclasses=(cli_args.SFTArguments, PreferenceArguments),
        )
        cli_args.check_run(args, extra, pref)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == int(warned), err
    assert err[0].startswith("warning: cutoff_len 110,000 exceeds max_position_embeddings 2,048 of preset 'tiny'")
    assert not (tmp_path / "o").exists()


def test_cutoff_len_past_what_rope_represents_stops_in_one_line(tmp_path):
    run = _cli(["--output_dir", str(tmp_path / "o"), "--cutoff_len", str(2**24 + 1)])
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr[-2000:]
    assert lines[0].startswith("error: cutoff_len 16,777,217 exceeds 16,777,216 positions: RoPE") and "fp32" in lines[0]
    assert not (tmp_path / "o").exists()
