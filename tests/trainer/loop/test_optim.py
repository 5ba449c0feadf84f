"""Optimizers, parameter groups and schedules. Every schedule curve is compared, step by step, with a formula
written out here and with transformers.get_scheduler (the oracle); both comparisons are exact up to float
rounding (rel 1e-12), since the schedules are the same closed forms."""

import dataclasses
import importlib
import io
import json
import math
import re

import pytest
import torch

import trainer.loop.optim as optim_module
from kernels import FusedAdamW
from tests.trainer.loop.test_trainer import losses, small_model, stop_then_resume, weights
from tests.trainer.loop.test_trainer import make_args as trainer_args
from trainer.config.args import ConfigError, TrainingArguments
from trainer.data.sft_data import load_sft_dataset
from trainer.data.tasks import generate_tasks
from trainer.data.tokenizer import byte_level_tokenizer
from trainer.loop.callbacks import TrainerCallback
from trainer.loop.optim import build_lr_scheduler, build_optimizer, build_scheduler, param_groups
from trainer.loop.trainer import Trainer

W, T, LR = 4, 20, 1e-3
STEPS = range(T + 4)  # past the end too: the schedules must stay defined there


def lrs(scheduler, steps=STEPS) -> list[float]:
    out = []
    for _ in steps:
        out.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def sgd(lr=LR) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=lr)


# Formulas written from Hugging Face's documentation, independently of trainer.loop.optim's code.
def warm(s, w=W):
    return s / max(1, w)


def f_linear(s):
    return warm(s) if s < W else max(0.0, (T - s) / (T - W))


def f_cosine(cycles=0.5, floor=0.0):
    def f(s):
        if s < W:
            return warm(s)
        p = (s - W) / (T - W)
        return max(0.0, floor + (1 - floor) * (1 + math.cos(2 * math.pi * cycles * p)) / 2)

    return f


def f_restarts(cycles):
    def f(s):
        if s < W:
            return warm(s)
        p = (s - W) / (T - W)
        return 0.0 if p >= 1 else (1 + math.cos(math.pi * math.fmod(cycles * p, 1.0))) / 2

    return f


def f_polynomial(lr_end, power):
    def f(s):
        if s < W:
            return warm(s)
        if s > T:
            return lr_end / LR
        return (lr_end + (LR - lr_end) * (1 - (s - W) / (T - W)) ** power) / LR

    return f


def f_inverse_sqrt(timescale):
    return lambda s: warm(s) if s < W else math.sqrt(timescale / (s - W + timescale))


def f_wsd(decay, stable=None, warmup_type="linear", decay_type="cosine", floor=0.0, cycles=0.5):
    stable = T - W - decay if stable is None else stable
    ramp = {
        "linear": (lambda p: p, lambda p: 1 - p),
        "cosine": (lambda p: (1 - math.cos(math.pi * p)) / 2, lambda p: (1 + math.cos(2 * math.pi * cycles * p)) / 2),
        "1-sqrt": (lambda p: 1 - math.sqrt(1 - p), lambda p: 1 - math.sqrt(p)),
    }

    def f(s):
        if s < W:
            return floor + (1 - floor) * ramp[warmup_type][0](s / W)
        if s < W + stable:
            return 1.0
        if s < W + stable + decay:
            return floor + (1 - floor) * ramp[decay_type][1]((s - W - stable) / decay)
        return floor

    return f


CURVES = [
    ("linear", {}, f_linear),
    ("cosine", {}, f_cosine()),
    ("cosine", {"num_cycles": 1.25}, f_cosine(1.25)),
    ("cosine_with_restarts", {}, f_restarts(1)),
    ("cosine_with_restarts", {"num_cycles": 3}, f_restarts(3)),
    ("polynomial", {}, f_polynomial(1e-7, 1.0)),
    ("polynomial", {"lr_end": 1e-4, "power": 2.0}, f_polynomial(1e-4, 2.0)),
    ("constant", {}, lambda s: 1.0),
    ("constant_with_warmup", {}, lambda s: warm(s) if s < W else 1.0),
    ("inverse_sqrt", {}, f_inverse_sqrt(W)),
    ("inverse_sqrt", {"timescale": 7}, f_inverse_sqrt(7)),
    ("warmup_stable_decay", {"num_decay_steps": 6}, f_wsd(6)),
    (
        "warmup_stable_decay",
        {
            "num_decay_steps": 5,
            "num_stable_steps": 3,
            "warmup_type": "cosine",
            "decay_type": "1-sqrt",
            "min_lr_ratio": 0.1,
        },
        f_wsd(5, 3, "cosine", "1-sqrt", 0.1),
    ),
    (
        "warmup_stable_decay",
        {"num_decay_steps": 8, "warmup_type": "1-sqrt", "decay_type": "linear"},
        f_wsd(8, None, "1-sqrt", "linear"),
    ),
    (
        "warmup_stable_decay",
        {"num_decay_steps": 8, "num_cycles": 1.0, "min_lr_ratio": 0.2},
        f_wsd(8, None, "linear", "cosine", 0.2, 1.0),
    ),
    ("cosine_with_min_lr", {"min_lr": 1e-4}, f_cosine(0.5, 0.1)),
    ("cosine_with_min_lr", {"min_lr_rate": 0.25, "num_cycles": 0.75}, f_cosine(0.75, 0.25)),
]


@pytest.mark.filterwarnings("ignore:Both num_training_steps and num_stable_steps:UserWarning")  # the oracle's
@pytest.mark.parametrize("name, kwargs, formula", CURVES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CURVES)])
def test_schedule_matches_formula_and_hugging_face(name, kwargs, formula):
    transformers = pytest.importorskip("transformers")
    ours = lrs(build_scheduler(name, sgd(), W, T, **kwargs))
    expected = [LR * formula(s) for s in STEPS]
    assert ours == pytest.approx(expected, rel=1e-12, abs=1e-18)
    theirs = lrs(transformers.get_scheduler(name, sgd(), W, T, scheduler_specific_kwargs=dict(kwargs)))
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-18)


def test_schedules_without_warmup_start_at_the_peak():
    for name in ("linear", "cosine", "polynomial", "constant_with_warmup", "cosine_with_restarts"):
        assert build_scheduler(name, sgd(), 0, T).get_last_lr() == [LR], name
    assert lrs(build_scheduler("inverse_sqrt", sgd(), 0, T), range(3)) == pytest.approx(
        [LR / math.sqrt((s + 10_000) / 10_000) for s in range(3)], rel=1e-12
    )  # timescale 10000 without warmup


def test_schedule_scales_every_param_group():
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    opt = torch.optim.AdamW([{"params": [params[0]], "lr": 1e-3}, {"params": [params[1]], "lr": 4e-3}], lr=1e-3)
    scheduler = build_scheduler("linear", opt, W, T)
    for _ in range(6):
        opt.step()
        scheduler.step()
    assert scheduler.get_last_lr() == pytest.approx([1e-3 * f_linear(6), 4e-3 * f_linear(6)], rel=1e-12)


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("cosine", {}),
        ("polynomial", {"power": 0.5}),
        ("warmup_stable_decay", {"num_decay_steps": 6}),
        ("cosine_with_min_lr", {"min_lr_rate": 0.1}),
        ("constant", {}),
    ],
)
def test_scheduler_resumes_from_state_dict(name, kwargs):
    def fresh():
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        return model, opt, build_scheduler(name, opt, W, T, **kwargs)

    _, _, reference = fresh()
    uninterrupted = lrs(reference, range(T))

    _, opt, scheduler = fresh()
    first = lrs(scheduler, range(9))
    buffer = io.BytesIO()
    torch.save({"optimizer": opt.state_dict(), "scheduler": scheduler.state_dict()}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)  # plain numbers only: no pickled functions

    _, opt2, scheduler2 = fresh()
    opt2.load_state_dict(state["optimizer"])
    scheduler2.load_state_dict(state["scheduler"])
    assert opt2.param_groups[0]["lr"] == pytest.approx(uninterrupted[9], rel=1e-12)
    assert first + lrs(scheduler2, range(T - 9)) == pytest.approx(uninterrupted, rel=1e-12)


SCHEDULER_ERRORS = [
    ("cosine_annealing", {}, "lr_scheduler_type='cosine_annealing': expected one of linear"),
    ("cosine", {"cycles": 2}, "lr_scheduler_kwargs: unknown key 'cycles' for lr_scheduler_type='cosine'"),
    ("linear", {"power": 2}, "unknown key 'power' for lr_scheduler_type='linear'"),
    ("polynomial", {"lr_end": 1e-3}, "lr_scheduler_kwargs.lr_end=0.001: must be smaller than the initial lr 0.001"),
    ("polynomial", {"power": 0}, "lr_scheduler_kwargs.power=0.0: must be > 0"),
    ("cosine_with_min_lr", {}, "needs exactly one of min_lr or min_lr_rate"),
    ("warmup_stable_decay", {}, "warmup_stable_decay needs num_decay_steps"),
    ("warmup_stable_decay", {"num_decay_steps": 30}, "warmup (4) + decay exceed num_training_steps (20)"),
    ("warmup_stable_decay", {"num_decay_steps": 5, "warmup_type": "exp"}, "lr_scheduler_kwargs.warmup_type='exp'"),
    ("cosine_with_restarts", {"num_cycles": 1.5}, "lr_scheduler_kwargs.num_cycles: expected an integer"),
]


@pytest.mark.parametrize("name, kwargs, expected", SCHEDULER_ERRORS, ids=[str(i) for i in range(len(SCHEDULER_ERRORS))])
def test_scheduler_errors(name, kwargs, expected):
    with pytest.raises(ConfigError) as info:
        build_scheduler(name, sgd(), W, T, **kwargs)
    assert expected in str(info.value)


def test_lr_end_is_checked_once_per_path(monkeypatch):
    # Issue 23: lr_end was checked by TrainingArguments and again by every schedule built from them. Now the
    # arguments check it against learning_rate; the schedule checks it only against an lr they did not check: a
    # direct build_scheduler's raw kwargs, or a user's optimizer (the Trainer's `optimizers`) with its own lr.
    args = TrainingArguments(lr_scheduler_type="polynomial", learning_rate=LR, lr_scheduler_kwargs={"lr_end": 1e-4})
    checked = []
    check = optim_module._check_lr_end
    monkeypatch.setattr(optim_module, "_check_lr_end", lambda *a: checked.append(a) or check(*a))
    build_lr_scheduler(sgd(), args, T)
    assert checked == []
    with pytest.raises(ConfigError, match=r"lr_end=0\.0001: must be smaller than the initial lr 1e-05"):
        build_lr_scheduler(sgd(1e-5), args, T)


def test_scheduler_step_counts_are_checked():
    with pytest.raises(ConfigError, match="num_warmup_steps=-1"):
        build_scheduler("linear", sgd(), -1, T)
    with pytest.raises(ConfigError, match="num_training_steps=0"):
        build_scheduler("cosine", sgd(), 0, 0)
    assert build_scheduler("constant", sgd(), 0, 0).get_last_lr() == [LR]


# --- parameter groups ------------------------------------------------------------------------------------


class RMSNorm(torch.nn.Module):  # a user module: excluded from decay by its class name
    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))


class OddNorm(torch.nn.Module):  # a 2-D parameter owned by a "Norm" module: still no decay
    def __init__(self):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(2, 2))


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 4)
        self.proj = torch.nn.Linear(4, 4)
        self.ln = torch.nn.LayerNorm(4)
        self.norm = RMSNorm(4)
        self.odd = OddNorm()
        self.scale = torch.nn.Parameter(torch.ones(4))
        self.frozen = torch.nn.Linear(4, 4, bias=False).requires_grad_(False)
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight  # tied: must appear once


def test_param_groups_exclude_biases_norms_and_vectors():
    groups = param_groups(Tiny(), 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert groups[0]["param_names"] == ["embed.weight", "proj.weight"]
    assert sorted(groups[1]["param_names"]) == sorted(
        ["proj.bias", "ln.weight", "ln.bias", "norm.weight", "odd.gain", "scale"]
    )
    for g in groups:
        assert len(g["params"]) == len(g["param_names"]) and all(p.requires_grad for p in g["params"])
    only_matrix = torch.nn.Linear(3, 3, bias=False)
    expected = [{"params": [only_matrix.weight], "param_names": ["weight"], "weight_decay": 0.1}]
    assert param_groups(only_matrix, 0.1) == expected
    with pytest.raises(ConfigError, match="no trainable parameters"):
        param_groups(torch.nn.Linear(2, 2).requires_grad_(False), 0.1)


class LlamaRMSNorm(RMSNorm):
    pass


class Attention(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        # Qwen2 has q/k/v biases; Llama has none
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(dim, dim, bias=True) for _ in range(3))
        self.o_proj = torch.nn.Linear(dim, dim, bias=False)


class MLP(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gate_proj = torch.nn.Linear(dim, 2 * dim, bias=False)
        self.up_proj = torch.nn.Linear(dim, 2 * dim, bias=False)
        self.down_proj = torch.nn.Linear(2 * dim, dim, bias=False)


class DecoderLayer(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.self_attn, self.mlp = Attention(dim), MLP(dim)
        self.input_layernorm, self.post_attention_layernorm = LlamaRMSNorm(dim), LlamaRMSNorm(dim)


class LlamaLike(torch.nn.Module):
    """Hugging Face's Llama/Qwen2 parameter names and norm class names, without importing transformers."""

    def __init__(self, dim=8, vocab=16, layers=2):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(vocab, dim)
        self.model.layers = torch.nn.ModuleList(DecoderLayer(dim) for _ in range(layers))
        self.model.norm = LlamaRMSNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)


def hf_decay_names(model):
    """Hugging Face's rule (Trainer.get_decay_parameter_names in transformers 5.23), restated: a parameter decays
    unless it sits in an nn.LayerNorm or its full name matches one of these patterns (lower-cased)."""
    patterns = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
    layer_norm_owned = {id(p) for m in model.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters()}
    return {
        name
        for name, p in model.named_parameters()
        if id(p) not in layer_norm_owned and not any(re.search(pat, name.lower()) for pat in patterns)
    }


def test_param_groups_agree_with_hugging_face_on_llama_names():
    model = LlamaLike()
    ours = param_groups(model, 0.01)
    assert set(ours[0]["param_names"]) == hf_decay_names(model)
    assert "model.layers.0.self_attn.q_proj.bias" in ours[1]["param_names"]
    assert "model.norm.weight" in ours[1]["param_names"] and "lm_head.weight" in ours[0]["param_names"]
    assert set(ours[0]["param_names"]) | set(ours[1]["param_names"]) == {n for n, _ in model.named_parameters()}


# --- optimizers ------------------------------------------------------------------------------------------


def make_args(**kwargs) -> TrainingArguments:
    return TrainingArguments(
        learning_rate=2e-3, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6, **kwargs
    )


def one_step(opt: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    torch.manual_seed(0)
    model(torch.randn(5, 4)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def model_and_copy():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    twin = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    twin.load_state_dict(model.state_dict())
    return model, twin


def manual_adamw(model, **extra):
    decay = [model[0].weight, model[2].weight]
    rest = [model[0].bias, model[1].weight, model[1].bias, model[2].bias]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=2e-3,
        betas=(0.8, 0.95),
        eps=1e-6,
        **extra,
    )


@pytest.mark.parametrize("optim, fused", [("adamw_torch", None), ("adamw_torch_fused", True)])
def test_torch_adamw_variants(optim, fused):
    model, twin = model_and_copy()
    opt = build_optimizer(model, make_args(optim=optim, optim_args="amsgrad=true"))
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is fused and opt.defaults["amsgrad"] is True
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert opt.param_groups[0]["param_names"] == ["0.weight", "2.weight"]
    assert (opt.defaults["lr"], opt.defaults["betas"], opt.defaults["eps"]) == (2e-3, (0.8, 0.95), 1e-6)
    reference = manual_adamw(twin, amsgrad=True)
    for _ in range(3):
        one_step(opt, model)
        one_step(reference, twin)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)  # fused vs foreach: a few ulps apart


def test_sgd_takes_momentum_from_optim_args():
    model, _ = model_and_copy()
    opt = build_optimizer(model, make_args(optim="sgd", optim_args="momentum=0.9,nesterov=true"))
    assert type(opt) is torch.optim.SGD
    assert (opt.defaults["momentum"], opt.defaults["nesterov"], opt.defaults["lr"]) == (0.9, True, 2e-3)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    before = model[0].weight.detach().clone()
    one_step(opt, model)
    assert not torch.equal(before, model[0].weight)
    assert build_optimizer(model, make_args(optim="sgd")).defaults["momentum"] == 0.0


def test_fused_adamw_from_kernels_matches_torch():
    kernels = importlib.import_module("kernels")
    model, twin = model_and_copy()
    opt = build_optimizer(model, make_args())  # adamw_fused is the default
    assert type(opt) is kernels.FusedAdamW
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    reference = manual_adamw(twin)
    for _ in range(3):
        one_step(opt, model)
        one_step(reference, twin)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_build_optimizer_from_parameters_pairs_and_groups():
    model, _ = model_and_copy()
    args = make_args(optim="adamw_torch")
    opt = build_optimizer(list(model.parameters()), args)  # the ndim rule alone, no names
    assert [len(g["params"]) for g in opt.param_groups] == [2, 4] and "param_names" not in opt.param_groups[0]
    opt = build_optimizer(model.named_parameters(), args)
    assert opt.param_groups[1]["param_names"] == ["0.bias", "1.weight", "1.bias", "2.bias"]
    groups = [{"params": list(model.parameters()), "weight_decay": 0.5}]
    assert build_optimizer(groups, args).param_groups[0]["weight_decay"] == 0.5
    with pytest.raises(ConfigError, match="no parameters"):
        build_optimizer([], args)
    with pytest.raises(TypeError, match="build_optimizer takes"):
        build_optimizer([1, 2], args)


def test_optimizer_and_schedule_arguments_are_validated_once_by_training_arguments(monkeypatch):
    with pytest.raises(ConfigError, match="optim_args: unknown key 'momentum' for optim='adamw_torch'"):
        make_args(optim="adamw_torch", optim_args="momentum=0.9")
    with pytest.raises(ConfigError, match="optim='lion'"):
        make_args(optim="lion")
    args = make_args(
        optim="sgd",
        optim_args="momentum=0.9",
        lr_scheduler_type="cosine",
        lr_scheduler_kwargs={"num_cycles": 2},
        warmup_steps=W,
    )

    def validated_again(*_, **__):
        raise AssertionError("trainer.loop.optim validated arguments that TrainingArguments already validated")

    # The builders trust the validated, typed values: neither validator runs a second time on the args' path.
    monkeypatch.setattr(optim_module, "parse_optim_args", validated_again, raising=False)
    monkeypatch.setattr(optim_module, "check_scheduler_kwargs", validated_again)
    opt = build_optimizer(torch.nn.Linear(2, 2), args)
    assert opt.defaults["momentum"] == 0.9
    scheduled = lrs(build_lr_scheduler(sgd(), args, T))
    monkeypatch.undo()
    assert scheduled == lrs(build_scheduler("cosine", sgd(), W, T, num_cycles=2))


# --- optim_config / lr_scheduler_config (seed 001's plugin configs) --------------------------------------------


def halve_every(optimizer, num_training_steps, every=2):
    """A user's schedule factory (lr_scheduler_config 'module:attribute'); takes num_training_steps by name."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=every, gamma=0.5 ** (every / num_training_steps))


def warm_then_flat(optimizer, num_warmup_steps):
    return build_scheduler("constant_with_warmup", optimizer, num_warmup_steps, 1)


def not_an_optimizer(params, **kwargs):
    return list(params)


def test_optim_config_with_a_registered_name_is_optim_and_optim_args():
    model, twin = model_and_copy()
    args = make_args(optim_config={"name": "sgd", "momentum": 0.9, "nesterov": True})
    assert (args.optim, args.optim_args) == ("sgd", {"momentum": 0.9, "nesterov": True})
    opt = build_optimizer(model, args)
    reference = build_optimizer(twin, make_args(optim="sgd", optim_args="momentum=0.9,nesterov=true"))
    assert type(opt) is torch.optim.SGD and opt.defaults == reference.defaults
    args = make_args(lr_scheduler_config={"name": "cosine", "num_cycles": 2}, warmup_steps=W)
    assert (args.lr_scheduler_type, args.lr_scheduler_kwargs) == ("cosine", {"num_cycles": 2.0})
    assert lrs(build_lr_scheduler(sgd(), args, T)) == lrs(build_scheduler("cosine", sgd(), W, T, num_cycles=2))


def test_optim_config_module_attribute_builds_the_users_class():
    model, _ = model_and_copy()
    opt = build_optimizer(model, make_args(optim_config={"name": "torch.optim:Adagrad", "lr_decay": 0.01}))
    assert type(opt) is torch.optim.Adagrad
    assert (opt.defaults["lr"], opt.defaults["lr_decay"]) == (2e-3, 0.01)  # lr from learning_rate
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # decay groups as for every optimizer
    with pytest.raises(ConfigError, match="not_an_optimizer' returned a list, not a torch.optim.Optimizer"):
        build_optimizer(model, make_args(optim_config={"name": "tests.trainer.loop.test_optim:not_an_optimizer"}))


def test_lr_scheduler_config_module_attribute_gets_the_steps_it_names():
    args = make_args(lr_scheduler_config={"name": "tests.trainer.loop.test_optim:halve_every", "every": 5})
    scheduler = build_lr_scheduler(sgd(), args, T)
    assert type(scheduler) is torch.optim.lr_scheduler.StepLR and scheduler.step_size == 5
    assert scheduler.gamma == pytest.approx(0.5 ** (5 / T))
    args = make_args(lr_scheduler_config={"name": "tests.trainer.loop.test_optim:warm_then_flat"}, warmup_steps=W)
    assert lrs(build_lr_scheduler(sgd(), args, T), range(6)) == pytest.approx([LR * s / W for s in range(W)] + [LR] * 2)
    args = make_args(lr_scheduler_config={"name": "torch.optim.lr_scheduler:ReduceLROnPlateau"})
    with pytest.raises(ConfigError, match="ReduceLROnPlateau needs a metric"):
        build_lr_scheduler(sgd(), args, T)


PLUGIN_ERRORS = [
    (
        dict(optim_config={"name": "lion"}),
        "optim_config.name='lion' is not a registered optimizer; registered "
        "optimizers: adamw_fused, adamw_torch, adamw_torch_fused, sgd, adamw_bnb_8bit, adamw_8bit, paged_adamw_8bit; "
        "or 'module:attribute' for your own",
    ),
    (dict(optim_config={"name": "adamw_torc"}), "(did you mean 'adamw_torch'?)"),
    (dict(optim_config={"momentum": 0.9}), "optim_config: 'name' is required (registered optimizers: adamw_fused"),
    (
        dict(optim_config={"name": "no_such_module:Lion"}),
        "optim_config.name='no_such_module:Lion': cannot import 'no_such_module' (ModuleNotFoundError: No module named",
    ),
    (dict(optim_config={"name": "torch.optim:Lion2"}), "'torch.optim' has no attribute 'Lion2'"),
    (dict(optim_config={"name": "torch.optim:Adagrad", "lr": 0.1}), "optim_config.lr: set learning_rate"),
    (dict(optim_config={"name": "sgd", "amsgrad": True}), "optim_config: unknown key 'amsgrad' for optim='sgd'"),
    (
        dict(optim_config={"name": "sgd"}, optim="adamw_torch"),
        "optim_config.name='sgd' and optim='adamw_torch' both choose the optimizer; give one",
    ),
    (
        dict(optim_config={"name": "sgd", "momentum": 0.5}, optim="sgd", optim_args="momentum=0.9"),
        "optim_config and optim_args both set the optimizer's options",
    ),
    (
        dict(optim_config={"name": "torch.optim:Adagrad"}, optim="sgd"),
        "optim_config.name='torch.optim:Adagrad' chooses the optimizer; drop optim/optim_args",
    ),
    (
        dict(lr_scheduler_config={"name": "onecycle"}),
        "lr_scheduler_config.name='onecycle' is not a registered "
        "schedule; registered schedules: linear, cosine, cosine_with_restarts",
    ),
    (
        dict(lr_scheduler_config={"name": "cosine", "cycles": 2}),
        "lr_scheduler_config: unknown key 'cycles' for lr_scheduler_type='cosine' (did you mean 'num_cycles'?)",
    ),
    (
        dict(lr_scheduler_config={"name": "cosine"}, lr_scheduler_type="constant"),
        "lr_scheduler_config.name='cosine' and lr_scheduler_type='constant' both choose the schedule",
    ),
    (
        dict(lr_scheduler_config={"name": "torch.optim.lr_scheduler:StepLR", "step_size": 2}, warmup_ratio=0.1),
        "takes no num_warmup_steps, so warmup_steps/warmup_ratio=0.1 would be ignored; set them to 0",
    ),
    (
        dict(lr_scheduler_config={"name": "tests.trainer.loop.test_optim:halve_every", "num_training_steps": 3}),
        "lr_scheduler_config.num_training_steps: the trainer passes it",
    ),
    (
        dict(
            lr_scheduler_config={"name": "torch.optim.lr_scheduler:StepLR"},
            lr_scheduler_kwargs={"num_cycles": 1},
            lr_scheduler_type="cosine",
        ),
        "chooses the schedule; drop lr_scheduler_type/lr_scheduler_kwargs",
    ),
]


@pytest.mark.parametrize("kwargs, expected", PLUGIN_ERRORS, ids=[str(i) for i in range(len(PLUGIN_ERRORS))])
def test_plugin_config_errors_are_one_line_at_argument_time(kwargs, expected):
    with pytest.raises(ConfigError) as e:
        TrainingArguments(**kwargs)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_plugin_configs_round_trip_through_training_args_json(tmp_path):
    args = TrainingArguments(
        optim_config='{"name": "torch.optim:Adagrad", "lr_decay": 0.01}',
        lr_scheduler_config={"name": "tests.trainer.loop.test_optim:halve_every", "every": 3},
    )
    path = tmp_path / "training_args.json"
    args.to_json_file(path)
    assert TrainingArguments.from_json_file(path) == args and dataclasses.replace(args) == args
    assert json.loads(path.read_text())["optim_config"] == {"name": "torch.optim:Adagrad", "lr_decay": 0.01}
    registered = TrainingArguments(optim_config={"name": "sgd", "momentum": 0.9})
    assert TrainingArguments.from_dict(registered.to_dict()) == registered


def test_resume_with_plugin_configs_is_exact(tmp_path):
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate_tasks(24, seed=3)))
    dataset = load_sft_dataset([data], byte_level_tokenizer(), cutoff_len=64, show_progress=False)
    common = dict(
        max_steps=6,
        save_strategy="steps",
        save_steps=3,
        optim="adamw_fused",  # the default: no conflict
        optim_config={"name": "torch.optim:Adagrad", "lr_decay": 0.01},
        lr_scheduler_config={"name": "tests.trainer.loop.test_optim:halve_every", "every": 2},
    )

    class StopAt3(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            control.should_training_stop = state.global_step == 3

    model = small_model()
    full_trainer = Trainer(model=model, args=trainer_args(tmp_path / "full", **common), train_dataset=dataset)
    full_trainer.train()
    full = full_trainer.state
    full_weights = weights(model)
    Trainer(
        model=small_model(),
        args=trainer_args(tmp_path / "part", **common),
        train_dataset=dataset,
        callbacks=[StopAt3()],
    ).train()
    model = small_model(seed=123)  # everything must come from the checkpoint
    resumed = Trainer(model=model, args=trainer_args(tmp_path / "part", **common), train_dataset=dataset)
    resumed.train(resume_from_checkpoint=True)
    state = resumed.state
    assert type(resumed.optimizer) is torch.optim.Adagrad and type(resumed.lr_scheduler).__name__ == "StepLR"
    assert losses(state) == losses(full)
    assert [h["learning_rate"] for h in state.log_history if "loss" in h] == [
        h["learning_rate"] for h in full.log_history if "loss" in h
    ]
    for name, value in weights(model).items():
        assert torch.equal(value, full_weights[name]), name


def test_fused_adamw_bf16_moments_from_optim_args_train_and_resume_exactly(tmp_path):
    """optim_args state_dtype=bfloat16 (issue 34 item 4): FusedAdamW keeps bf16 moments through the Trainer, and a
    run stopped at step 2 and resumed from its checkpoint lands on the unbroken run's bits."""
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate_tasks(24, seed=3)))
    dataset = load_sft_dataset([data], byte_level_tokenizer(), cutoff_len=64, show_progress=False)
    common = dict(
        max_steps=4, save_strategy="steps", save_steps=2, optim="adamw_fused", optim_args="state_dtype=bfloat16"
    )
    model = small_model()
    full = Trainer(model=model, args=trainer_args(tmp_path / "full", **common), train_dataset=dataset)
    full.train()
    moments = [s[k] for s in full.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert type(full.optimizer) is FusedAdamW and moments and {m.dtype for m in moments} == {torch.bfloat16}
    state, resumed = stop_then_resume(tmp_path / "part", dataset, 2, **common)
    assert losses(state) == losses(full.state)
    full_weights = weights(model)
    for name, value in weights(resumed).items():
        assert torch.equal(value, full_weights[name]), name
    with pytest.raises(ConfigError, match="optim_args.state_dtype='float16': expected one of float32, bfloat16"):
        make_args(optim="adamw_fused", optim_args="state_dtype=float16")
