"""The fused LoRA path (kernels/lora.py through trainer/model/fused_lora.py) against peft's layers in our model.

The same model, adapter, batch and random seed run twice, `model.fused_lora` on and off; compared: the loss, every
adapter gradient and the random generator's state afterwards (dropout must draw the same masks, in the same order).
Tolerance: fp32 bit for bit (the same matmuls on the same operands, dropout on the same generator state, the input
gradients summed in the order autograd sums peft's); bf16 autocast and 4-bit bases bit for bit as well where asserted,
since the casts are the same. Also: when the fused path must stand aside (DoRA, a disabled adapter, no grad, hooks),
and a few Trainer steps with dropout that equal the unfused run's.
"""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")

import kernels  # noqa: E402
from tests.trainer.loop.test_trainer import dataset, losses, make_args, small_model, tokenizer  # noqa: E402, F401
from trainer.loop.trainer import Trainer  # noqa: E402
from trainer.model import fused_lora  # noqa: E402
from trainer.model.causal_lm import CausalLM, ModelConfig  # noqa: E402
from trainer.model.lora import apply_lora  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(
    *, dropout=0.1, targets=ALL, qkv_bias=False, dtype=torch.float32, seed=0, four_bit=None, **lora
) -> CausalLM:
    config = ModelConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        model_type="qwen2" if qkv_bias else "llama",
    )
    torch.manual_seed(seed)
    model = CausalLM(config)
    model.init_weights(seed)
    args = make_args_stub(dropout, targets, seed, **lora)
    if four_bit is not None:  # {"bnb_4bit_compute_dtype": ..., ...}: the decoder's linear layers in 4 bits
        from trainer.model.quant import quantize_base

        model = quantize_base(model.to(dtype), make_args_stub(dropout, targets, seed, load_in_4bit=True, **four_bit))
    apply_lora(model, args)
    with torch.no_grad():  # B away from zero, so that every gradient (A's too) is non-trivial
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(hash(name) % 2**31))
    return (model if four_bit is not None else model.to(dtype)).train()


def make_args_stub(dropout, targets, seed, **lora):
    from trainer.config.args import TrainingArguments

    values = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=dropout, lora_target_modules=targets, seed=seed)
    return TrainingArguments(output_dir="unused", **{**values, **lora})


def step(model: CausalLM, fused: bool, autocast=None):
    """Loss, adapter gradients and the generator's next draw after one forward and backward."""
    model.fused_lora = fused
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, model.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(7))
    torch.manual_seed(1234)
    ctx = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        loss = model(ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, torch.rand(3)


def assert_same(model, autocast=None):
    loss_peft, grads_peft, rng_peft = step(model, False, autocast)
    loss_fused, grads_fused, rng_fused = step(model, True, autocast)
    assert grads_peft and set(grads_fused) == set(grads_peft)
    assert torch.equal(loss_fused, loss_peft), (loss_fused, loss_peft)
    for name, g in grads_peft.items():
        assert torch.equal(grads_fused[name], g), f"{name}: max diff {(grads_fused[name] - g).abs().max():.3e}"
    assert torch.equal(rng_fused, rng_peft), "dropout drew another number of values"


def count_fused_calls(monkeypatch) -> dict:
    calls = {"projections": 0, "mlp": 0}
    real_projections, real_mlp = kernels.lora_projections, kernels.lora_mlp

    def projections(*a, **k):
        calls["projections"] += 1
        return real_projections(*a, **k)

    def mlp(*a, **k):
        calls["mlp"] += 1
        return real_mlp(*a, **k)

    monkeypatch.setattr(kernels, "lora_projections", projections)
    monkeypatch.setattr(kernels, "lora_mlp", mlp)
    return calls


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("targets", [ALL, ["q_proj", "v_proj"], ["up_proj", "down_proj", "k_proj"]], ids=str)
def test_fp32_equals_peft_bit_for_bit(dropout, targets, monkeypatch):
    model = lora_model(dropout=dropout, targets=targets)
    assert_same(model)
    calls = count_fused_calls(monkeypatch)
    step(model, True)
    layers = model.config.num_hidden_layers
    mlp_adapted = any(t in targets for t in ("gate_proj", "up_proj", "down_proj"))
    assert calls["mlp"] == (layers if mlp_adapted else 0)
    assert calls["projections"] > 0


def test_qkv_bias_rslora_and_bf16_weights_equal_peft():
    assert_same(lora_model(qkv_bias=True, use_rslora=True))
    assert_same(lora_model(dtype=torch.bfloat16))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_bf16_autocast_over_fp32_weights_equals_peft(dropout):
    assert_same(lora_model(dropout=dropout), autocast=torch.bfloat16)


@pytest.mark.parametrize(
    "four_bit, autocast",
    [
        ({}, None),
        ({"bnb_4bit_use_double_quant": True, "bnb_4bit_quant_type": "fp4"}, None),
        ({}, torch.bfloat16),
        ({"bnb_4bit_compute_dtype": "bfloat16"}, torch.bfloat16),
    ],
    ids=["nf4", "fp4-double", "nf4-autocast", "nf4-bf16-compute-autocast"],
)
def test_4bit_bases_equal_peft_bit_for_bit(four_bit, autocast, monkeypatch):
    pytest.importorskip("bitsandbytes")
    model = lora_model(four_bit=four_bit, targets=["q_proj", "v_proj", "gate_proj", "down_proj"])
    assert_same(model, autocast=autocast)
    calls = count_fused_calls(monkeypatch)
    step(model, True, autocast)
    assert calls == {"projections": 2, "mlp": 2}  # q/k/v with k's 4-bit base alone, and the MLPs


def test_the_fused_path_stands_aside_where_it_cannot_apply(monkeypatch):
    calls = count_fused_calls(monkeypatch)
    model = lora_model(use_dora=True)
    step(model, True)
    assert calls == {"projections": 0, "mlp": 0}  # DoRA: peft's layers
    model = lora_model()
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long))
    assert calls == {"projections": 0, "mlp": 0}  # no grad: peft's layers (the same values)
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *a: None)
    step(model, True)
    # layer 0's q_proj is hooked: layer 0's q/k/v run as peft's layers; its o_proj and all of layer 1 still fused
    assert calls == {"projections": 3, "mlp": 2}
    attn = model.model.layers[0].self_attn
    assert fused_lora.find(torch.zeros(1, 48), [attn.q_proj, attn.k_proj]) is None


def test_a_disabled_adapter_runs_the_base_alone(monkeypatch):
    from trainer.model.lora import adapters_disabled

    model = lora_model()
    calls = count_fused_calls(monkeypatch)
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(0))
    with adapters_disabled(model):
        loss = model(ids, labels=ids).loss
    assert calls == {"projections": 0, "mlp": 0}
    base = lora_model()
    base.fused_lora = False
    with adapters_disabled(base):
        assert torch.equal(base(ids, labels=ids).loss, loss)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_trainer_steps_with_dropout_equal_the_unfused_run(tmp_path, dataset, checkpointing):
    runs = {}
    for fused in (True, False):
        model = small_model()
        model.fused_lora = fused
        args = make_args(
            tmp_path / str(fused),
            use_peft=True,
            lora_r=4,
            lora_alpha=8,
            lora_dropout=0.1,
            lora_target_modules=["all-linear"],
            max_steps=3,
            learning_rate=1e-2,
            gradient_checkpointing=checkpointing,
        )
        trainer = Trainer(model=model, args=args, train_dataset=dataset)
        trainer.train()
        runs[fused] = losses(trainer.state), {n: p.detach().clone() for n, p in model.named_parameters()}
    assert runs[True][0] == runs[False][0]
    for name, p in runs[False][1].items():
        assert torch.equal(runs[True][1][name], p), name
