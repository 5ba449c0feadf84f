"""The transformers path's features beyond plain SFT (trainer/model/transformers_model.py, issue 44): LoRA through peft
(the adapter in transformers' names, as peft writes it over AutoModelForCausalLM; training equal to
`transformers.Trainer` over `peft.get_peft_model`), QLoRA's 4-bit base, NEFTune through a hook on the input embeddings
(the same noise as our model's on the same checkpoint), and gradient checkpointing through transformers' switch."""

from __future__ import annotations

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
LORA_TYPES = ("gemma3_text", pytest.param("gemma2", marks=pytest.mark.slow), "qwen3_moe")
LORA_SLOW = ("qwen3_5_text",)
SGD = dict(COMMON, max_steps=3, warmup_steps=0, weight_decay=0.0, optim="sgd", learning_rate=0.05)
LORA = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=["all-linear"])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-hf")
    return {t: write_tiny(t, root / t) for t in ("gemma3_text", "gemma2", "qwen3_moe", "qwen3_5_text", "llama")}


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("model_type", [*LORA_TYPES, *(pytest.param(t, marks=pytest.mark.slow) for t in LORA_SLOW)])
def test_lora_trains_as_transformers_trainer_over_peft_and_saves_peft_files(model_type, checkpoints, tmp_path):
    """LoRA on every linear layer: the adapter starts at the base's loss (B = 0), three SGD steps give the losses and
    adapter weights of `transformers.Trainer` over `peft.get_peft_model` started from the same A; the base stays
    frozen; the saved adapter loads with `PeftModel.from_pretrained` over transformers' model with equal logits."""
    path, examples = checkpoints[model_type], _examples(n=24)
    args = TrainingArguments(output_dir=str(tmp_path / "ours"), **SGD, **LORA)
    model, _ = build_model(str(path), args)
    assert isinstance(model, TransformersModel) and has_adapter(model)
    base = {k: v.clone() for k, v in model.hf.state_dict().items() if "lora_" not in k}
    start = {k: v.clone() for k, v in model.hf.state_dict().items() if "lora_" in k}
    assert start and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)

    plain = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids, labels = batch()
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, plain(input_ids=ids, labels=labels).loss)

    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(model.hf.peft_config["default"].target_modules)
    )
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


def test_qlora_computes_transformers_4bit_model_and_trains_the_adapter(checkpoints, tmp_path):
    """load_in_4bit + use_peft: every linear layer but the head is bitsandbytes' Linear4bit under peft's 4-bit LoRA
    layer; the step-0 loss is that of transformers' own 4-bit model (BitsAndBytesConfig, NF4, fp32 compute); training
    moves the adapter and leaves the 4-bit codes as they were."""
    pytest.importorskip("bitsandbytes")
    from trainer.model.quant import Linear4bit

    path = checkpoints["gemma3_text"]
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
        model, _ = build_model(path, args)
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
