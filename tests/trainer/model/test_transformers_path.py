"""The transformers path (trainer/model/transformers_model.py, issue 44): every causal-LM type of tiny_hf.TYPES, as a
tiny random checkpoint written by transformers, builds through `build_model`, computes transformers' own loss at step
0 (fp32, our fused loss where the probe allows it), trains as `transformers.Trainer` does for three steps, and saves a
directory transformers loads with equal logits. Which path a type takes, and the one-line refusals."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

import kernels
from tests.trainer.loop.test_golden import COMMON, _examples, _pad
from tests.trainer.loop.test_trainer import StopAt
from tests.trainer.model.tiny_hf import TYPES, write_tiny
from tests.trainer.test_sft import FEW_STEPS
from trainer import sft
from trainer.build import build_model
from trainer.coerce import ConfigError
from trainer.config.args import TrainingArguments
from trainer.data.sft_data import TokenizedDataset
from trainer.loop.trainer import Trainer
from trainer.model.causal_lm import ModelError, generate
from trainer.model.transformers_model import TransformersModel, check_transformers_path, model_path

transformers = pytest.importorskip("transformers")

# whose three steps against transformers.Trainer run in the fast suite (the rest are `slow`, ~15 s each): logit
# softcapping and sliding windows (gemma2: the softcap inside our fused head), mixture of experts (qwen3_moe),
# hybrid linear attention (qwen3_5_text)
# (Qwen3-MoE and Qwen3.5 train as our own model by default: test_our_model_trains_*; their transformers-path runs are
# slow)
FAST_TRAINING = ("gemma2",)
# the probe's verdict per type where the logits are more than lm_head(hidden): Gemma 2's final softcapping
SOFTCAPPED = {"gemma2": 30.0}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-hf")
    return {t: write_tiny(t, root / t) for t in TYPES}


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (2, 24), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100
    return ids, labels


def test_the_path_follows_the_model_type():
    assert model_path("llama") == "ours" and model_path("qwen3") == "ours" and model_path("qwen3_5_text") == "ours"
    assert model_path("llama", "transformers") == "transformers"
    assert model_path("gemma3_text") == "transformers" and model_path("gpt_oss", "auto") == "ours"
    assert model_path("qwen3_moe") == "ours" and model_path("mixtral", "transformers") == "transformers"
    with pytest.raises(ModelError, match=r"^model_impl ours: model_type 'gemma3_text' is not one our model covers"):
        model_path("gemma3_text", "ours")
    with pytest.raises(ModelError, match=r"^model_type 'clip' has no causal language model in transformers"):
        model_path("clip")
    with pytest.raises(ConfigError, match=r"^model_impl: 'hf' is not one of auto, ours, transformers"):
        model_path("llama", "hf")


@pytest.mark.parametrize("model_type", TYPES)
def test_step0_loss_is_transformers_and_the_saved_model_loads_with_equal_logits(model_type, checkpoints, tmp_path):
    path = checkpoints[model_type]
    args = TrainingArguments(output_dir=str(tmp_path / "o"))
    model, tokenizer = build_model(str(path), args, model_impl="transformers")
    assert isinstance(model, TransformersModel) and tokenizer.eos_token_id == 258
    assert model.fused_head and model.softcap == SOFTCAPPED.get(model_type)
    report = model.kernel_report()
    assert report.startswith(f"transformers path: {type(model.hf).__name__}; our kernels: ")
    assert "fused linear cross-entropy" in report
    assert ("final logit softcap 30 inside" in report) == (model_type in SOFTCAPPED)
    ids, labels = batch()
    ours = model(input_ids=ids, labels=labels).loss
    plain = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # no kernel of ours inside
    theirs = plain(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=0)  # our RMSNorm and loss: fp32 rounding

    trainer = Trainer(model=model, args=args, processing_class=tokenizer)
    out = trainer.save_model(tmp_path / "saved")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert all(torch.equal(v, model.hf.state_dict()[k]) for k, v in loaded.state_dict().items())
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-6)
    assert (out / "tokenizer.json").is_file()


def _three_steps(path, examples, tmp_path, model_impl="transformers", **overrides):
    # SGD, not AdamW: Adam divides each gradient by its own size, so a gradient that is zero but for rounding (a key
    # projection's bias: softmax ignores a shift of every score; an embedding row seen once) takes a step of the
    # learning rate in a direction rounding picks, in either trainer (measured: up to 1e-3 of a tensor's norm); SGD
    # keeps each step proportional to its gradient, so the weights compare element by element. No weight decay:
    # which parameters decay is one of our documented differences (trainer/loop/optim.py: every 1-D parameter is
    # exempt; transformers decays 1-D ones not named like a bias or norm, Qwen3.5's A_log).
    settings = dict(COMMON, max_steps=3, warmup_steps=0, weight_decay=0.0, optim="sgd", learning_rate=0.05, **overrides)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf_args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), use_cpu=True, remove_unused_columns=False, dataloader_num_workers=0, **settings
    )
    hf = transformers.Trainer(model=hf_model, args=hf_args, train_dataset=examples, data_collator=_pad)
    hf.train()
    args = TrainingArguments(output_dir=str(tmp_path / "ours"), **settings)
    model, _ = build_model(str(path), args, model_impl=model_impl)
    ours = Trainer(model=model, args=args, train_dataset=TokenizedDataset.from_examples(examples))
    ours.train()

    def losses(t):
        return [h["loss"] for h in t.state.log_history if "loss" in h]

    np.testing.assert_allclose(losses(ours), losses(hf), rtol=1e-5, atol=1e-6)
    theirs = hf_model.state_dict()
    for name, value in (model.hf if model_impl == "transformers" else model).state_dict().items():
        torch.testing.assert_close(value, theirs[name], rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize(
    "model_type", [t if t in FAST_TRAINING else pytest.param(t, marks=pytest.mark.slow) for t in TYPES]
)
def test_three_steps_equal_transformers_trainer(model_type, checkpoints, tmp_path):
    """Sequential sampling, micro batch 4 x 2, clipping, fp32, three SGD steps (`_three_steps` says why not AdamW):
    the losses and the weights as transformers.Trainer's."""
    _three_steps(checkpoints[model_type], _examples(n=24), tmp_path)


def test_our_model_trains_qwen3_5_as_transformers_trainer(checkpoints, tmp_path):
    """Qwen3.5 through our own model (gated attention, Gated DeltaNet, zero-centred norms; issue 45): the three steps
    of `test_three_steps_equal_transformers_trainer`, the losses and weights of transformers.Trainer's."""
    _three_steps(checkpoints["qwen3_5_text"], _examples(n=24), tmp_path, model_impl="ours")


@pytest.mark.parametrize(
    "model_type",
    ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow), "gpt_oss", "qwen3_next", "qwen3_5_moe_text"],
)
def test_our_model_trains_moe_as_transformers_trainer(model_type, tmp_path):
    """Qwen3-MoE, Mixtral, gpt-oss (sinks, windows, YaRN, biased router and experts), Qwen3-Next and Qwen3.5-MoE
    (Gated DeltaNet layers, shared experts) through our own model (issues 45, 46) with the load-balancing loss on
    (output_router_logits): the three steps of `test_three_steps_equal_transformers_trainer`, the losses (the aux term
    in them) and the weights (routers included) of transformers.Trainer's. One micro batch of 8 per step: under
    accumulation transformers adds every micro batch's whole aux term, we its share of the window (the main loss's
    normalisation: trainer/model/causal_lm.py `_window_share`, docs/fine_tuning.md), a deliberate difference."""
    path = write_tiny(model_type, tmp_path / model_type, output_router_logits=True)
    settings = dict(per_device_train_batch_size=8, gradient_accumulation_steps=1)
    _three_steps(path, _examples(n=24), tmp_path, model_impl="ours", **settings)


def test_generate_decodes_through_transformers(checkpoints):
    model, tokenizer = build_model(str(checkpoints["gemma3_text"]), TrainingArguments(output_dir="unused"))
    prompt = tokenizer.encode("2+2=")
    new = generate(model, prompt, 6)
    expected = model.hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt) :]
    assert new == expected.tolist() and len(new) == 6
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert generate(model, prompt, 6, temperature=1.0, generator=g1) == generate(
        model, prompt, 6, temperature=1.0, generator=g2
    )


@pytest.mark.parametrize(
    "setting, message",
    [
        (dict(use_liger_kernel=True), "use_liger_kernel: liger-kernel is not available"),
        (
            dict(activation_offloading=True, torch_compile=True),
            "activation_offloading with torch_compile: on the transformers path",
        ),
    ],
)
def test_what_the_path_cannot_do_yet_is_one_line(setting, message):
    with pytest.raises(ConfigError, match="^" + message):
        check_transformers_path(TrainingArguments(output_dir="unused", **setting))


def test_the_command_trains_a_gemma3_and_says_which_path(checkpoints, tmp_path, capsys):
    """`python -m trainer.sft --model <gemma3 dir>`: one line names the path and what of ours runs; the embedded tasks
    train, evaluate (exact match through the logits, sample answers through transformers' generate) and save a
    directory transformers loads."""
    out = tmp_path / "out"
    assert sft.main(["--model", str(checkpoints["gemma3_text"]), "--output_dir", str(out), *FEW_STEPS]) == 0
    err = capsys.readouterr().err
    assert (
        "transformers path: Gemma3ForCausalLM; our kernels: RMSNorm x25 (Gemma3RMSNorm, offset 1), GeGLU x4 "
        "(Gemma3MLP), RoPE x4 (Gemma3Attention), fused linear cross-entropy, FusedAdamW; left as transformers': "
        "attention, residual add + norm (Gemma3DecoderLayer)\n" in err
    )
    final = json.loads((out / "final_metrics.json").read_text())
    assert final["global_step"] == 3 and "exact_match_after" in final
    assert type(transformers.AutoModelForCausalLM.from_pretrained(out)).__name__ == "Gemma3ForCausalLM"


def test_the_command_says_our_model_for_ours(tmp_path, capsys):
    assert sft.main(["--output_dir", str(tmp_path / "o"), *FEW_STEPS, "--eval_exact_match", "false"]) == 0
    assert "our model: llama (trainer.model.causal_lm); kernels: " in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--activation_offloading", "--torch_compile"], "error: activation_offloading with torch_compile: on the"),
        (["--model_impl", "ours"], "error: model_impl ours: model_type 'gemma3_text' is not one our model covers"),
    ],
)
def test_the_command_refuses_in_one_line_before_writing(argv, message, checkpoints, tmp_path, capsys):
    out = tmp_path / "out"
    assert sft.main(["--model", str(checkpoints["gemma3_text"]), "--output_dir", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(message) and not out.exists()


@pytest.mark.parametrize("model_impl", ["transformers", "ours"])
def test_a_stopped_run_resumes_bit_for_bit(model_impl, checkpoints, tmp_path):
    """Stop at step 3 of 6 (a checkpoint in transformers' layout), resume into a model of another init: the losses and
    weights of the uninterrupted run, bit for bit (qwen3_moe: the fused head and a mixture of experts; through our own
    model, issue 46, with its load-balancing loss on)."""
    path, examples = checkpoints["qwen3_moe"], TokenizedDataset.from_examples(_examples(n=48))
    if model_impl == "ours":
        path = write_tiny("qwen3_moe", tmp_path / "qwen3_moe", output_router_logits=True)
    settings = dict(COMMON, max_steps=6, save_strategy="steps", save_steps=3, optim="adamw_fused", train_shuffle=True)

    def run(out, seed=None, stop=None, resume=False):
        args = TrainingArguments(output_dir=str(out), **settings)
        model, _ = build_model(str(path), args, model_impl=model_impl)
        if seed is not None:  # everything must come from the checkpoint
            torch.manual_seed(seed)
            for p in model.parameters():
                torch.nn.init.normal_(p, std=0.5)
        callbacks = [StopAt(stop)] if stop else []
        trainer = Trainer(model=model, args=args, train_dataset=examples, callbacks=callbacks)
        trainer.train(resume_from_checkpoint=resume or None)
        weights = (model.hf if model_impl == "transformers" else model).state_dict()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], weights

    full_losses, full_weights = run(tmp_path / "full")
    run(tmp_path / "part", stop=3)
    resumed_losses, resumed_weights = run(tmp_path / "part", seed=123, resume=True)
    assert resumed_losses == full_losses
    for name, value in resumed_weights.items():
        assert torch.equal(value, full_weights[name]), name


class _EpsOutsideTheRoot(torch.nn.Module):
    """An RMSNorm-shaped module whose math is not ours: eps added outside the square root."""

    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.eps = 1e-2

    def forward(self, x):
        return self.weight * x / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.eps)


def test_the_norm_probe_swaps_only_what_computes_our_math():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridRMSNormGated
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    from trainer.model.kernel_swaps import norm_offset, swap_norms

    assert norm_offset(LlamaRMSNorm(48, eps=1e-5), 1e-5) == 0.0
    assert norm_offset(Gemma3RMSNorm(48, eps=1e-6), 1e-6) == 1.0
    assert norm_offset(_EpsOutsideTheRoot(48), 1e-2) is None
    model = torch.nn.ModuleDict(
        {
            "llama": LlamaRMSNorm(48),
            "gated": Qwen3NextRMSNormGated(48),
            # gate=None computes a plain RMSNorm, which a probe of the rows alone would pass: its forward's extra
            # argument keeps it transformers' (it is called with the gate)
            "gated_optional": GraniteMoeHybridRMSNormGated(48, group_size=48),
            "other": _EpsOutsideTheRoot(48),
            "layer": torch.nn.LayerNorm(48),
        }
    )
    swapped, left = swap_norms(model)
    assert swapped == {"RMSNorm: LlamaRMSNorm": 1}
    assert left == {"Qwen3NextRMSNormGated", "GraniteMoeHybridRMSNormGated", "_EpsOutsideTheRoot", "LayerNorm"}
    norm = model["llama"]
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 48)
    torch.testing.assert_close(norm(x), LlamaRMSNorm.forward(norm, x), rtol=1e-5, atol=1e-6)
    # bf16 rows with a bf16 weight: ours rounds once, transformers twice (kernels/rms_norm.py): one ulp apart at most
    bf16 = LlamaRMSNorm(48).to(torch.bfloat16)
    torch.nn.init.normal_(bf16.weight)
    expected = LlamaRMSNorm.forward(bf16, x.bfloat16())
    swap_norms(bf16)
    torch.testing.assert_close(bf16(x.bfloat16()), expected, rtol=2 * 2**-8, atol=0)
    # rows of another dtype than the weight: transformers' own forward (it promotes), unchanged
    assert bf16(x).dtype == LlamaRMSNorm.forward(bf16, x).dtype == torch.float32
    # Gemma's norm keeps the input's dtype from fp32 math, as our kernel does: under bf16 autocast over fp32 weights
    # (bf16 rows, an fp32 weight) it runs ours, to one bf16 rounding of transformers'
    gemma = Gemma3RMSNorm(48, eps=1e-6)
    torch.nn.init.normal_(gemma.weight)
    expected = Gemma3RMSNorm.forward(gemma, x.bfloat16())
    assert swap_norms(gemma)[0] == {"RMSNorm: Gemma3RMSNorm, offset 1": 1} and gemma.kernel_mixed
    calls = []
    rms_norm = kernels.rms_norm
    kernels.rms_norm = lambda *a: calls.append(1) or rms_norm(*a)
    try:
        ours = gemma(x.bfloat16())
    finally:
        kernels.rms_norm = rms_norm
    assert calls and ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours, expected, rtol=2**-7, atol=0)
    assert not model["llama"].kernel_mixed


@pytest.mark.parametrize(
    "model_type, setting, fused",
    [
        ("qwen3_moe", {}, True),  # pre-norm: x + attn(norm1(x)) -> h, h + mlp(norm2(h))
        ("phi3", {}, True),
        ("gemma3_text", {}, False),  # sandwich norms: the attention's output normed before the add
        ("olmo2", {}, False),  # post-norms
        ("granite", {"residual_multiplier": 0.5}, False),  # x + 0.5 attn(...): the proof sees the multiplier
    ],
)
def test_the_fused_residual_add_and_norm_runs_where_the_block_is_pre_norm(model_type, setting, fused, tmp_path):
    """`swap_residual_norms`: a pre-norm decoder layer runs its middle residual add and norm as one
    `kernels.fused_add_rms_norm` call, with the loss and every gradient of an untouched transformers model (fp32);
    a layer that orders them otherwise keeps its forward and is named; a call with a KV cache (decoding) runs the
    layer's own forward; with transformers' gradient checkpointing the layer is checkpointed and its recompute runs
    ours."""
    path = write_tiny(model_type, tmp_path / model_type, **setting)
    model, _ = build_model(str(path), TrainingArguments(output_dir="unused"), model_impl="transformers")
    layer = type(model.decoder_layers[0]).__name__
    report = model.kernel_report()
    assert (f"fused residual add + RMSNorm x4 ({layer})" in report) is fused, report
    assert (f"residual add + norm ({layer})" in report) is not fused, report
    calls = []
    fused_add = kernels.fused_add_rms_norm
    kernels.fused_add_rms_norm = lambda *a: calls.append(1) or fused_add(*a)
    plain = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids, labels = batch()
    try:
        ours = model(input_ids=ids, labels=labels).loss
        assert len(calls) == (4 if fused else 0)
        ours.backward()
        with torch.no_grad():  # decoding through transformers' cache: the layers' own forwards
            model.hf(input_ids=ids[:, :4], use_cache=True)
        assert len(calls) == (4 if fused else 0)
        model.gradient_checkpointing_enable({"use_reentrant": False})  # the layers checkpointed, ours recomputed
        checkpointed = model(input_ids=ids, labels=labels).loss
        calls.clear()
        checkpointed.backward()
        assert len(calls) == (4 if fused else 0)
    finally:
        kernels.fused_add_rms_norm = fused_add
    theirs = plain(input_ids=ids, labels=labels).loss
    (2 * theirs).backward()  # ours: the plain and the checkpointed backward, accumulated
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    torch.testing.assert_close(checkpointed, theirs, rtol=1e-6, atol=0)
    grads = dict(plain.named_parameters())
    for name, p in model.hf.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.gpu
def test_on_cuda_the_swapped_model_trains_in_bf16_as_transformers(checkpoints):
    """On a GPU: Gemma 3 (offset-1 norms, the fused head) and Qwen3.5 (gated norms left, linear attention) with our
    Triton RMSNorm and fused loss under bf16 autocast: the loss within bf16 rounding of an untouched transformers
    model's, every gradient finite and close to its."""
    for model_type in ("gemma3_text", "qwen3_5_text"):
        path = checkpoints[model_type]
        args = TrainingArguments(output_dir="unused", bf16=True)
        model, _ = build_model(str(path), args, device="cuda", model_impl="transformers")
        plain = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
        ids, labels = (t.cuda() for t in batch())
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ours = model(input_ids=ids, labels=labels).loss
            theirs = plain(input_ids=ids, labels=labels).loss
        torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=0)
        ours.backward()
        theirs.backward()
        for (name, p), q in zip(model.hf.named_parameters(), plain.parameters()):
            assert torch.isfinite(p.grad).all(), name
            torch.testing.assert_close(p.grad, q.grad, rtol=0.1, atol=2e-2, msg=lambda m, name=name: f"{name}: {m}")


def test_a_model_transformers_cannot_build_stops_in_one_line_before_writing(tmp_path, capsys):
    """A config transformers' code refuses (here: no attention heads) stops at the file check, before the summary,
    the build or any write, naming the file, the type and transformers' reason."""
    path = write_tiny("gemma3_text", tmp_path / "broken")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}))
    out = tmp_path / "out"
    assert sft.main(["--model", str(path), "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"error: {path / 'config.json'}: transformers cannot build this 'gemma3_text' model here "
        "(ZeroDivisionError: integer modulo by zero)"
    )
    assert not out.exists()


def test_the_mlp_probe_swaps_swiglu_geglu_and_the_fused_layout():
    """Llama's gated SiLU MLP runs kernels.swiglu_linear, Gemma's tanh-GELU-gated MLP kernels.geglu_linear, Phi-3's
    fused gate_up layout our SwiGLU over its two halves; an MLP gated by the exact (erf) GELU stays transformers' and
    is named. Each swapped MLP computes what it computed, outputs and gradients (fp32 rounding)."""
    from transformers import GemmaConfig, LlamaConfig, Phi3Config
    from transformers.models.gemma.modeling_gemma import GemmaMLP
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.phi3.modeling_phi3 import Phi3MLP

    from trainer.model.kernel_swaps import gated_mlp_act, swap_mlps

    sizes = dict(hidden_size=32, intermediate_size=48)
    mlps = {
        "llama": LlamaMLP(LlamaConfig(**sizes)),
        "gemma": GemmaMLP(GemmaConfig(**sizes)),
        "phi3": Phi3MLP(Phi3Config(**sizes)),
    }
    erf = LlamaMLP(LlamaConfig(**sizes, hidden_act="gelu"))  # (Gemma's code forces the tanh GELU whatever it is told)
    acts = {name: gated_mlp_act(m) for name, m in mlps.items()}
    assert acts == {"llama": "silu", "gemma": "gelu_tanh", "phi3": "silu"} and gated_mlp_act(erf) is None
    assert swap_mlps(erf) == ({}, {"LlamaMLP"})
    x = torch.randn(2, 5, 32)
    expected = {}
    for name, m in mlps.items():
        out = type(m).forward(m, x)
        expected[name] = (out, torch.autograd.grad(out.square().sum(), list(m.parameters())))
    swapped, left = swap_mlps(torch.nn.ModuleDict(mlps))
    assert swapped == {"SwiGLU: LlamaMLP": 1, "GeGLU: GemmaMLP": 1, "SwiGLU: Phi3MLP, fused gate_up": 1} and not left
    for name, m in mlps.items():
        out = m(x)
        grads = torch.autograd.grad(out.square().sum(), list(m.parameters()))
        torch.testing.assert_close(out, expected[name][0], rtol=1e-5, atol=1e-6)
        for g, e in zip(grads, expected[name][1]):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


ROPE_CASES = {  # model type -> what the RoPE probe decides for its attention
    "gemma3_text": "RoPE x4 (Gemma3Attention)",
    "qwen3_5_text": "RoPE x1 (Qwen3_5Attention, partial 4/16)",  # partial rotary: the first quarter rotates
    "glm4": "rotary embedding (Glm4Attention)",  # interleaved pairs: not our layout, left
}


@pytest.mark.parametrize("model_type", ROPE_CASES)
def test_rope_runs_ours_inside_our_models_only(model_type, checkpoints, monkeypatch, tmp_path):
    """Our RoPE where the probe proves the model's apply_rotary_pos_emb (half-split, full or partial): kernels.rope
    runs inside our model's attention, in forward and in activation checkpointing's recompute, and the loss and its
    gradients are transformers' (fp32 rounding); a plain transformers model of the same type built afterwards in the
    same process keeps transformers' function (the dispatcher runs ours only inside our attention modules); GLM-4's
    interleaved rotation fails the probe and stays transformers'."""
    path = checkpoints.get(model_type) or write_tiny(model_type, tmp_path / model_type)
    calls = []
    rope = kernels.rope
    monkeypatch.setattr(kernels, "rope", lambda *a: calls.append(1) or rope(*a))
    args = TrainingArguments(output_dir=str(tmp_path / "o"))
    model, _ = build_model(str(path), args, model_impl="transformers")
    assert ROPE_CASES[model_type] in model.kernel_report()
    swapped = ROPE_CASES[model_type].startswith("RoPE")
    calls.clear()  # the build's probe forward (swap_residual_norms) ran our attention
    plain = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids, labels = batch()
    theirs = plain(input_ids=ids, labels=labels).loss
    assert not calls  # transformers' own model, after the dispatcher was installed: transformers' function
    theirs.backward()
    ours = model(input_ids=ids, labels=labels).loss
    assert bool(calls) == swapped
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=0)
    ours.backward()
    for (name, p), q in zip(model.hf.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    if swapped:  # the recompute of a checkpointed layer runs ours too
        model.gradient_checkpointing_enable({"use_reentrant": False})
        model.zero_grad()
        loss = model(input_ids=ids, labels=labels).loss
        calls.clear()
        loss.backward()
        assert calls, "the checkpointed layers' recompute ran transformers' rotation"


def test_flops_are_counted_for_softmax_attention_only(checkpoints):
    """MFU is logged only where the FLOPs per token are counted: dense softmax-attention models (sliding windows
    included), not mixtures of experts or hybrid linear-attention models."""
    args = TrainingArguments(output_dir="unused")
    flops = {
        t: build_model(str(checkpoints[t]), args, model_impl="transformers")[0].flops_per_token(64)
        for t in ("gemma3_text", "qwen3_5_text")
    }
    assert flops["gemma3_text"] > 0 and flops["qwen3_5_text"] is None
    assert build_model(str(checkpoints["qwen3_moe"]), args, model_impl="transformers")[0].flops_per_token(64) is None
    # sizes read from the text config (a multimodal model's decoder), and not guessed when they are named otherwise
    model = build_model(str(checkpoints["gemma3_text"]), args)[0]
    model.config = types.SimpleNamespace(get_text_config=lambda: model.hf.config)
    assert model.flops_per_token(64) == flops["gemma3_text"]
    model.config = types.SimpleNamespace(get_text_config=lambda: types.SimpleNamespace(hidden_size=64))
    assert model.flops_per_token(64) is None
