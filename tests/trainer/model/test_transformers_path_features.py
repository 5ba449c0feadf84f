"""The transformers path's features beyond plain SFT (trainer/model/transformers_model.py, issue 44): LoRA through peft
(the adapter in transformers' names, as peft writes it over AutoModelForCausalLM; training equal to
`transformers.Trainer` over `peft.get_peft_model`), QLoRA's 4-bit base, NEFTune through a hook on the input embeddings
(the same noise as our model's on the same checkpoint), and gradient checkpointing through transformers' switch."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.trainer.loop.test_golden import COMMON, _examples, _pad
from tests.trainer.model.test_transformers_path import batch
from tests.trainer.model.tiny_hf import write_tiny
from trainer.build import build_model
from trainer.config.args import TrainingArguments
from trainer.data.sft_data import TokenizedDataset
from trainer.loop.trainer import Trainer
from trainer.model.causal_lm import CausalLM
from trainer.model.lora import has_adapter
from trainer.model.transformers_model import TransformersModel

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# one of each block kind: sliding window + logit softcapping (gemma2), mixture of experts (qwen3_moe), hybrid linear
# attention (qwen3_5_text); the heavier ones run in the slow suite
LORA_TYPES = ("gemma3_text", "qwen3_moe")
LORA_SLOW = ("gemma2", "qwen3_5_text")
SGD = dict(COMMON, max_steps=3, warmup_steps=0, weight_decay=0.0, optim="sgd", learning_rate=0.05)
LORA = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=["all-linear"])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-hf")
    return {t: write_tiny(t, root / t) for t in ("gemma3_text", "gemma2", "qwen3_moe", "qwen3_5_text", "llama")}


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


EXPERTS = dict(lora_target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


@pytest.mark.parametrize(
    "model_type, extra",
    [
        *((t, {}) for t in LORA_TYPES),
        *(pytest.param(t, {}, marks=pytest.mark.slow) for t in LORA_SLOW),
        pytest.param("qwen3_moe", EXPERTS, id="qwen3_moe-experts"),  # the fused expert tensors: target_parameters
    ],
)
def test_lora_trains_as_transformers_trainer_over_peft_and_saves_peft_files(model_type, extra, checkpoints, tmp_path):
    """LoRA on every linear layer (a qwen3_moe's experts and router too, as peft's all-linear converts their names;
    and with lora_target_parameters, a mixture of experts' fused expert tensors): the adapter starts at the base's loss
    (B = 0), three SGD steps give the losses and adapter weights of `transformers.Trainer` over `peft.get_peft_model`
    started from the same A; the base stays frozen; the saved adapter loads with `PeftModel.from_pretrained` over
    transformers' model with equal logits."""
    path, examples = checkpoints[model_type], _examples(n=24)
    args = TrainingArguments(output_dir=str(tmp_path / "ours"), **SGD, **LORA, **extra)
    model, _ = build_model(str(path), args, model_impl="transformers")
    assert isinstance(model, TransformersModel) and has_adapter(model)
    base = {k: v.clone() for k, v in model.hf.state_dict().items() if "lora_" not in k}
    start = {k: v.clone() for k, v in model.hf.state_dict().items() if "lora_" in k}
    assert start and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)

    plain = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids, labels = batch()
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, plain(input_ids=ids, labels=labels).loss)

    ours_config = model.hf.peft_config["default"]
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=list(ours_config.target_modules),
        target_parameters=list(ours_config.target_parameters or []) or None,
        rank_pattern=ours_config.rank_pattern,
        alpha_pattern=ours_config.alpha_pattern,
    )
    # all-linear adapts a qwen3_moe's experts (gate_up_proj at twice the rank) and router as peft's all-linear does
    assert any(".experts." in k for k in start) == any(".mlp.gate." in k for k in start) == (model_type == "qwen3_moe")
    hf_model = peft.get_peft_model(plain, config)
    hf_model.base_model.model.load_state_dict(start, strict=False)  # the same A (and B = 0) as ours
    hf_args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), use_cpu=True, remove_unused_columns=False, dataloader_num_workers=0, **SGD
    )
    hf = transformers.Trainer(model=hf_model, args=hf_args, train_dataset=examples, data_collator=_pad)
    hf.train()
    ours = Trainer(model=model, args=args, train_dataset=TokenizedDataset.from_examples(examples))
    ours.train()
    np.testing.assert_allclose(_losses(ours), _losses(hf), rtol=1e-5, atol=1e-6)
    theirs = hf_model.base_model.model.state_dict()
    for name, value in model.hf.state_dict().items():
        if name in base:
            assert torch.equal(value, base[name]), name
        else:
            torch.testing.assert_close(value, theirs[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")

    out = ours.save_model(tmp_path / "adapter")
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(path), out).eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-6)


def test_qlora_computes_transformers_4bit_model_and_trains_the_adapter(tmp_path):
    """load_in_4bit + use_peft: every linear layer but the head is bitsandbytes' Linear4bit under peft's 4-bit LoRA
    layer; the step-0 loss is that of transformers' own 4-bit model (BitsAndBytesConfig, NF4, fp32 compute); training
    moves the adapter and leaves the 4-bit codes as they were."""
    pytest.importorskip("bitsandbytes")
    from trainer.model.quant import Linear4bit

    # every quantized weight's rows whole 64-value blocks (intermediate_size 128, not the tiny 96): bitsandbytes'
    # AVX512 CPU kernel, transformers' side here, is wrong on rows that are not (tests/bnb_paths.py)
    path = write_tiny("gemma3_text", tmp_path / "gemma3_text", intermediate_size=128)
    args = TrainingArguments(output_dir=str(tmp_path / "o"), load_in_4bit=True, **SGD, **LORA)
    model, _ = build_model(str(path), args)
    quantized = [n for n, m in model.hf.named_modules() if isinstance(m, Linear4bit)]
    assert quantized and all(n.endswith(".base_layer") for n in quantized)
    bnb = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb, dtype=torch.float32)
    ids, labels = batch()
    theirs_loss = theirs.train()(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, theirs_loss, rtol=1e-5, atol=0)

    before = {k: v.clone() for k, v in model.hf.state_dict().items()}
    trainer = Trainer(model=model, args=args, train_dataset=TokenizedDataset.from_examples(_examples(n=24)))
    trainer.train()
    after = model.hf.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items() if ".base_layer." in k)
    assert not all(torch.equal(after[k], v) for k, v in before.items() if ".lora_B." in k)
    assert (trainer.save_model(tmp_path / "adapter") / "adapter_model.safetensors").is_file()


def test_neftune_adds_our_models_noise_on_the_transformers_path(checkpoints, tmp_path):
    """The same llama checkpoint through both paths, the same seed: the noised training loss is the same (our model's
    `_neftune` and the transformers path's hook draw the same noise from the same stream), and differs from the
    noise-free loss; in eval mode there is no noise."""
    path = str(checkpoints["llama"])
    args = TrainingArguments(output_dir=str(tmp_path / "o"), neftune_noise_alpha=5.0)
    ids, labels = batch()
    mask = torch.ones_like(ids)
    mask[1, 18:] = 0  # a padded row: its length, not the batch's, sets the noise's scale
    labels = labels.masked_fill(mask == 0, -100)
    losses = {}
    for impl in ("ours", "transformers"):
        model, _ = build_model(path, args, model_impl=impl)
        assert isinstance(model, CausalLM if impl == "ours" else TransformersModel)
        torch.manual_seed(7)
        losses[impl] = model(input_ids=ids, labels=labels, attention_mask=mask).loss
        model.neftune_noise_alpha = None
        losses[impl, "plain"] = model(input_ids=ids, labels=labels, attention_mask=mask).loss
        model.neftune_noise_alpha = 5.0
        model.eval()
        losses[impl, "eval"] = model(input_ids=ids, labels=labels, attention_mask=mask).loss
    torch.testing.assert_close(losses["transformers"], losses["ours"], rtol=1e-5, atol=0)
    assert not torch.allclose(losses["transformers"], losses["transformers", "plain"])
    assert torch.equal(losses["transformers", "eval"], losses["transformers", "plain"])


def test_gradient_checkpointing_trains_the_same_steps(checkpoints, tmp_path):
    """gradient_checkpointing=True through transformers' own switch: the losses and weights of the run without it."""
    path, examples = str(checkpoints["qwen3_moe"]), TokenizedDataset.from_examples(_examples(n=24))
    results = []
    for checkpointing in (False, True):
        args = TrainingArguments(
            output_dir=str(tmp_path / str(checkpointing)), gradient_checkpointing=checkpointing, **SGD
        )
        model, _ = build_model(path, args, model_impl="transformers")
        assert model.hf.is_activation_checkpointing == checkpointing
        trainer = Trainer(model=model, args=args, train_dataset=examples)
        trainer.train()
        results.append((_losses(trainer), model.hf.state_dict()))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-6, atol=0)
    for name, value in results[1][1].items():
        torch.testing.assert_close(value, results[0][1][name], rtol=1e-5, atol=1e-7)


def test_the_commands_train_merge_and_generate_with_an_adapter(checkpoints, tmp_path, capsys):
    """`trainer.sft --use_peft` on a Gemma 3 writes peft's adapter files; `trainer.merge` writes a model transformers
    loads with the logits of peft's own merge; `trainer.generate --adapter` answers as the merged model does."""
    from tests.trainer.test_sft import FEW_STEPS
    from trainer import generate, merge, sft

    path, out, merged = checkpoints["gemma3_text"], tmp_path / "out", tmp_path / "merged"
    argv = ["--model", str(path), "--output_dir", str(out), "--use_peft", "--lora_target_modules", "all-linear"]
    assert sft.main([*argv, *FEW_STEPS, "--learning_rate", "0.05"]) == 0
    assert "trainable params: " in capsys.readouterr().err
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    assert merge.main(["--model", str(path), "--adapter", str(out), "--output_dir", str(merged)]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(path)
    theirs = peft.PeftModel.from_pretrained(base, out).merge_and_unload().eval()
    ours = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    ids, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, theirs(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    capsys.readouterr()
    prompt = ["--prompt", "2+2=", "--raw", "--max_new_tokens", "5"]
    assert generate.main(["--model", str(path), "--adapter", str(out), *prompt]) == 0
    adapted = capsys.readouterr().out
    assert generate.main(["--model", str(merged), *prompt]) == 0
    assert capsys.readouterr().out == adapted


def _preference_setup(model_type: str, root):
    """A tiny `model_type` checkpoint with a chat template, and the golden DPO test's pairs (as test_golden_dpo)."""
    from tests.trainer.methods.test_golden_dpo import STEPS
    from trainer.data.tasks import generate_tasks, preference_pair
    from trainer.data.tokenizer import DEFAULT_CHAT_TEMPLATE, byte_level_tokenizer

    write_tiny(model_type, root / "model")
    tok = byte_level_tokenizer()
    tok.chat_template = DEFAULT_CHAT_TEMPLATE
    tok.save_pretrained(root / "model")
    pairs = [preference_pair(ex) for ex in generate_tasks(STEPS * 4, seed=4)]
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return root, pairs, tok


@pytest.mark.parametrize(
    "model_type, use_kernels",
    [
        ("gemma2", True),  # final logit softcapping inside our fused preference head
        pytest.param("gemma3_text", True, marks=pytest.mark.slow),
        pytest.param("gemma3_text", False, marks=pytest.mark.slow),
        pytest.param("qwen3_5_text", True, marks=pytest.mark.slow),
    ],
)
def test_dpo_matches_trl_on_the_transformers_path(model_type, use_kernels, tmp_path):
    """`trl.DPOTrainer` and our PreferenceTrainer on the same tiny transformers checkpoint (sigmoid loss, the reference
    a frozen copy, AdamW, 20 steps; our preference head inside transformers' model, with our kernels or PyTorch's
    ops): the first step's loss, gradient norm, rewards, log-probabilities and mean logits agree to fp32 rounding;
    the later ones within 2e-3 relative (1e-5 absolute near zero), because Adam, which divides each gradient by its
    own size, carries fp32 rounding differences (the two trainers pad and batch the pairs differently) into the
    weights: measured on Gemma 3, 3e-5 on the loss and 7e-4 on the gradient norm by step 20, growing from 0 at step
    1. On our own Llama, whose ops round as transformers' do, tests/trainer/methods/test_golden_dpo.py holds all 20
    steps to 2e-5."""
    pytest.importorskip("trl")
    from tests.trainer.methods.test_golden_dpo import COMMON as DPO_COMMON
    from tests.trainer.methods.test_golden_dpo import METRICS, trl_run
    from tests.trainer.methods.test_golden_dpo import STEPS as DPO_STEPS
    from trainer.data.preference_data import load_preference_dataset
    from trainer.methods.preference import PreferenceArguments, PreferenceTrainer

    setup = _preference_setup(model_type, tmp_path / "setup")
    root, _, tok = setup
    theirs = trl_run(setup, tmp_path / "trl", ["sigmoid"], attn_implementation=None)  # as our build: auto
    args = TrainingArguments(
        output_dir=str(tmp_path / "ours"), train_shuffle=False, use_kernels=use_kernels, **DPO_COMMON
    )
    model, _ = build_model(str(root / "model"), args, model_impl="transformers")
    assert isinstance(model, TransformersModel) and model.plain_head and model.fused_head == use_kernels
    trainer = PreferenceTrainer(
        model=model,
        args=args,
        pref=PreferenceArguments(beta=0.1),
        processing_class=tok,
        train_dataset=load_preference_dataset(root / "pairs.jsonl", tok, max_length=None, show_progress=False),
    )
    trainer.train()
    ours = [h for h in trainer.state.log_history if "loss" in h]
    assert len(ours) == len(theirs) == DPO_STEPS
    for step, (a, b) in enumerate(zip(ours, theirs), 1):
        rel, near_zero = (1e-6, 1e-7) if step == 1 else (2e-3, 1e-5)
        for name in METRICS:
            assert a[name] == pytest.approx(b[name], rel=rel, abs=near_zero), (step, name, a[name], b[name])
    assert ours[-1]["rewards/margins"] > 0


@pytest.fixture(scope="module")
def router_loss_checkpoint(tmp_path_factory):
    """A mixture of experts asked for its router loss: its loss runs over transformers' logits (not a plain head)."""
    return write_tiny("qwen3_moe", tmp_path_factory.mktemp("router") / "qwen3_moe", output_router_logits=True)


def test_the_command_refuses_such_a_stage_before_evaluating(router_loss_checkpoint, tmp_path, capsys):
    from trainer import sft

    argv = ["--model", str(router_loss_checkpoint), "--stage", "dpo", "--output_dir", str(tmp_path / "o")]
    argv += ["--model_impl", "transformers"]
    assert sft.main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error: stage dpo: Qwen3MoeForCausalLM cannot train it")
    assert "exact match before training" not in err


def test_a_stage_the_models_head_cannot_run_is_one_line(router_loss_checkpoint, tmp_path):
    """A model trained with its router loss keeps transformers' logits: preference losses, which run from the hidden
    states and the head's weight, are refused when the trainer gets the model."""
    from trainer.config.args import ConfigError
    from trainer.methods.preference import PreferenceArguments, PreferenceTrainer

    args = TrainingArguments(output_dir=str(tmp_path / "o"))
    model, tok = build_model(str(router_loss_checkpoint), args, model_impl="transformers")
    assert model.fused_head is False and model.router_loss
    with pytest.raises(ConfigError, match=r"^stage dpo: Qwen3MoeForCausalLM cannot train it on the transformers path"):
        PreferenceTrainer(model=model, args=args, pref=PreferenceArguments(beta=0.1), processing_class=tok)


def test_a_softcap_the_model_does_not_apply_is_not_taken(checkpoints, tmp_path):
    """The probe proves the cap a config names: a Llama checkpoint whose config carries a stray
    final_logit_softcapping (Llama's code never applies it) keeps uncapped logits, through the fused head."""
    path = write_tiny("llama", tmp_path / "llama", final_logit_softcapping=30.0)
    model, _ = build_model(str(path), TrainingArguments(output_dir=str(tmp_path / "o")), model_impl="transformers")
    assert model.fused_head and model.softcap is None and model.logit_scale == 1.0
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(input_ids=ids, labels=ids)
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, theirs.loss, rtol=1e-5, atol=0)


DECODE_TYPES = ("gemma3_text", "qwen3_5_text", "qwen3_moe", "gpt_oss", "lfm2")


@pytest.mark.parametrize("model_type", DECODE_TYPES)
def test_decoding_through_transformers_cache_equals_full_forwards(model_type, tmp_path):
    """`decode_step` over transformers' own cache (sliding windows, linear-attention and convolution states, mixtures
    of experts): two left-padded prompts prefilled, repeated (`repeat_rows`, as GRPO's sampler does) and fed 4 tokens
    one at a time give, at each step, the last logits of a full forward over each row's unpadded tokens; greedy
    `generate` equals transformers' `generate`."""
    from trainer.model.causal_lm import generate

    path = write_tiny(model_type, tmp_path / model_type)
    model, _ = build_model(str(path), TrainingArguments(output_dir="unused"), model_impl="transformers")
    model.eval()
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, 256, (n,), generator=g) for n in (5, 8)]
    ids = torch.zeros(2, 8, dtype=torch.long)
    ids[0, 3:], ids[1] = rows[0], rows[1]
    cache = model.decode_cache(2, 16)
    cache.pad = torch.tensor([3, 0])
    with torch.no_grad():
        logits = model.decode_step(ids, cache).repeat_interleave(2, 0)  # (4, V)
        cache.repeat_rows(2)
        seqs = [rows[0], rows[0], rows[1], rows[1]]
        for step in range(5):
            for r, seq in enumerate(seqs):
                full = model(input_ids=seq[None]).logits[0, -1]
                torch.testing.assert_close(logits[r], full, rtol=1e-4, atol=1e-5, msg=lambda m: f"step {step}: {m}")
            if step == 4:
                break
            token = torch.randint(3, 256, (4,), generator=g)
            seqs = [torch.cat([s, t[None]]) for s, t in zip(seqs, token)]
            logits = model.decode_step(token[:, None], cache)
        prompt = rows[1].tolist()
        expected = model.hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt) :]
    assert generate(model, prompt, 6) == expected.tolist()


def test_grpo_trains_the_same_through_both_paths(checkpoints, tmp_path):
    """GRPO on one Llama checkpoint through our model and through transformers' (model_impl): our sampler draws the
    same completions (its per-completion random stream, over logits from transformers' KV cache), and the two
    steps' losses, rewards and KL agree to fp32 rounding."""
    from tests.trainer.methods.test_grpo import distinct_chars
    from trainer.data.task_eval import held_out_conversations
    from trainer.data.tasks import TRAIN_FILE
    from trainer.methods.grpo import GRPOArguments, GRPOTrainer, prompts_from_conversations

    prompts = prompts_from_conversations(held_out_conversations([str(TRAIN_FILE)], 8))
    logs = {}
    for impl in ("ours", "transformers"):
        args = TrainingArguments(
            output_dir=str(tmp_path / impl),
            per_device_train_batch_size=8,
            max_steps=2,
            learning_rate=0.1,
            optim="sgd",
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
        )
        model, tok = build_model(str(checkpoints["llama"]), args, model_impl=impl)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=distinct_chars,
            args=args,
            grpo=GRPOArguments(num_generations=4, max_completion_length=6, beta=0.04),
            train_dataset=prompts,
            processing_class=tok,
        )
        trainer.train()
        logs[impl] = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs["ours"]) == len(logs["transformers"]) == 2
    for a, b in zip(logs["transformers"], logs["ours"]):
        for name in ("loss", "reward", "kl", "completions/mean_length", "grad_norm"):
            assert a[name] == pytest.approx(b[name], rel=1e-4, abs=1e-6), (name, a[name], b[name])


def test_grpo_heads_give_the_softcapped_models_log_probs(checkpoints, tmp_path):
    """Gemma 2's GRPO heads (the sampling-time log-probs and the fused loss, temperature 0.7, top-entropy masking) run
    from the hidden states with the final softcap inside our kernels: the per-token log-probs, the loss and its
    gradient equal those computed from transformers' own (capped) logits divided by the temperature."""
    import functools

    from trainer.methods.grpo import _head_logps
    from trainer.methods.grpo_loss import fused_grpo_loss, grpo_loss, high_entropy_mask

    model, _ = build_model(str(checkpoints["gemma2"]), TrainingArguments(output_dir=str(tmp_path / "o")))
    assert model.softcap == 30.0 and model.fused_head
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (4, 10), generator=g)
    target = torch.full((4, 10), -100)
    target[:, 4:9] = ids[:, 5:10]  # the completion: columns 4..8 predict tokens 5..9
    columns, mask = slice(4, 9), torch.ones(4, 5)
    mask[1, 3:] = 0
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0])
    temperature = 0.7

    logits = model.hf(input_ids=ids, use_cache=False).logits.float() / temperature  # transformers' capped logits
    log_probs = logits.log_softmax(-1)
    theirs = log_probs[:, columns].gather(-1, ids[:, 5:10, None]).squeeze(-1)
    head = functools.partial(_head_logps, target=target, columns=columns, temperature=temperature)
    with torch.no_grad():
        ours = model(input_ids=ids, head=head).metrics["logps"]
    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-5, atol=1e-5)

    options = dict(loss_type="dapo", top_entropy_quantile=0.5)
    entropies = -(log_probs.exp() * log_probs).sum(-1)[:, columns]
    entropy_mask = high_entropy_mask(entropies.detach(), mask, 0.5)
    expected, _ = grpo_loss(theirs, advantages, mask, entropy_mask=entropy_mask, **options)
    (expected_grad,) = torch.autograd.grad(expected, model.hf.lm_head.weight)
    loss_head = functools.partial(
        fused_grpo_loss,
        target=target,
        advantages=advantages,
        completion_mask=mask,
        completion_columns=columns,
        temperature=temperature,
        **options,
    )
    loss = model(input_ids=ids, head=loss_head).loss
    (grad,) = torch.autograd.grad(loss, model.hf.lm_head.weight)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6 * expected_grad.abs().max().item())


def _two_process_runs(checkpoints, tmp_path, jobs_of, lora_too: bool):
    """Gemma 3 through the transformers path on two gloo processes (`jobs_of(two, path)`: the jobs, each a setting of
    the same global batch) against one process: the losses, and the consolidated exports rank 0 writes, which load in
    transformers (and peft) with the one-process weights."""
    from tests.trainer.parallel.test_distributed import BASE, launch, ok
    from trainer.data.sft_data import load_sft_dataset
    from trainer.data.tasks import generate_tasks
    from trainer.data.tokenizer import byte_level_tokenizer

    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate_tasks(40, seed=3)))
    path = str(checkpoints["gemma3_text"])
    two = {**BASE, "gradient_accumulation_steps": 2, "save_strategy": "steps", "save_steps": 2}
    jobs = jobs_of(two, path)
    result = ok(launch(tmp_path / "two", data, jobs))
    dataset = load_sft_dataset([data], byte_level_tokenizer(), cutoff_len=64, show_progress=False)
    plain = [job["name"] for job in jobs if "lora" not in job["name"]]
    for name, extra, runs in (("ddp", {}, plain), ("fsdp2-lora", LORA, ["fsdp2-lora"] if lora_too else [])):
        if not runs:
            continue
        settings = {**two, "gradient_accumulation_steps": 4, **extra}
        args = TrainingArguments(output_dir=str(tmp_path / f"one-{name}"), **settings)
        model, _ = build_model(path, args)
        trainer = Trainer(model=model, args=args, train_dataset=dataset)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        for run in runs:
            assert result["result"][run]["losses"][-1] == pytest.approx(losses[-1], rel=1e-5), run
            if not run.endswith("-resumed"):
                assert result["result"][run]["losses"] == pytest.approx(losses, rel=1e-5), run
        ours = model.hf.state_dict()
        for run in runs:
            final = result["out"][run] / "final"
            if name == "ddp":
                exported = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).state_dict()
            else:
                base = transformers.AutoModelForCausalLM.from_pretrained(path)
                exported = peft.PeftModel.from_pretrained(base, final).base_model.model.state_dict()
            for key, value in ours.items():
                # Adam's steps carry the ranks' other summation order into near-zero weights (1.1e-5 seen)
                torch.testing.assert_close(
                    exported[key], value, rtol=1e-4, atol=1e-4, msg=lambda m, k=key: f"{run} {k}: {m}"
                )


@pytest.mark.slow  # 40-90 s on 2 shared cores (three 2-process launches); GRPO's gemma2-fsdp2 run stays in CI
def test_ddp_fsdp2_and_lora_on_two_processes_match_one_process(checkpoints, tmp_path):
    """DDP, FSDP2 (each decoder layer a unit, fp32) and LoRA under FSDP2 equal one process (`_two_process_runs`);
    an FSDP2 run resumes from its checkpoint."""
    fsdp2 = {"dist_config": {"name": "fsdp2", "mixed_precision": "fp32"}}

    def jobs(two, path):
        resumed = {"name": "fsdp2-resumed", "model": path, "args": {**two, **fsdp2}}
        resumed["resume"] = str(tmp_path / "two" / "fsdp2" / "run" / "checkpoint-2")
        return [
            {"name": "ddp", "model": path, "args": two},
            {"name": "fsdp2", "model": path, "args": {**two, **fsdp2}},
            resumed,
            {"name": "fsdp2-lora", "model": path, "args": {**two, **fsdp2, **LORA}},
        ]

    _two_process_runs(checkpoints, tmp_path, jobs, lora_too=True)


@pytest.mark.slow  # DeepSpeed's start and the compile take minutes on two loaded cores
def test_deepspeed_and_per_block_compile_on_two_processes_match_one_process(checkpoints, tmp_path):
    """DeepSpeed ZeRO-2 and ZeRO-3 (partitioned weights fetched where our swapped forwards read them) and DDP with
    each decoder layer compiled (per-block compile, aot_eager) equal one process (`_two_process_runs`)."""
    pytest.importorskip("deepspeed")
    auto = {k: "auto" for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")}

    def jobs(two, path):
        out = [{"name": "ddp-compiled", "model": path, "args": {**two, "torch_compile": True}}]
        out[0]["args"]["torch_compile_backend"] = "aot_eager"
        for stage in (2, 3):
            config = tmp_path / f"zero{stage}.json"
            config.write_text(json.dumps({**auto, "gradient_clipping": "auto", "zero_optimization": {"stage": stage}}))
            out.append({"name": f"zero{stage}", "model": path, "args": {**two, "deepspeed": str(config)}})
        return out

    _two_process_runs(checkpoints, tmp_path, jobs, lora_too=False)


@pytest.mark.parametrize("model_type, setting", [("granite", {"logits_scaling": 8.0}), ("cohere2", {})])
def test_a_constant_logit_scale_is_folded_into_the_fused_head(model_type, setting, tmp_path):
    """Granite divides its logits by logits_scaling, Cohere multiplies them by logit_scale (0.0625): the probe finds
    the constant, the fused loss runs on the scaled hidden states, and the loss is transformers' own."""
    path = write_tiny(model_type, tmp_path / model_type, **setting)
    model, _ = build_model(str(path), TrainingArguments(output_dir="unused"))
    expected = 1 / setting["logits_scaling"] if setting else model.config.logit_scale
    assert model.fused_head and model.logit_scale == pytest.approx(expected, rel=1e-6)
    assert f"fused linear cross-entropy (logit scale {model.logit_scale:g} folded in)" in model.kernel_report()
    ids, labels = batch()
    plain = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, plain(input_ids=ids, labels=labels).loss)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_offloading_moves_each_layers_saves_and_changes_nothing(checkpoints, tmp_path, checkpointing):
    """Activation offloading on the transformers path: the offloader's per-block calls are forward pre-hooks on
    transformers' decoder layers, so every layer's saves but the last's go to the host (with transformers' gradient
    checkpointing too: then the layers' inputs), and the loss and gradients are bit for bit those without; with
    per-block compile it is one line."""
    from trainer.model.offload import ActivationOffloader

    model, _ = build_model(str(checkpoints["gemma3_text"]), TrainingArguments(output_dir=str(tmp_path / "o")))
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    ids, labels = batch()
    calls = []
    model.block_hooks.append(calls.append)

    def step(offloader=None):
        model.zero_grad()
        with offloader() if offloader else torch.enable_grad():
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain_loss, plain = step()
    assert calls[: len(model.decoder_layers)] == list(range(len(model.decoder_layers)))
    offloader = ActivationOffloader.for_model(model, "cpu")
    loss, grads = step(offloader)
    assert offloader.offloaded_bytes > 0 and offloader.resident_bytes > 0
    assert torch.equal(loss, plain_loss) and all(torch.equal(a, b) for a, b in zip(grads, plain))
    from trainer.config.args import ConfigError
    from trainer.model.transformers_model import check_transformers_path

    with pytest.raises(ConfigError, match="^activation_offloading with torch_compile: on the transformers path"):
        check_transformers_path(TrainingArguments(output_dir="unused", activation_offloading=True, torch_compile=True))


def test_the_tiled_mlp_tiles_our_swapped_mlps(checkpoints, tmp_path):
    """--tiled_mlp on the transformers path: our swapped MLPs (Gemma 3's GeGLU) run over the tokens in tiles of
    hidden_size (checkpointed each), with the loss and gradients of the untiled model to fp32 rounding; a model
    without an MLP of ours (gpt-oss: experts only) refuses it in one line."""
    args = TrainingArguments(output_dir=str(tmp_path / "o"))
    model, _ = build_model(str(checkpoints["gemma3_text"]), args)
    ids = torch.randint(0, 256, (2, 50), generator=torch.Generator().manual_seed(0))  # 100 tokens: two tiles of 64
    labels = ids.clone()

    def step():
        model.zero_grad()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain_loss, plain = step()
    model.tiled_mlp = True
    size = model.config.hidden_size
    assert model.tiled_mlp and all(m.tile_tokens == size for m in model._our_mlps()) and ids.numel() > size
    loss, grads = step()
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=0)
    for a, b in zip(grads, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    from trainer.config.args import ConfigError

    gpt_oss, _ = build_model(str(write_tiny("gpt_oss", tmp_path / "gpt_oss")), args, model_impl="transformers")
    with pytest.raises(ConfigError, match="^tiled_mlp: GptOssForCausalLM has no MLP our kernels run"):
        gpt_oss.tiled_mlp = True


def test_lora_target_parameters_that_match_nothing_are_one_line(checkpoints, tmp_path):
    """A target parameter that names no stacked expert tensor stops the build in one line naming the model's
    candidates (our own Llama has none)."""
    from trainer.config.args import ConfigError

    for model_type, candidates in (("qwen3_moe", "mlp.experts.gate_up_proj"), ("llama", "none")):
        args = TrainingArguments(output_dir=str(tmp_path / "o"), **LORA, lora_target_parameters=["mlp.experts.up"])
        with pytest.raises(
            ConfigError, match=r"^lora_target_parameters: 'mlp.experts.up' matches no stacked expert"
        ) as e:
            build_model(
                str(checkpoints[model_type]), args, model_impl="transformers" if candidates != "none" else "auto"
            )
        assert candidates in str(e.value)


@pytest.mark.slow  # about two minutes on a loaded 2-core machine
def test_dpo_under_fsdp2_and_zero3_on_two_processes_matches_one_process(checkpoints, tmp_path):
    """DPO on the transformers path under FSDP2 and DeepSpeed ZeRO-3 (Gemma 2: the softcapped fused preference head,
    sliding windows): the reference a frozen copy sharded like the policy (FSDP2: `trainer.build.frozen_copy`, the
    policy's `meta_copy` with its kernels and head as the policy's probes proved them, through the same transforms;
    ZeRO-3: `DeepSpeedRun.frozen`, partitioned alike), two gloo processes give the losses, reward margins and eval
    metrics of one process on the same global batch of 8 pairs."""
    pytest.importorskip("deepspeed")
    from tests.trainer.parallel.test_distributed import BASE, assert_same_preference_run, launch, ok
    from trainer.data.preference_data import load_preference_dataset
    from trainer.data.tasks import generate_tasks, preference_pair
    from trainer.data.tokenizer import byte_level_tokenizer
    from trainer.methods.preference import PreferenceArguments, PreferenceTrainer

    pairs_file = tmp_path / "pairs.jsonl"
    pairs_file.write_text("".join(json.dumps(preference_pair(ex)) + "\n" for ex in generate_tasks(24, seed=5)))
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate_tasks(8, seed=3)))
    path = str(checkpoints["gemma2"])
    settings = {**BASE, "use_kernels": True}
    zero3 = tmp_path / "zero3.json"
    auto = {k: "auto" for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")}
    zero3.write_text(json.dumps({**auto, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
    engines = {
        "fsdp2": {"dist_config": {"name": "fsdp2", "mixed_precision": "fp32"}},
        "zero3": {"deepspeed": str(zero3)},
    }
    jobs = [
        {
            "name": name,
            "model": path,
            "pairs": str(pairs_file),
            "pref": {"beta": 0.1},
            "args": {**settings, "gradient_accumulation_steps": 2, **engine},
        }
        for name, engine in engines.items()
    ]
    results = ok(launch(tmp_path / "two", data, jobs))["result"]
    assert results["fsdp2"]["reference_holding"][0]["type"] == "FSDPTransformersModel"  # sharded like the policy
    tokenizer = byte_level_tokenizer()
    pairs = load_preference_dataset([pairs_file], tokenizer, show_progress=False)
    args = TrainingArguments(output_dir=str(tmp_path / "one"), **settings, gradient_accumulation_steps=4)
    model, _ = build_model(path, args)
    trainer = PreferenceTrainer(
        model=model,
        args=args,
        pref=PreferenceArguments(beta=0.1),
        train_dataset=pairs,
        eval_dataset=pairs,
        processing_class=tokenizer,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    for name, result in results.items():
        # a margin is the difference of two far larger rewards: fp32 noise, absolute (3.1e-7 measured at step 2 here)
        assert_same_preference_run(result, (logs, model, trainer.evaluate()), name)
