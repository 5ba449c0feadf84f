"""bitsandbytes' 8-bit AdamW under transformers' names (--optim adamw_bnb_8bit, adamw_8bit, paged_adamw_8bit; issue 34).

- build_optimizer's optimizer takes the same steps, bit for bit, as the one transformers builds for the same name
  (`transformers.Trainer.get_optimizer_cls_and_kwargs`, then its nn.Embedding override for 32-bit state), and keeps
  8-bit state only for tensors of >= 4096 elements that are not an embedding's weight.
- Through the Trainer, a run stopped at step 2 and resumed from its checkpoint lands on the unbroken run's losses,
  weights and optimizer state bits; the checkpoint's optimizer.pt holds the uint8 state, absmax and qmap tables.
- Without bitsandbytes, one line at argument time (exit 2 from the command line); FSDP2 is refused in one line, and
  the reason is held by a test: bitsandbytes' update on a DTensor parameter fails.
Exact comparisons throughout (torch.equal): the same ops on the same values in the same order.
"""

from __future__ import annotations

import json
import sys
import warnings

import pytest
import torch

from tests.trainer.loop.test_trainer import StopAt, losses, small_model, weights
from tests.trainer.loop.test_trainer import make_args as trainer_args
from trainer import sft
from trainer.config.args import BNB_OPTIMIZERS, ConfigError, TrainingArguments
from trainer.data.sft_data import load_sft_dataset
from trainer.data.tasks import generate_tasks
from trainer.data.tokenizer import byte_level_tokenizer
from trainer.loop.optim import PAGED_ON_CPU, build_optimizer, param_groups
from trainer.loop.trainer import Trainer

bnb = pytest.importorskip("bitsandbytes")
HYPER = dict(learning_rate=2e-3, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6)
PAGED_WARNING = "Paged optimizers are not supported on CPU"


def train_steps(optimizer, model, steps: int = 3) -> None:
    """A few optimizer steps on the model's own loss over fixed random tokens (the same for every caller)."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, 256, (2, 16), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def state_tensors(optimizer, model) -> dict[str, dict]:
    """The optimizer's live state (step, state1/2, and for 8-bit state absmax1/2 and qmap1/2) by parameter name."""
    return {name: dict(optimizer.state[p]) for name, p in model.named_parameters()}


@pytest.mark.parametrize("name", BNB_OPTIMIZERS)
def test_build_optimizer_steps_as_transformers_bitsandbytes_optimizer(name, monkeypatch, tmp_path):
    transformers = pytest.importorskip("transformers")
    model, twin = small_model(), small_model()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=PAGED_WARNING)  # bitsandbytes' paged fallback: quieted on the CPU
        ours = build_optimizer(model, TrainingArguments(optim=name, **HYPER))
        train_steps(ours, model)
    paged = name == "paged_adamw_8bit"
    assert type(ours) is (bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit) and ours.is_paged is paged
    # transformers' optimizer for the name: its class and arguments, over the same groups, and (as its
    # Trainer.create_optimizer does for 8-bit bitsandbytes optimizers) 32-bit state for every nn.Embedding's weight,
    # registered with bitsandbytes' process-wide manager (a fresh one here, dropped after the test)
    monkeypatch.setattr(bnb.optim.GlobalOptimManager, "_instance", None)
    hf_args = transformers.TrainingArguments(output_dir=str(tmp_path), optim=name, report_to=[], **HYPER)
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(hf_args)
    assert kwargs == {"lr": 2e-3, "betas": (0.8, 0.95), "eps": 1e-6, "optim_bits": 8, "is_paged": paged}
    reference = cls(param_groups(twin, HYPER["weight_decay"]), **kwargs)
    manager = bnb.optim.GlobalOptimManager.get_instance()
    for module in twin.modules():
        if isinstance(module, torch.nn.Embedding):
            manager.register_module_override(module, "weight", {"optim_bits": 32})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=PAGED_WARNING)  # transformers' side leaves it on
        train_steps(reference, twin)
    assert [g["weight_decay"] for g in ours.param_groups] == [g["weight_decay"] for g in reference.param_groups]
    for (key, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), key
    theirs = state_tensors(reference, twin)
    for key, state in state_tensors(ours, model).items():
        assert state.keys() == theirs[key].keys(), key
        for k, v in state.items():
            assert torch.equal(v, theirs[key][k]) if isinstance(v, torch.Tensor) else v == theirs[key][k], (key, k)
    # 8-bit state for tensors of >= min_8bit_size (4096) elements; 32-bit for smaller ones and the tied embedding
    dtypes = {key: state["state1"].dtype for key, state in state_tensors(ours, model).items()}
    assert dtypes["model.embed_tokens.weight"] == torch.float32  # 320 x 64, an nn.Embedding
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == torch.uint8  # 64 x 64 = 4096
    assert dtypes["model.layers.0.self_attn.k_proj.weight"] == torch.float32  # 32 x 64 = 2048
    assert dtypes["model.norm.weight"] == torch.float32
    # ours registered its override with a manager of its own: the process-wide one holds transformers' alone
    assert [m for m, _, _ in manager.module_weight_config_triple] == [twin.model.embed_tokens]


@pytest.mark.parametrize("name", ["adamw_bnb_8bit", "paged_adamw_8bit"])
def test_8bit_adamw_trains_and_resumes_exactly(name, tmp_path, capsys):
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate_tasks(24, seed=3)))
    dataset = load_sft_dataset([data], byte_level_tokenizer(), cutoff_len=64, show_progress=False)
    common = dict(max_steps=4, save_strategy="steps", save_steps=2, optim=name)
    model, resumed_model = small_model(), small_model(seed=123)  # the resumed run's weights come from the checkpoint
    full = Trainer(model=model, args=trainer_args(tmp_path / "full", **common), train_dataset=dataset)
    part = Trainer(model=small_model(), args=trainer_args(tmp_path / "part", **common), train_dataset=dataset)
    part.add_callback(StopAt(2))
    resumed = Trainer(model=resumed_model, args=trainer_args(tmp_path / "part", **common), train_dataset=dataset)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=PAGED_WARNING)  # quieted: the Trainer says PAGED_ON_CPU instead
        full.train()
        part.train()
        resumed.train(resume_from_checkpoint=True)
    assert capsys.readouterr().err.count(PAGED_ON_CPU) == (3 if name == "paged_adamw_8bit" else 0)  # one per train()
    assert type(full.optimizer).__name__ == ("PagedAdamW8bit" if name == "paged_adamw_8bit" else "AdamW8bit")
    assert losses(resumed.state) == losses(full.state)
    full_weights = weights(model)
    for key, value in weights(resumed_model).items():
        assert torch.equal(value, full_weights[key]), key
    # the optimizer's state after the last step: the same bits in the resumed run as in the unbroken one
    ours, theirs = state_tensors(full.optimizer, model), state_tensors(resumed.optimizer, resumed_model)
    assert {s["state1"].dtype for s in ours.values()} == {torch.uint8, torch.float32}
    for key, state in ours.items():
        for k, v in state.items():
            assert torch.equal(v, theirs[key][k]) if isinstance(v, torch.Tensor) else v == theirs[key][k], (key, k)
    # the checkpoint's optimizer.pt (torch.load weights_only, as resume reads it): bitsandbytes' state_dict with the
    # quantisation tensors wrapped, uint8 moments, one fp32 absmax per 256-element block, the 256-entry qmaps
    saved = torch.load(tmp_path / "part" / "out" / "checkpoint-2" / "optimizer.pt", weights_only=True)
    quantised = [s["__bnb_optimizer_quant_state__"] for s in saved["state"].values()]
    eight_bit = [q for q in quantised if q["state1"].dtype == torch.uint8]
    assert eight_bit and all(q["state2"].dtype == torch.uint8 and q["qmap1"].shape == (256,) for q in eight_bit)
    assert all(q["absmax1"].numel() == -(-q["state1"].numel() // 256) for q in eight_bit)


@pytest.mark.parametrize("name", BNB_OPTIMIZERS)
def test_without_bitsandbytes_one_line_at_argument_time(name, monkeypatch, capsys, tmp_path):
    built = TrainingArguments(optim=name)  # validated while bitsandbytes was installed
    for module in ("bitsandbytes", "bitsandbytes.optim"):  # what `import` and find_spec see when it is not installed
        monkeypatch.setitem(sys.modules, module, None)
    expected = f"optim={name}: bitsandbytes is not installed (pip install 'kernelwright[qlora]')"
    with pytest.raises(ConfigError) as e:
        TrainingArguments(optim=name)
    assert str(e.value) == expected
    with pytest.raises(ConfigError) as e:  # the builder's own import says the same
        build_optimizer(torch.nn.Linear(2, 2), built)
    assert str(e.value) == expected
    code = sft.main(["--model", "tiny", "--output_dir", str(tmp_path / "o"), "--optim", name, "--max_steps", "1"])
    assert code == 2 and capsys.readouterr().err.strip().splitlines() == [f"error: {expected}"]
    assert not (tmp_path / "o").exists()  # nothing built or written


def test_optim_args_are_refused_as_transformers_passes_none():
    with pytest.raises(
        ConfigError, match="unknown key 'min_8bit_size' for optim='adamw_bnb_8bit'; accepted keys: none"
    ):
        TrainingArguments(optim="adamw_bnb_8bit", optim_args="min_8bit_size=16384")


@pytest.mark.parametrize("fsdp", [{"fsdp": "full_shard"}, {"dist_config": {"name": "fsdp2"}}])
def test_fsdp2_is_refused_in_one_line(fsdp):
    with pytest.raises(ConfigError) as e:
        TrainingArguments(optim="paged_adamw_8bit", **fsdp)
    message = str(e.value)
    assert "\n" not in message and message.startswith("optim=paged_adamw_8bit with dist_config fsdp2 (--fsdp)")


def test_bitsandbytes_cannot_step_fsdp2_parameters(tmp_path):
    """Why FSDP2 is refused: fully_shard's DTensor parameters reach bitsandbytes' update op beside its plain state
    tensors, which DTensor refuses (bitsandbytes 0.50.2, torch 2.13). If this starts to pass, lift the refusal."""
    from torch.distributed.fsdp import fully_shard

    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))  # 8192 weights: 8-bit state
        fully_shard(model)
        optimizer = bnb.optim.AdamW8bit(model.parameters())
        model(torch.randn(4, 64)).sum().backward()
        with pytest.raises(RuntimeError, match="DTensor"):
            optimizer.step()
    finally:
        torch.distributed.destroy_process_group()
