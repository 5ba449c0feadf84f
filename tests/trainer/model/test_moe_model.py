"""Our model's Mixture-of-Experts types (qwen3_moe, mixtral, gpt_oss: trainer/model/moe.py) against transformers (a
test-only oracle): logits, loss with the load-balancing term, the aux loss itself and every gradient in fp32;
checkpoints read and written in transformers' layout (per expert; gpt_oss's 3-D tensors, its MXFP4 packing read);
padding left out of the router statistics as transformers leaves it. gpt_oss also brings attention sinks, sliding and
full layers alternating, YaRN RoPE, a biased router and biased, clamped experts.

Tolerances: fp32 within 1e-5 absolute of transformers (observed ~1e-7: only summation orders differ).
"""

import contextlib
import copy
import dataclasses
import json
import math

import numpy as np
import pytest
import torch

import kernels
from trainer.build import load_pretrained, read_model_files, save_pretrained
from trainer.data.tokenizer import byte_level_tokenizer
from trainer.model.causal_lm import CausalLM, ModelConfig, ModelError

transformers = pytest.importorskip("transformers")

V, T = 300, 12
BASE = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
YARN = dict(
    rope_type="yarn",
    rope_theta=1000.0,
    factor=4.0,
    beta_fast=8.0,
    beta_slow=1.0,
    original_max_position_embeddings=32,
    truncate=False,
)
HYBRID = dict(  # Qwen3.5's family, its layers linear, full, linear (norm_topk_prob off: Qwen3.5-MoE ignores it)
    head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    num_experts=5,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=40,
    norm_topk_prob=False,
)
ARCHS = {
    # every other layer routed (decoder_sparse_step 2) but for layer 1, dense (mlp_only_layers): layer 2 alone is
    # MoE... and layer 0 is too with step 1: both rules exercised across the two qwen3_moe cases
    "qwen3_moe": lambda **kw: transformers.Qwen3MoeConfig(
        **{
            **BASE,
            "head_dim": 16,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 24,
            "mlp_only_layers": [1],
            "attention_bias": True,
            **kw,
        }
    ),
    "qwen3_moe-norm-step2": lambda **kw: transformers.Qwen3MoeConfig(
        **{
            **BASE,
            "num_experts": 5,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 20,
            "norm_topk_prob": True,
            "decoder_sparse_step": 2,
            **kw,
        }
    ),
    "mixtral": lambda **kw: transformers.MixtralConfig(
        **{**BASE, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 5, **kw}
    ),
    # layers sliding (window 4 < T), full, sliding; YaRN over an original context of 32 (factor 4 = 128 / 32), its
    # ramp between the interpolated and the kept frequencies inside the 8 frequencies of a 16-wide head
    "gpt_oss": lambda **kw: transformers.GptOssConfig(
        **{
            **BASE,
            "head_dim": 16,
            "num_local_experts": 6,
            "num_experts_per_tok": 2,
            "sliding_window": 4,
            "router_aux_loss_coef": 0.9,
            "rope_parameters": YARN,
            **kw,
        }
    ),
    # the hybrid MoE types: Gated DeltaNet, gated attention, routed experts beside a gated shared expert; Qwen3-Next's
    # fused in_proj_qkvz / in_proj_ba and a dense layer 1 (mlp_only_layers), Qwen3.5-MoE's always-renormalised router
    "qwen3_next": lambda **kw: transformers.Qwen3NextConfig(**{**BASE, **HYBRID, "mlp_only_layers": [1], **kw}),
    "qwen3_5_moe_text": lambda **kw: transformers.Qwen3_5MoeTextConfig(
        **{**{k: v for k, v in BASE.items() if k != "intermediate_size"}, **HYBRID, "num_experts_per_tok": 3, **kw}
    ),
}


# two logged SGD-sized steps of the Trainer, nothing saved
TWO_STEPS = dict(
    max_steps=2,
    per_device_train_batch_size=2,
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    learning_rate=1e-2,
)


def _two_steps(out, **kw):
    from trainer.config.args import TrainingArguments

    return TrainingArguments(output_dir=str(out), **TWO_STEPS, **kw)


def hf_model(arch, seed=0, **kw):
    """A transformers model with every parameter random (norm scales around 1: the zero-centred norms' weights of
    the hybrid types around 0), fp32, eval mode."""
    torch.manual_seed(seed)
    config = ARCHS[arch](**{"output_router_logits": True, **kw})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    centred = "linear_attention" in (getattr(config, "layer_types", None) or ())
    with torch.no_grad():
        for name, p in model.named_parameters():
            around_one = name.endswith("norm.weight") and not (centred and not name.endswith("linear_attn.norm.weight"))
            p.copy_(around_one + 0.1 * torch.randn_like(p))
    return model


def batch(seed=1, b=2, t=T):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (b, t), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    return ids, labels


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_loss_aux_loss_and_gradients_equal_transformers_fp32(arch, tmp_path):
    hf = hf_model(arch)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, use_kernels=False).eval()
    assert set(ours.state_dict()) == set(hf.state_dict())  # transformers 5's in-memory names: 3-D expert tensors
    moe = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert [i for i, m in enumerate(ours.config.layer_moe) if m] == moe and moe
    ids, labels = batch()
    ref, out = hf(ids, labels=labels), ours(ids, labels=labels)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=0)
    assert ref.aux_loss > 0.5  # a real term (E x sum f p is 1 for a perfectly balanced router)
    ref.loss.backward()
    out.loss.backward()
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, hf_params[name].grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_without_output_router_logits_no_aux_term(arch, tmp_path):
    hf = hf_model(arch, output_router_logits=False)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, use_kernels=False).eval()
    ids, labels = batch()
    out = ours(ids, labels=labels)
    assert out.aux_loss is None
    torch.testing.assert_close(out.loss, hf(ids, labels=labels).loss, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss", "qwen3_next", "qwen3_5_moe_text"])
def test_save_writes_transformers_files_and_transformers_loads_them(arch, tmp_path):
    hf = hf_model(arch)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf", use_kernels=False)
    save_pretrained(ours, tmp_path / "ours", tokenizer=byte_level_tokenizer())
    from safetensors import safe_open

    def keys(path):
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}

    assert keys(tmp_path / "ours") == keys(tmp_path / "hf")  # one 2-D weight per expert (gpt_oss: 3-D), as transformers
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert back.config.output_router_logits and back.config.num_experts_per_tok == hf.config.num_experts_per_tok
    ids, _ = batch()
    torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=0, rtol=0)
    read_model_files(str(tmp_path / "ours"))  # the headers check against our config


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_is_left_out_of_the_router_statistics_as_transformers_does(side, tmp_path):
    hf = hf_model("qwen3_moe")
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, use_kernels=False).eval()
    ids, labels = batch()
    mask = torch.ones_like(ids)
    pad = slice(0, 4) if side == "left" else slice(T - 4, T)
    mask[1, pad] = 0
    labels[1, pad] = -100
    ref, out = hf(ids, attention_mask=mask, labels=labels), ours(ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=0)
    unmasked = ours(ids, labels=labels)
    assert (unmasked.aux_loss - out.aux_loss).abs() > 1e-4  # the mask changed the statistics


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_kernels_on_and_off_and_checkpointing_same_loss_and_gradients(arch, tmp_path):
    hf_model(arch).save_pretrained(tmp_path)
    ids, labels = batch()
    runs = []
    for use_kernels, checkpointing in ((False, False), (True, False), (True, True)):
        model = load_pretrained(tmp_path, use_kernels=use_kernels)
        model.set_gradient_checkpointing(checkpointing)
        loss = model(ids, labels=labels).loss
        loss.backward()
        runs.append((loss, {n: p.grad for n, p in model.named_parameters()}))
    for loss, grads in runs[1:]:
        torch.testing.assert_close(loss, runs[0][0], atol=1e-5, rtol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, runs[0][1][name], atol=1e-5, rtol=1e-4, msg=name)


def test_aux_loss_is_weighted_by_the_batch_share_of_its_window(tmp_path):
    """Under accumulation (num_items = the window's targets) the aux term is this batch's share of it, as the main
    loss is: two half-window batches add up to the whole window's term when their aux losses are equal."""
    hf_model("qwen3_moe").save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, use_kernels=False).eval()
    ids, labels = batch()
    whole = model(ids, labels=labels)
    targets = int((labels[:, 1:] != -100).sum())
    half = model(ids, labels=labels, num_items=2 * targets)  # this batch is half of a window of two alike
    coef = model.config.router_aux_loss_coef
    torch.testing.assert_close(half.loss, (whole.loss - coef * whole.aux_loss) / 2 + coef * whole.aux_loss / 2)


def test_config_round_trip_and_bad_moe_configs(tmp_path):
    hf = hf_model("mixtral")
    config = ModelConfig.from_hf(hf.config.to_dict())
    assert config.num_experts == 4 and config.expert_size == 48 and all(config.layer_moe)
    assert ModelConfig.from_hf(config.to_hf()) == config
    qwen = ModelConfig.from_hf(hf_model("qwen3_moe-norm-step2").config.to_dict())
    assert qwen.layer_moe == (False, True, False) and qwen.norm_topk_prob and qwen.expert_size == 20
    assert ModelConfig.from_hf(qwen.to_hf()) == qwen
    with pytest.raises(ModelError, match="router_jitter_noise 0.1 is not supported"):
        ModelConfig.from_hf({**hf.config.to_dict(), "router_jitter_noise": 0.1})
    with pytest.raises(ModelError, match="num_experts_per_tok 5 exceeds num_experts 4"):
        ModelConfig.from_hf({**hf.config.to_dict(), "num_experts_per_tok": 5})
    model = CausalLM(config)
    model.init_weights(seed=3)
    assert model.model.layers[0].mlp.experts.gate_up_proj.std().item() == pytest.approx(0.02, rel=0.1)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss", "qwen3_next", "qwen3_5_moe_text"])
def test_kernels_through_the_interpreter_match_transformers(arch, tmp_path):
    """use_kernels with every Triton kernel (the interpreter), the grouped expert GEMMs among them: the loss with its
    aux term, the logits and every parameter's gradient (routers included) those of transformers in fp32."""
    import kernels

    hf = hf_model(arch)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, use_kernels=True).eval()
    ids, labels = batch()
    ref = hf(ids, labels=labels)
    ref.loss.backward()
    with kernels.backend("triton"):
        out = ours(ids, labels=labels)
        seen, stack = set(), [out.loss.grad_fn]
        while stack:  # the autograd graph
            node = stack.pop()
            if node is not None and node not in seen:
                seen.add(node)
                stack.extend(n for n, _ in node.next_functions)
        out.loss.backward()
    assert sum(type(n).__name__ == "MoEExpertsFunctionBackward" for n in seen) == sum(ours.config.layer_moe)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=0)
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        want = hf_params[name].grad
        torch.testing.assert_close(p.grad, want, atol=2e-5 * want.abs().max().item(), rtol=0, msg=name)


def test_the_first_line_says_experts_and_which_aux_coefficient_applies(tmp_path):
    from trainer.cli import model_line

    hf_model("mixtral").save_pretrained(tmp_path / "on")
    hf_model("qwen3_moe", output_router_logits=False).save_pretrained(tmp_path / "off")
    on, off = (model_line(load_pretrained(tmp_path / name)) for name in ("on", "off"))
    assert on.startswith("our model: mixtral") and on.endswith(
        "mixture of experts: 3 layers of 4 experts, 2 per token through the expert loop in PyTorch, "
        "load-balancing loss x router_aux_loss_coef 0.001"
    )
    assert off.endswith(
        "2 layers of 6 experts, 2 per token through the expert loop in PyTorch, no load-balancing "
        "loss (output_router_logits false)"
    )


def test_the_trainer_logs_the_aux_loss_beside_the_loss(tmp_path):
    """With output_router_logits the training log has aux_loss (the mean of the batches' load-balancing losses since
    the last log), its term already in loss; without it, no aux_loss key."""
    from tests.trainer.loop.test_golden import _examples
    from trainer.config.args import TrainingArguments
    from trainer.data.sft_data import TokenizedDataset
    from trainer.loop.trainer import Trainer

    hf_model("qwen3_moe").save_pretrained(tmp_path / "on")
    hf_model("qwen3_moe", output_router_logits=False).save_pretrained(tmp_path / "off")
    logs = {}
    for name in ("on", "off"):
        args = TrainingArguments(
            output_dir=str(tmp_path / f"out-{name}"),
            max_steps=2,
            logging_steps=1,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            report_to="none",
            save_strategy="no",
            learning_rate=1e-3,
        )
        trainer = Trainer(
            model=load_pretrained(tmp_path / name),
            args=args,
            train_dataset=TokenizedDataset.from_examples(_examples(n=8)),
        )
        trainer.train()
        logs[name] = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs["on"]) == 2 and all(h["aux_loss"] > 0.5 for h in logs["on"])
    assert not any("aux_loss" in h for h in logs["off"])


def test_under_autocast_the_experts_multiply_in_the_autocast_dtype(tmp_path, monkeypatch):
    """bf16 autocast: the grouped GEMMs get the tokens in bf16 (as autocast gives a matmul its input; the fp32 master
    weights are cast tile by tile inside the kernels), and the loss and gradients come out close to the reference path
    under the same autocast (through the interpreter)."""
    import kernels
    import trainer.model.moe as moe_module

    hf_model("mixtral").save_pretrained(tmp_path)
    ids, labels = batch()
    seen, original = [], kernels.moe_experts

    def recording(x, *args, **kwargs):
        seen.append(x.dtype)
        return original(x, *args, **kwargs)

    monkeypatch.setattr(moe_module.kernels, "moe_experts", recording, raising=True)
    ref, ours = load_pretrained(tmp_path, use_kernels=False), load_pretrained(tmp_path, use_kernels=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(ids, labels=labels).loss
        with kernels.backend("triton"):
            got = ours(ids, labels=labels).loss
            got.backward()
    assert seen == [torch.bfloat16] * 3
    torch.testing.assert_close(got, want, atol=0.02, rtol=0)
    assert all(p.grad.dtype == torch.float32 and p.grad.isfinite().all() for p in ours.parameters())


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss", "qwen3_next"])
def test_greedy_generate_matches_full_recompute_and_transformers(arch, tmp_path):
    """Decoding our Mixtral (a window of 5 under 15 tokens), gpt-oss (windows of 4, sinks in every softmax) and
    Qwen3-Next (Gated DeltaNet states, a shared expert) through the KV cache: the tokens of the full recompute and of
    transformers' generate."""
    from trainer.model.causal_lm import generate

    hf = hf_model(arch)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, use_kernels=False)
    prompt = batch(b=1, t=5)[0]
    new = generate(ours, prompt[0].tolist(), 10)
    ids = prompt
    for _ in range(10):  # no cache: the whole forward each step
        ids = torch.cat([ids, ours.eval()(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert new == ids[0, 5:].tolist()
    hf.generation_config.eos_token_id = None
    assert torch.equal(
        generate(ours, prompt, 10), hf.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    )


def test_dpo_adds_and_logs_the_aux_loss(tmp_path):
    """DPO on our MoE with output_router_logits: each step's loss holds router_aux_loss_coef x aux on top of the
    preference loss (as TRL's DPOTrainer adds it), and the log has aux_loss."""
    import json

    from tests.trainer.methods.test_preference import make_args
    from trainer.data.preference_data import load_preference_dataset
    from trainer.data.tasks import generate_tasks, preference_pair
    from trainer.data.tokenizer import byte_level_tokenizer
    from trainer.methods.preference import PreferenceArguments, PreferenceTrainer

    hf_model("qwen3_moe", vocab_size=320).save_pretrained(tmp_path / "model")
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(preference_pair(ex)) + "\n" for ex in generate_tasks(8, 4)))
    pairs = load_preference_dataset(path, byte_level_tokenizer(), show_progress=False)
    trainer = PreferenceTrainer(
        model=load_pretrained(tmp_path / "model", use_kernels=False),
        args=make_args(tmp_path, max_steps=1, learning_rate=0.0),
        pref=PreferenceArguments(),
        train_dataset=pairs,
        processing_class=byte_level_tokenizer(),
    )
    trainer.train()
    log = next(h for h in trainer.state.log_history if "loss" in h)
    assert log["aux_loss"] > 0.5
    # at step 0 the policy is its reference: the sigmoid loss is log 2, the aux term on top
    assert log["loss"] == pytest.approx(0.6931472 + 0.001 * log["aux_loss"], abs=1e-5)


# gpt_oss: (E, in, out) tensors, peft's is_transposed; qwen3_next: a shared expert beside them
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "qwen3_next"])
def test_lora_on_the_experts_trains_and_peft_loads_it_over_transformers(arch, tmp_path):
    """peft's target_parameters on our experts (`--lora_target_parameters mlp.experts.gate_up_proj
    mlp.experts.down_proj`, beside attention LoRA): two steps train the adapter (run as rank-r GEMMs on the routed
    rows: peft's whole delta is never formed); the adapter files carry peft's nested keys, and peft loads them over
    transformers' model with our logits; `python -m trainer.merge` writes merged experts that transformers loads with
    the same logits. Dropout there is a one-line error."""
    import peft

    from tests.trainer.loop.test_golden import _examples
    from trainer.data.sft_data import TokenizedDataset
    from trainer.loop.trainer import Trainer
    from trainer.model.lora import apply_lora, load_adapter

    hf = hf_model(arch, vocab_size=320)
    hf.save_pretrained(tmp_path / "base")
    byte_level_tokenizer().save_pretrained(tmp_path / "base")  # the merge command copies it
    lora = dict(use_peft=True, lora_r=2, lora_alpha=4, lora_dropout=0.0, lora_target_modules=["q_proj", "v_proj"])
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    args = _two_steps(tmp_path / "out", lora_target_parameters=experts, **lora)
    model = apply_lora(load_pretrained(tmp_path / "base", use_kernels=False), args)
    with _no_whole_delta():
        Trainer(model=model, args=args, train_dataset=TokenizedDataset.from_examples(_examples(n=4))).train()
    Trainer(model=model, args=args).save_model(tmp_path / "adapter")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as f:
        keys = [k for k in f.keys() if ".mlp." in k and "layers.0." in k]
    assert sorted(keys) == sorted(
        f"base_model.model.model.layers.0.mlp.experts.{inner}lora_{ab}.weight"
        for inner in ("", "base_layer.")
        for ab in "AB"
    )
    ours = load_adapter(load_pretrained(tmp_path / "base", use_kernels=False), tmp_path / "adapter").eval()
    theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids, _ = batch()
    with torch.no_grad():
        got, want = ours(ids).logits, theirs(input_ids=ids).logits
        with theirs.disable_adapter():
            base = theirs(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (want - base).abs().max() > 1e-3  # the experts' adapter trained
    from trainer.merge import main as merge

    assert (
        merge(
            ["--model", str(tmp_path / "base"), "--adapter", str(tmp_path / "adapter")]
            + ["--output_dir", str(tmp_path / "merged")]
        )
        == 0
    )
    flat = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(flat(input_ids=ids).logits, want, atol=1e-5, rtol=0)


@contextlib.contextmanager
def _no_whole_delta():
    """peft's ParamWrapper forms the (E, out, in) delta through these two; inside the block they raise."""
    from peft.tuners.lora.layer import ParamWrapper

    def refuse(*args, **kwargs):
        raise AssertionError("peft formed the experts' whole LoRA delta")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(ParamWrapper, "get_delta_weight", refuse)
        m.setattr(ParamWrapper, "get_delta_factors", refuse)
        yield


@pytest.mark.parametrize(
    "arch, interpret",
    [("qwen3_moe", False), ("qwen3_moe", True), ("gpt_oss", True)],
    ids=["qwen3_moe-reference", "qwen3_moe-triton-interpreter", "gpt_oss-triton-interpreter"],
)
def test_expert_lora_as_rank_gemms_equals_peft_forming_the_delta(arch, interpret, tmp_path):
    """Our experts with peft's target_parameters adapter run the factors as rank-r GEMMs (kernels.moe.ExpertLoRA);
    `fused_lora = False` keeps peft's ParamWrappers (the whole delta added to the weight each forward): the same
    loss and the same gradient of every adapter weight, fp32, on the reference and the Triton kernels."""
    from trainer.config.args import TrainingArguments
    from trainer.model.lora import apply_lora

    hf_model(arch).save_pretrained(tmp_path)
    args = TrainingArguments(
        output_dir="unused",
        use_peft=True,
        lora_r=3,
        lora_alpha=6,
        lora_dropout=0.0,
        lora_target_modules=["q_proj"],
        lora_target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    ours = apply_lora(load_pretrained(tmp_path, use_kernels=interpret), args)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    ids, labels = batch()
    results = []
    for fused in (True, False):
        ours.fused_lora = fused
        ours.zero_grad()
        with (
            kernels.backend("triton" if interpret else "auto"),
            _no_whole_delta() if fused else contextlib.nullcontext(),
        ):
            loss = ours(ids, labels=labels).loss
            loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in ours.named_parameters() if p.requires_grad}))
    (loss, grads), (peft_loss, peft_grads) = results
    torch.testing.assert_close(loss, peft_loss, atol=1e-5, rtol=0)
    assert any(".mlp.experts.base_layer.lora_A" in n for n in grads) and grads.keys() == peft_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(
            grad, peft_grads[name], atol=1e-5 * peft_grads[name].abs().max().item() + 1e-7, rtol=0, msg=name
        )


def test_lora_dropout_with_target_parameters_is_one_line():
    from trainer.coerce import ConfigError
    from trainer.config.args import TrainingArguments

    with pytest.raises(
        ConfigError, match=r"^lora_dropout=0.05: peft's LoRA on lora_target_parameters .* --lora_dropout 0$"
    ):
        TrainingArguments(output_dir="unused", use_peft=True, lora_target_parameters=["mlp.experts.gate_up_proj"])


def test_lora_dropout_with_all_linear_on_experts_is_one_line_before_the_build(tmp_path, capsys):
    """all-linear (TRL's default dropout 0.05) on a model whose experts and router peft adapts as target_parameters:
    the command's one line and exit 2, nothing written; with --lora_dropout 0 the same arguments pass the check, and
    on gpt_oss (no such conversion) dropout stays allowed."""
    from trainer import sft

    hf_model("qwen3_next", vocab_size=320).save_pretrained(tmp_path / "next")
    hf_model("gpt_oss", vocab_size=320).save_pretrained(tmp_path / "oss")
    for path in ("next", "oss"):
        byte_level_tokenizer().save_pretrained(tmp_path / path)
    lora = ["--use_peft", "--lora_target_modules", "all-linear", "--max_steps", "1", "--cutoff_len", "32"]
    out = tmp_path / "out"
    assert sft.main(["--model", str(tmp_path / "next"), *lora, "--output_dir", str(out)]) == 2
    assert not out.exists()
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .startswith(
            "error: lora_dropout=0.05: on a qwen3_next, peft turns the targets gate_proj, up_proj, down_proj, gate into"
        )
    )
    from trainer.cli_args import _check_lora
    from trainer.config.args import TrainingArguments

    for path, dropout in (("next", 0.0), ("oss", 0.05)):
        args = TrainingArguments(output_dir=str(out), use_peft=True, lora_target_modules=["all-linear"])
        args.lora_dropout = dropout
        _check_lora(args, type("Sft", (), {"model": str(tmp_path / path)})())


def test_base_names_under_nested_peft_wrappers():
    from trainer.model.lora import base_name

    nested = "model.layers.0.mlp.experts.base_layer.base_layer.gate_up_proj"  # two target_parameters on one module
    assert base_name(nested) == "model.layers.0.mlp.experts.gate_up_proj"
    assert base_name("model.layers.0.self_attn.q_proj.base_layer.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert base_name("model.norm.original_module.weight") == "model.norm.weight"
    assert base_name("model.layers.0.mlp.experts.lora_A.default.weight") is None


# ---- QLoRA: the experts in 4 bits (trainer/model/quant.py's Experts4bit), the router in full precision -------------


def _qlora_args(out, **kw):
    from trainer.config.args import TrainingArguments

    return TrainingArguments(
        output_dir=str(out),
        use_peft=True,
        load_in_4bit=True,
        bnb_4bit_use_double_quant=True,
        lora_r=2,
        lora_alpha=4,
        lora_dropout=0.0,
        lora_target_modules=["q_proj"],
        lora_target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        **kw,
    )


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "qwen3_next"])
def test_qlora_quantizes_the_experts_not_the_router_and_trains_over_their_dequantized_values(
    arch, tmp_path, monkeypatch
):
    """load_in_4bit on our MoE: every expert tensor NF4 codes as it is read (per-expert files gathered, then
    quantized), the router a full-precision parameter; the loss and every adapter gradient equal those of the same
    adapter over plain experts holding dequantize(Q(W)) (the function QLoRA trains over); backward dequantizes the
    codes again rather than keeping the full-precision experts; merge writes dequantize(Q(W)) + s B A."""
    bnb = pytest.importorskip("bitsandbytes")
    from tests.bnb_paths import bnb_dequantize  # bitsandbytes' dequantization as every CPU can run it
    from trainer.build import build_model
    from trainer.model import quant
    from trainer.model.moe import Experts

    hf_model(arch, vocab_size=320).save_pretrained(tmp_path / "base")
    byte_level_tokenizer().save_pretrained(tmp_path / "base")
    args = _qlora_args(tmp_path / "out")
    ours, _ = build_model(str(tmp_path / "base"), args, device="cpu")
    four_bit = [m for m in ours.modules() if isinstance(m, quant.Experts4bit)]
    assert len(four_bit) == sum(ours.config.layer_moe) and not any(type(m) is Experts for m in ours.modules())
    for m in four_bit:
        assert all(isinstance(getattr(m, n), bnb.nn.Params4bit) for n in m.full_shapes)
    routers = [p for n, p in ours.named_parameters() if n.endswith(("mlp.gate.weight", "mlp.router.weight"))]
    assert routers and all(p.dtype == torch.float32 and not p.requires_grad for p in routers)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    for name, m in ours.named_modules():  # the checkpoint's tensors as bitsandbytes quantizes and dequantizes them
        if isinstance(m, quant.Experts4bit):
            hf_experts = hf.get_submodule(name.replace(".base_layer", ""))
            for n in m.full_shapes:
                full = hf_experts.get_parameter(n).detach()
                codes, state = bnb.functional.quantize_4bit(
                    full, blocksize=64, compress_statistics=True, quant_type="nf4"
                )
                assert torch.equal(m.dequantized(n), bnb_dequantize(codes, state, "fallback"))  # (every CPU's)
                assert not torch.equal(m.dequantized(n), full)
    # the reference: the same model with every 4-bit tensor dequantized (attention's too), the same adapter
    plain = quant.dequantized(copy.deepcopy(ours))
    assert not quant.is_quantized(plain)
    ids, labels = batch()
    calls = []
    monkeypatch.setattr(quant.Experts4bit, "dequantized", _counting(quant.Experts4bit.dequantized, calls))
    loss = ours(ids, labels=labels).loss
    forward_calls = len(calls)
    loss.backward()
    assert forward_calls == 2 * len(four_bit)
    # backward dequantized again: every layer's down_proj (its adapters' gradients pass through it), and gate_up_proj
    # where the layer's input needs a gradient (not below the lowest adapter: qwen3_next's layer 0, under linear
    # attention without q_proj / v_proj)
    backward = calls[forward_calls:]
    assert backward.count("down_proj") == len(four_bit) and 0 < backward.count("gate_up_proj") <= len(four_bit)
    want = plain(ids, labels=labels).loss
    want.backward()
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=0)
    grads = {n: p.grad for n, p in plain.named_parameters() if p.requires_grad}
    assert any(".mlp.experts." in n for n in grads)
    for name, p in ours.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, grads[name], atol=1e-5 * grads[name].abs().max().item() + 1e-7, rtol=0)
    # 0.5 bytes a value + the double-quantized scales: the experts' 4-bit bytes are counted
    expert_values = sum(math.prod(s) for m in four_bit for s in m.full_shapes.values())
    assert quant.quantized_bytes(ours) > 0.5 * expert_values


def test_qlora_experts_leave_their_other_saves_to_checkpointing_and_offloading(tmp_path, monkeypatch):
    """Experts4bit's own saved-tensor hooks (the dequantized experts saved as names) hand every other save to the
    hooks around the call: under gradient checkpointing no tensor the 4-bit experts made outlives forward but the last
    layer's output (the block's recompute makes what backward needs again), as with plain experts; before, the inner
    hooks took those saves from checkpoint's and kept every one, the routed rows of every layer. Without checkpointing
    they are kept for backward. The loss and every adapter gradient equal those without checkpointing. Activation
    offloading's hooks are handed the experts' saves the same way."""
    pytest.importorskip("bitsandbytes")
    import gc
    import weakref

    from torch.overrides import TorchFunctionMode

    from trainer.build import build_model
    from trainer.model import quant
    from trainer.model.offload import ActivationOffloader

    class Made(TorchFunctionMode):  # weak references to every tensor an op makes inside the 4-bit experts' forward
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            made.extend(weakref.ref(t) for t in (out if isinstance(out, tuple) else (out,)) if torch.is_tensor(t))
            return out

    made, running = [], []
    forward = quant.Experts4bit.forward

    def recorded(self, *args):
        running.append(self)
        try:
            with Made():
                return forward(self, *args)
        finally:
            running.pop()

    monkeypatch.setattr(quant.Experts4bit, "forward", recorded)
    hf_model("qwen3_moe", vocab_size=320).save_pretrained(tmp_path / "base")
    byte_level_tokenizer().save_pretrained(tmp_path / "base")
    ids, labels = batch()
    results = {}
    for checkpointing in (False, True):
        ours, _ = build_model(str(tmp_path / "base"), _qlora_args(tmp_path / "out"), device="cpu")
        ours.set_gradient_checkpointing(checkpointing)
        made.clear()
        loss = ours(ids, labels=labels).loss
        gc.collect()
        kept = [ref() for ref in made if ref() is not None and ref().dim()]  # not the 0-d constants
        if checkpointing:  # the last layer's output alone, which the final norm (outside every checkpoint) keeps
            assert [tuple(t.shape) for t in kept] == [(ids.numel(), ours.config.hidden_size)], [t.shape for t in kept]
        else:
            assert len(kept) > 1
        del kept
        loss.backward()
        results[checkpointing] = loss.detach(), {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    (plain_loss, plain_grads), (loss, grads) = results[False], results[True]
    torch.testing.assert_close(loss, plain_loss, atol=1e-6, rtol=0)
    assert any(".mlp.experts." in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], atol=1e-6 * plain_grads[name].abs().max().item(), rtol=0)
    # activation offloading's hooks get them too (here, without checkpointing, where nothing else takes them)
    packed_inside = []  # per save the offloader packs: whether it was made inside the 4-bit experts
    pack = ActivationOffloader.pack
    monkeypatch.setattr(
        ActivationOffloader, "pack", lambda self, t: packed_inside.append(bool(running)) or pack(self, t)
    )
    ours.set_gradient_checkpointing(False)
    offloader = ActivationOffloader.for_model(ours, "cpu", min_bytes=0)
    with offloader():
        loss = ours(ids, labels=labels).loss
    loss.backward()
    assert any(packed_inside) and not all(packed_inside)


def _counting(fn, calls):
    def counted(self, name):
        calls.append(name)
        return fn(self, name)

    return counted


def test_qlora_experts_train_and_merge_over_their_dequantized_values(tmp_path):
    pytest.importorskip("bitsandbytes")
    from tests.trainer.loop.test_golden import _examples
    from trainer.build import build_model
    from trainer.data.sft_data import TokenizedDataset
    from trainer.loop.trainer import Trainer
    from trainer.merge import main as merge
    from trainer.model import quant
    from trainer.model.lora import load_adapter

    hf_model("qwen3_moe", vocab_size=320).save_pretrained(tmp_path / "base")
    byte_level_tokenizer().save_pretrained(tmp_path / "base")
    args = _qlora_args(tmp_path / "out", **TWO_STEPS)
    ours, _ = build_model(str(tmp_path / "base"), args, device="cpu")
    Trainer(model=ours, args=args, train_dataset=TokenizedDataset.from_examples(_examples(n=4))).train()
    Trainer(model=ours, args=args).save_model(tmp_path / "adapter")
    assert (
        merge(
            [
                "--model",
                str(tmp_path / "base"),
                "--adapter",
                str(tmp_path / "adapter"),
                "--output_dir",
                str(tmp_path / "merged"),
            ]
        )
        == 0
    )
    flat = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    reloaded = load_adapter(load_pretrained(tmp_path / "base", use_kernels=False), tmp_path / "adapter").eval()
    assert any(isinstance(m, quant.Experts4bit) for m in reloaded.modules())
    ids, _ = batch()
    with torch.no_grad():
        got = ours.eval()(ids).logits
        torch.testing.assert_close(flat(input_ids=ids).logits, got, atol=1e-5, rtol=0)
        # the adapter loaded for generation over the base, quantized as it was trained (experts in 4 bits again)
        torch.testing.assert_close(reloaded(ids).logits, got, atol=1e-6, rtol=0)


def test_qlora_experts_under_zero3_are_one_line(tmp_path):
    """4-bit experts train under FSDP2 and ZeRO-2 (tests/trainer/parallel); under ZeRO-3 peft's layers run (DeepSpeed
    hooks every module) and cannot adapt 4-bit experts: one line, before anything is quantized."""
    pytest.importorskip("bitsandbytes")
    from trainer.coerce import ConfigError
    from trainer.model import quant
    from trainer.parallel import transforms

    for stage in (3, 2):
        config = tmp_path / f"zero{stage}.json"
        config.write_text(json.dumps({"zero_optimization": {"stage": stage}}))
        model = CausalLM(ModelConfig.from_hf(hf_model("qwen3_moe").config.to_dict()), use_kernels=False)
        args = _qlora_args("unused", deepspeed=str(config))
        if stage == 3:
            with pytest.raises(ConfigError, match=r"^load_in_4bit: the 4-bit experts .* not under DeepSpeed ZeRO-3"):
                transforms.apply_transforms(model, args)
            assert not quant.is_quantized(model)
        else:
            assert quant.is_quantized(transforms.apply_transforms(model, args))


def test_the_command_refuses_4bit_experts_under_zero3_before_reading_data(tmp_path, capsys):
    """The same line from the sft command, from the model's config.json: exit 2 before the data are read (a data file
    that would fail to parse is never opened) and nothing written."""
    from trainer import sft

    hf_model("qwen3_moe").save_pretrained(tmp_path / "model")
    byte_level_tokenizer().save_pretrained(tmp_path / "model")
    capsys.readouterr()  # transformers' progress bars
    (tmp_path / "zero3.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    (tmp_path / "bad.jsonl").write_text("not json\n")
    argv = ["--model", str(tmp_path / "model"), "--data", str(tmp_path / "bad.jsonl"), "--output_dir"]
    argv += [str(tmp_path / "out"), "--use_peft", "--load_in_4bit", "--lora_dropout", "0", "--lora_target_modules"]
    argv += ["all-linear", "--deepspeed"]
    assert sft.main([*argv, str(tmp_path / "zero3.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: load_in_4bit: the 4-bit experts") and "Traceback" not in "".join(err), err
    assert not (tmp_path / "out").exists()


# ---- gpt_oss -----------------------------------------------------------------------------------------------------
def test_gpt_oss_config_round_trip_and_what_it_derives():
    hf = hf_model("gpt_oss")
    config = ModelConfig.from_hf(hf.config.to_dict())
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert config.layer_windows == (4, None, 4) and config.attention_sinks and config.qkv_bias and config.o_bias
    assert config.num_experts == 6 and config.expert_size == 48 and all(config.layer_moe)
    assert config.router_aux_loss_coef == 0.9 and config.swiglu_limit == 7.0 and config.swiglu_alpha == 1.702
    assert config.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 8.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 32,
    }
    assert ModelConfig.from_hf(config.to_hf()) == config
    # a config.json without rope parameters takes GptOssConfig's default (the released models' YaRN)
    bare = {k: v for k, v in hf.config.to_dict().items() if k not in ("rope_parameters", "rope_scaling")}
    rope = ModelConfig.from_hf(bare).rope_scaling
    assert rope["factor"] == 32.0 and rope["original_max_position_embeddings"] == 4096 and not rope["truncate"]
    with pytest.raises(ModelError, match="rope_scaling 'yarn' needs a number for 'factor'"):
        ModelConfig.from_hf({**bare, "rope_parameters": {"rope_type": "yarn"}})


def _per_sequence(hf, seqs):
    """transformers' logits of each sequence alone (B = 1, no padding): the oracle for packed and padded rows."""
    with torch.no_grad():
        return [hf(s[None]).logits[0] for s in seqs]


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_gpt_oss_packed_and_padded_rows_are_transformers_per_sequence(backend, tmp_path):
    """Two documents packed in one row (position_ids restarting), and a right- and a left-padded row: each real
    token's logits are those transformers gives its sequence alone (windows of 4 inside documents of 5 to 9 tokens, the
    sinks in every softmax). sdpa (the CPU path, per document) and flex (eager on CPU, forward only: its backward
    needs CUDA) alike."""
    hf = hf_model("gpt_oss")
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, use_kernels=False).eval()
    ours.attn_backend = backend
    g = torch.Generator().manual_seed(2)
    a, b, c = (torch.randint(0, V, (n,), generator=g) for n in (7, 9, 5))
    want_a, want_b, want_c = _per_sequence(hf, (a, b, c))
    with torch.no_grad():
        packed = ours(torch.cat([a, b])[None], position_ids=torch.cat([torch.arange(7), torch.arange(9)])[None])
        torch.testing.assert_close(packed.logits[0], torch.cat([want_a, want_b]), atol=1e-5, rtol=0)
        ids = torch.zeros(2, 9, dtype=torch.long)
        mask = torch.zeros(2, 9, dtype=torch.long)
        ids[0, :5], mask[0, :5] = c, 1  # right padding
        ids[1, 2:], mask[1, 2:] = a, 1  # left padding
        padded = ours(ids, attention_mask=mask).logits
    torch.testing.assert_close(padded[0, :5], want_c, atol=1e-5, rtol=0)
    torch.testing.assert_close(padded[1, 2:], want_a, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "arch, backend",
    [("gpt_oss", "torch"), ("qwen3_next", "torch"), ("qwen3_next", "triton"), ("qwen3_5_moe_text", "torch")],
)
def test_packed_gradients_are_the_sum_of_per_sequence_ones(arch, backend, tmp_path):
    """A packed row's loss and every gradient are what transformers gives the two sequences' summed losses, alone
    (without the load-balancing term, formed over the whole batch): gpt-oss's sinks and windows, Qwen3-Next's and
    Qwen3.5-MoE's Gated DeltaNet restarting at the boundary (padding_free), routers and shared experts included; with
    our Triton kernels through the interpreter too."""
    hf = hf_model(arch, output_router_logits=False)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, use_kernels=backend == "triton").eval()
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, V, (7,), generator=g), torch.randint(0, V, (9,), generator=g)
    pos = torch.cat([torch.arange(7), torch.arange(9)])[None]
    labels = torch.cat([a, b])[None].clone()
    labels[0, 7] = -100  # b's first token is no target of a's last (transformers' losses of each alone)
    with kernels.backend("triton" if backend == "triton" else "auto"):
        out = ours(torch.cat([a, b])[None], position_ids=pos, labels=labels, num_items=6 + 8)
        out.loss.backward()
    total = sum(hf(s[None], labels=s[None], num_items_in_batch=torch.tensor(14)).loss for s in (a, b))
    total.backward()
    torch.testing.assert_close(out.loss, total, atol=1e-5, rtol=0)
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        want = hf_params[name].grad
        torch.testing.assert_close(p.grad, want, atol=2e-5 * want.abs().max().item(), rtol=1e-4, msg=name)


def test_a_multimodal_qwen3_5_moe_checkpoint_trains_its_text_model(tmp_path):
    """A released Qwen3.5-MoE checkpoint is `qwen3_5_moe`: a vision tower beside the text model. Ours reads its text
    model as transformers' AutoModelForCausalLM does (its logits and aux loss), and writes a qwen3_5_moe_text model
    that transformers loads with the same logits; the config round-trips and a missing shared-expert width is one
    line."""
    from trainer.cli import model_line

    text = ARCHS["qwen3_5_moe_text"](output_router_logits=True).to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    config = transformers.AutoConfig.for_model("qwen3_5_moe", text_config=text, vision_config=vision)
    torch.manual_seed(0)
    full = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in full.named_parameters():
            p.copy_(0.05 * torch.randn_like(p) + (name.endswith("norm.weight") and "visual" in name))
    full.save_pretrained(tmp_path / "mm")
    ours = load_pretrained(tmp_path / "mm", use_kernels=False).eval()
    assert ours.config.model_type == "qwen3_5_moe_text" and ours.config.text_of == "qwen3_5_moe"
    assert ours.config.norm_topk_prob and all(ours.config.layer_moe)  # its router always renormalises
    assert "; of the qwen3_5_moe checkpoint its text model only: the vision tower is neither trained nor saved" in (
        model_line(ours)
    )
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mm", dtype=torch.float32).eval()
    ids, labels = batch()
    ref, out = theirs(ids, labels=labels), ours(ids, labels=labels)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, atol=1e-6, rtol=0)
    save_pretrained(ours, tmp_path / "text")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text", dtype=torch.float32).eval()
    assert type(back).__name__ == "Qwen3_5MoeForCausalLM"
    torch.testing.assert_close(back(ids).logits, ref.logits, atol=1e-5, rtol=0)
    assert ModelConfig.from_hf(ours.config.to_hf()) == dataclasses.replace(ours.config, text_of=None)
    assert "intermediate_size" not in ours.config.to_hf()  # every layer routes: no dense width
    with pytest.raises(ModelError, match="shared_expert_intermediate_size must be a positive integer, got None"):
        ModelConfig.from_hf({**ours.config.to_hf(), "shared_expert_intermediate_size": None})
    next_config = ModelConfig.from_hf(hf_model("qwen3_next").config.to_dict())
    assert next_config.layer_moe == (True, False, True) and not next_config.norm_topk_prob
    assert ModelConfig.from_hf(next_config.to_hf()) == next_config


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe_text"])
def test_on_cuda_the_hybrid_moe_trains_in_bf16_as_transformers(arch, tmp_path):
    """On a GPU: our Qwen3-Next and Qwen3.5-MoE with every kernel of ours on (grouped GEMMs for the routed experts,
    the conv and gated norm in Triton, fla's recurrence where fla-core is installed) under bf16 autocast: the loss
    with its aux term within bf16 rounding of transformers' model in fp32, every gradient finite and close to its."""
    hf = hf_model(arch)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, device="cuda", use_kernels=True)
    hf = hf.cuda().train()
    ids, labels = (t.cuda() for t in batch())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = ours(ids, labels=labels).loss
    want = hf(ids, labels=labels).loss
    torch.testing.assert_close(got, want, rtol=2e-2, atol=0)
    got.backward()
    want.backward()
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.isfinite(p.grad).all(), name
        scale = theirs[name].grad.abs().max().item()
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=0, atol=5e-2 * scale + 1e-6, msg=name)


def test_sinks_are_never_dropped_by_a_backend_that_cannot_add_them():
    from trainer.model.attention import AttentionError, make_plan

    with pytest.raises(AttentionError, match="^attention backend 'flash' cannot add attention sinks"):
        make_plan(None, None, 1, 8, torch.device("cpu"), torch.bfloat16, backend="flash", sinks=True)
    assert make_plan(None, None, 1, 8, torch.device("cpu"), torch.float32, sinks=True).backend == "sdpa"


def test_mxfp4_dequantization_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from trainer.model.moe import dequantize_mxfp4

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 2, 16), generator=g, dtype=torch.uint8)  # every code, both nibbles
    scales = torch.randint(110, 140, (3, 40, 2), generator=g, dtype=torch.uint8)
    for dtype in (torch.bfloat16, torch.float32):
        want = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)  # (3, 64, 40)
        got = dequantize_mxfp4(blocks, scales, dtype)
        assert got.dtype == dtype and torch.equal(got, want)


def test_a_released_style_mxfp4_checkpoint_loads_dequantized(tmp_path):
    """A gpt-oss checkpoint as OpenAI released them (expert weights as `*_blocks` / `*_scales`, `quantization_config`
    mxfp4 in config.json; built here by packing random codes, as transformers cannot write one on CPU): our loader
    dequantizes each expert weight to what transformers' `convert_moe_packed_tensors` gives, checks the packed shapes
    from the headers, and the model then computes transformers' logits over those weights."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = hf_model("gpt_oss", intermediate_size=32)  # K a multiple of 32 in both expert weights
    hf.save_pretrained(tmp_path)
    tensors, g = load_file(str(tmp_path / "model.safetensors")), torch.Generator().manual_seed(1)
    for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, n = tensors.pop(name).shape
        blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(119, 125, (e, n, k // 32), generator=g, dtype=torch.uint8)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        with torch.no_grad():
            hf.get_parameter(name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").unlink(missing_ok=True)
    byte_level_tokenizer().save_pretrained(tmp_path)
    read_model_files(str(tmp_path))  # the packed headers check against our parameters
    ours = load_pretrained(tmp_path, use_kernels=False).eval()
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.equal(p, hf_params[name]), name
    ids, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)
    save_pretrained(ours, tmp_path / "saved")  # written back unpacked: transformers' own 3-D tensors
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert getattr(back.config, "quantization_config", None) is None
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)
    # QLoRA over it: each MXFP4 expert weight dequantized as read, then quantized to NF4 as bitsandbytes would
    bnb = pytest.importorskip("bitsandbytes")
    from tests.bnb_paths import bnb_dequantize  # bitsandbytes' dequantization as every CPU can run it
    from trainer.build import build_model
    from trainer.model.quant import Experts4bit

    qlora = build_model(str(tmp_path), _qlora_args(tmp_path / "out"), device="cpu")[0]
    four_bit = {n: m for n, m in qlora.named_modules() if isinstance(m, Experts4bit)}
    assert len(four_bit) == ours.config.num_hidden_layers
    for name, m in four_bit.items():
        for tensor in m.full_shapes:
            full = hf.get_submodule(name.replace(".base_layer", "")).get_parameter(tensor).detach()
            codes, state = bnb.functional.quantize_4bit(full, blocksize=64, compress_statistics=True, quant_type="nf4")
            assert torch.equal(m.dequantized(tensor), bnb_dequantize(codes, state, "fallback")), (name, tensor)


def test_gpt_oss_first_line_says_its_aux_coefficient(tmp_path):
    from trainer.cli import model_line

    hf_model("gpt_oss").save_pretrained(tmp_path)
    line = model_line(load_pretrained(tmp_path))
    assert line.startswith("our model: gpt_oss") and line.endswith(
        "mixture of experts: 3 layers of 6 experts, 2 per token through the expert loop in PyTorch, "
        "load-balancing loss x router_aux_loss_coef 0.9"
    )


ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}
EXPERTS = {"gate_up_proj", "down_proj", "gate.weight"}
# what peft's all-linear adapts on transformers' model: (target_modules, target_parameters) once peft has converted
# transformers 4's expert names (qwen3_moe, mixtral, qwen3_next: the expert tensors and the router, and no
# gate_proj / up_proj / down_proj anywhere, a shared expert's or a dense layer's included); gpt_oss and Qwen3.5-MoE
# have no such conversion: their nn.Linear layers alone
ALL_LINEAR = {
    "gpt_oss": (ATTENTION, set()),
    "qwen3_moe": (ATTENTION, EXPERTS),
    "mixtral": (ATTENTION, EXPERTS),
    "qwen3_next": (ATTENTION | {"in_proj_qkvz", "in_proj_ba", "out_proj", "shared_expert_gate"}, EXPERTS),
    "qwen3_5_moe_text": (
        ATTENTION
        | {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"}
        | {"gate_proj", "up_proj", "down_proj", "shared_expert_gate"},
        set(),
    ),
}


def _targets(config):
    """(the adapted layers' leaf names, the adapted parameters) of a LoraConfig as peft resolved it."""
    return {name.rsplit(".", 1)[-1] for name in config.target_modules}, set(config.target_parameters or ())


@pytest.mark.parametrize("arch", list(ALL_LINEAR))
def test_lora_all_linear_is_peft_s_and_peft_loads_it_over_transformers(arch, tmp_path):
    """all-linear adapts what peft's all-linear adapts on transformers' model (ALL_LINEAR: the experts and the router
    where peft converts their old names, at twice the rank on gate_up_proj); two steps train it, and peft loads the
    adapter over transformers' model with our logits."""
    import peft

    from tests.trainer.loop.test_golden import _examples
    from trainer.data.sft_data import TokenizedDataset
    from trainer.loop.trainer import Trainer
    from trainer.model.lora import apply_lora, load_adapter

    hf = hf_model(arch, vocab_size=320)
    hf.save_pretrained(tmp_path / "base")
    base = load_pretrained(tmp_path / "base", use_kernels=False)
    theirs = peft.get_peft_model(
        hf_model(arch, vocab_size=320), peft.LoraConfig(r=2, target_modules="all-linear")
    ).peft_config["default"]
    assert _targets(theirs) == ALL_LINEAR[arch]
    args = _two_steps(
        tmp_path / "out", use_peft=True, lora_r=2, lora_alpha=4, lora_dropout=0.0, lora_target_modules=["all-linear"]
    )
    model = apply_lora(base, args)
    ours_config = model.peft_config["default"]
    assert _targets(ours_config) == ALL_LINEAR[arch] and ours_config.rank_pattern == theirs.rank_pattern
    Trainer(model=model, args=args, train_dataset=TokenizedDataset.from_examples(_examples(n=4))).train()
    Trainer(model=model, args=args).save_model(tmp_path / "adapter")
    ours = load_adapter(load_pretrained(tmp_path / "base", use_kernels=False), tmp_path / "adapter").eval()
    loaded = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids, _ = batch()
    with torch.no_grad():
        got, want = ours(ids).logits, loaded(input_ids=ids).logits
        with loaded.disable_adapter():
            plain = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (want - plain).abs().max() > 1e-3  # the adapter trained


@pytest.mark.parametrize(
    "rope",
    [
        {
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
        {"factor": 8.0, "original_max_position_embeddings": 4096},  # defaults: betas 32 / 1, truncate
        {"factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.7, "original_max_position_embeddings": 4096},
        {"factor": 4.0, "attention_factor": 1.3, "original_max_position_embeddings": 4096},
    ],
)
def test_yarn_frequencies_and_attention_factor_are_transformers(rope):
    """YaRN at the released gpt-oss settings (the first) and its other options: our inverse frequencies bit for bit and
    the attention factor those of transformers' `_compute_yarn_parameters`; the config round-trips."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from trainer.model.causal_lm import RotaryEmbedding

    hf = transformers.GptOssConfig(
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, **rope},
    )
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    config = ModelConfig.from_hf(hf.to_dict())
    rotary = RotaryEmbedding(config)
    assert torch.equal(rotary.inv_freq, inv_freq) and rotary.attention_scaling == factor
    assert ModelConfig.from_hf(config.to_hf()) == config


# ---- router_aux_loss_coef (TRL's argument, LlamaFactory's moe_aux_loss_coef) ----------------------------------------


@pytest.mark.parametrize("model_impl", ["ours", "transformers"])
def test_router_aux_loss_coef_turns_the_router_loss_on_and_off_as_trl_sets_the_config(model_impl, tmp_path):
    """Set, the argument writes the config's output_router_logits (on unless 0) and coefficient, as TRL does: the
    loss is transformers' with those keys; unset, the config decides; on a model without routers it is one line."""
    from trainer.build import build_model
    from trainer.config.args import ConfigError, TrainingArguments, parse_args

    hf_model("qwen3_moe", output_router_logits=False).save_pretrained(tmp_path / "off")
    byte_level_tokenizer().save_pretrained(tmp_path / "off")
    ids, labels = batch()
    for coef in (None, 0.5, 0.0):
        args = TrainingArguments(output_dir="unused", router_aux_loss_coef=coef)
        ours = build_model(str(tmp_path / "off"), args, device="cpu", model_impl=model_impl)[0].eval()
        on = bool(coef)
        want_config = dict(output_router_logits=on, **({"router_aux_loss_coef": coef} if on else {}))
        want = hf_model("qwen3_moe", **want_config)(ids, labels=labels).loss
        torch.testing.assert_close(ours(ids, labels=labels).loss, want, atol=1e-5, rtol=0)
        assert ours.config.output_router_logits == on
    assert parse_args(["--moe_aux_loss_coef", "0.01", "--output_dir", "x"])[0].router_aux_loss_coef == 0.01
    with pytest.raises(ConfigError, match=r"^router_aux_loss_coef=-1.0: must be >= 0 \(0 turns the router loss off\)"):
        TrainingArguments(output_dir="x", router_aux_loss_coef=-1.0)
    with pytest.raises(ModelError, match=r"^router_aux_loss_coef=0.01: a llama model has no router"):
        CausalLM(ModelConfig.from_hf(transformers.LlamaConfig(**BASE).to_dict()), router_aux_loss_coef=0.01)
    # the command checks it first, before anything is built or written
    from trainer.cli_args import SFTArguments, _check_router_loss

    args = TrainingArguments(output_dir="unused", router_aux_loss_coef=0.01)
    with pytest.raises(ConfigError, match=r"^router_aux_loss_coef=0.01: a llama model has no router"):
        _check_router_loss(args, SFTArguments(model="tiny"))
    _check_router_loss(args, SFTArguments(model=str(tmp_path / "off")))  # a mixture of experts: fine


def test_grpo_adds_the_router_loss_over_the_accumulation_steps_as_trl(tmp_path):
    """TRL's GRPO adds router_aux_loss_coef x the micro batch's aux loss / gradient_accumulation_steps to the policy
    loss: one step of SGD with the term differs from one without by exactly -lr x coef x d aux / d w over the step's
    micro batches (the same completions both ways), and aux_loss is logged."""
    from tests.trainer.methods.test_grpo import distinct_chars
    from trainer.config.args import TrainingArguments
    from trainer.data.task_eval import held_out_conversations
    from trainer.data.tasks import TRAIN_FILE
    from trainer.methods.grpo import GRPOArguments, GRPOTrainer, prompts_from_conversations

    hf_model("qwen3_moe", vocab_size=320).save_pretrained(tmp_path / "base")
    prompts = prompts_from_conversations(held_out_conversations([str(TRAIN_FILE)], 4))
    lr, coef, accum = 0.1, 0.5, 2
    runs = {}
    for c in (coef, 0.0):
        torch.manual_seed(0)
        args = TrainingArguments(
            output_dir=str(tmp_path / str(c)),
            per_device_train_batch_size=4,
            gradient_accumulation_steps=accum,
            max_steps=1,
            learning_rate=lr,
            optim="sgd",
            max_grad_norm=0.0,  # no clipping: the update is -lr x the gradient
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            router_aux_loss_coef=c,
        )
        model = load_pretrained(tmp_path / "base", use_kernels=False)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=distinct_chars,
            args=args,
            grpo=GRPOArguments(num_generations=4, max_completion_length=4),
            train_dataset=prompts,
            processing_class=byte_level_tokenizer(),
        )
        trainer.train()
        runs[c] = (trainer, {n: p.detach().clone() for n, p in model.named_parameters()})
    (with_aux, after), (_, plain) = runs[coef], runs[0.0]
    assert "aux_loss" in with_aux.state.log_history[0]
    # d aux / d w at the step's weights over its micro batches (the rows the trainer dealt them, padding left out)
    reference = load_pretrained(tmp_path / "base", use_kernels=False)
    reference.router_aux_loss_coef = 1.0
    gen = with_aux._generation
    _, rows = with_aux._window_rows(gen, 0)
    for part in np.array_split(rows, accum):
        batch_ = with_aux._rows_batch(gen, part)
        out = reference(batch_["input_ids"], attention_mask=batch_["attention_mask"])
        (out.aux_loss / accum).backward()
    for name, p in reference.named_parameters():
        if p.grad is None or name not in after:
            continue
        torch.testing.assert_close(after[name] - plain[name], -lr * coef * p.grad, atol=1e-6, rtol=1e-4, msg=name)
    assert any(p.grad is not None and p.grad.abs().max() > 0 for p in reference.parameters())
