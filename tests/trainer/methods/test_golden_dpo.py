"""Golden preference runs: our PreferenceTrainer against `trl.DPOTrainer` (issue 22's exactness test).

The same transformers-written tiny Llama, the same byte-level tokenizer and ChatML template (saved for
transformers, so TRL tokenises the same pairs into the same ids), the embedded tasks' pairs in order
(sequential sampling), 4 pairs per step, AdamW (torch), a constant rate, clipping at 1.0, fp32 (TRL's DPOConfig
defaults to bf16: turned off), 20 optimizer steps. The losses, gradient norms and every reward metric agree to fp32
noise: within 2e-5
relative, or 1e-6 absolute for values near zero (the first steps' rewards and margins), at every step; all four
runs pass with those bounds (sigmoid, ipo, rpo_alpha, LoRA; trl 1.16.0, transformers 5.24.0).
"""

from __future__ import annotations

import json

import pytest
import torch

from trainer.build import load_pretrained
from trainer.config.args import TrainingArguments
from trainer.data.preference_data import load_preference_dataset
from trainer.data.tasks import generate_tasks, preference_pair
from trainer.data.tokenizer import DEFAULT_CHAT_TEMPLATE, byte_level_tokenizer
from trainer.methods.preference import PreferenceArguments, PreferenceTrainer
from trainer.model.lora import apply_lora, load_adapter_weights

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
peft = pytest.importorskip("peft")

STEPS = 20
METRICS = (
    "loss",
    "grad_norm",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
)
COMMON = dict(
    per_device_train_batch_size=4,
    gradient_accumulation_steps=1,
    learning_rate=1e-3,
    lr_scheduler_type="constant",
    warmup_steps=0,
    weight_decay=0.0,
    max_grad_norm=1.0,
    max_steps=STEPS,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    seed=0,
    optim="adamw_torch",
    disable_tqdm=True,
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(model directory with the tokenizer, the pairs as records, their file)."""
    root = tmp_path_factory.mktemp("golden-dpo")
    tok = byte_level_tokenizer()
    tok.chat_template = DEFAULT_CHAT_TEMPLATE
    tok.save_pretrained(root / "model")
    config = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "model")
    pairs = [preference_pair(ex) for ex in generate_tasks(STEPS * 4, seed=4)]
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return root, pairs, tok


def trl_run(setup, out, loss_type, loss_weights=None, lora=None, attn_implementation="sdpa"):
    """TRL's run; with `lora` (a peft LoraConfig) the model is wrapped by peft, and its starting adapter saved in
    out/adapter0 for our run to start from. attn_implementation None: transformers' choice for the model (Gemma 2's
    eager attention, whose softcapping sdpa lacks)."""
    root, pairs, _ = setup
    model = transformers.AutoModelForCausalLM.from_pretrained(
        root / "model", dtype=torch.float32, attn_implementation=attn_implementation
    )
    if lora is not None:
        torch.manual_seed(1)
        model = peft.get_peft_model(model, lora)
        model.save_pretrained(out / "adapter0")
    config = trl.DPOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        beta=0.1,
        loss_type=loss_type,
        loss_weights=loss_weights,
        max_length=None,
        dataloader_num_workers=0,
        train_sampling_strategy="sequential",
        **COMMON,
    )
    trainer = trl.DPOTrainer(
        model=model,
        args=config,
        train_dataset=datasets.Dataset.from_list(pairs),
        processing_class=transformers.AutoTokenizer.from_pretrained(root / "model"),
    )
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def our_run(setup, out, pref, adapter=None, **overrides):
    """Our run; with `adapter` (a peft adapter directory) LoRA starts from that adapter."""
    root, _, tok = setup
    args = TrainingArguments(output_dir=str(out), train_shuffle=False, use_kernels=False, **{**COMMON, **overrides})
    model = load_pretrained(root / "model", use_kernels=False)
    if adapter is not None:
        model = apply_lora(model, args)
        load_adapter_weights(model, adapter)
    trainer = PreferenceTrainer(
        model=model,
        args=args,
        pref=pref,
        processing_class=tok,
        train_dataset=load_preference_dataset(root / "pairs.jsonl", tok, max_length=None, show_progress=False),
    )
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def assert_same_logs(ours, theirs, rtol):
    assert len(ours) == len(theirs) == STEPS
    for step, (a, b) in enumerate(zip(ours, theirs), 1):
        for name in METRICS:
            assert a[name] == pytest.approx(b[name], rel=rtol, abs=1e-6), (step, name, a[name], b[name])


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_matches_trl(setup, tmp_path, loss_type):
    theirs = trl_run(setup, tmp_path / "trl", [loss_type])
    ours = our_run(setup, tmp_path / "ours", PreferenceArguments(beta=0.1, loss_type=loss_type))
    assert_same_logs(ours, theirs, rtol=2e-5)
    assert ours[-1]["rewards/margins"] > 0  # it learned, so the comparison covers a moving run


def test_rpo_alpha_matches_trls_sft_term(setup, tmp_path):
    """rpo_alpha (TRL < 1.0) is TRL 1.x's loss_type ["sigmoid", "sft"] with loss_weights [1, rpo_alpha]."""
    theirs = trl_run(setup, tmp_path / "trl", ["sigmoid", "sft"], loss_weights=[1.0, 0.5])
    ours = our_run(setup, tmp_path / "ours", PreferenceArguments(beta=0.1, rpo_alpha=0.5))
    assert_same_logs(ours, theirs, rtol=2e-5)


def test_lora_matches_trl(setup, tmp_path):
    """A LoRA adapter from the same starting weights, the reference its base model (the adapter disabled) in both."""
    target = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=target, task_type="CAUSAL_LM")
    theirs = trl_run(setup, tmp_path / "trl", ["sigmoid"], lora=config)
    ours = our_run(
        setup,
        tmp_path / "ours",
        PreferenceArguments(beta=0.1),
        adapter=tmp_path / "trl" / "adapter0",
        use_peft=True,
        lora_r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        lora_target_modules=target,
    )
    assert_same_logs(ours, theirs, rtol=2e-5)
