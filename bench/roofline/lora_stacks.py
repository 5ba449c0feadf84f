"""The LoRA stacks (`python -m bench.roofline --lora_stacks`, issue 34): one step of Llama-3.1-8B with LoRA r=16 per
LORA_SETTINGS x LORA_STACKS, fused LoRA (kernels.lora) against peft's layers, in our model and in transformers'.
With `--model qwen3-30b-a3b` or `gpt-oss-20b` (issue 46, MOE_LORA_MODELS): r 16 on attention and on the experts
(peft's target_parameters), `moe_lora_settings` x MOE_LORA_STACKS: the adapter as rank GEMMs inside our grouped
GEMMs against peft's layers forming each expert tensor's whole delta, in our model and in transformers' (grouped_mm
experts)."""

from __future__ import annotations

import json

import torch

from bench import common
from bench.roofline.ladder import MODEL_LADDERS, LadderStack, Setting, ladder_step
from bench.roofline.ladder_report import unsloth_claim

LORA_STACKS = {  # name: (LadderStack without checkpointing: every activation a step keeps is in its peak, title)
    "ours_fused": (LadderStack("ours", checkpointing=False), "ours, LoRA fused (kernels.lora)"),
    "ours_peft": (LadderStack("ours", checkpointing=False, fused_lora=False), "ours, peft's LoRA layers"),
    "hf_peft": (LadderStack("hf", checkpointing=False), "transformers + peft"),
    "hf_peft_liger": (LadderStack("hf_liger", checkpointing=False), "transformers + peft + liger"),
}
# Llama-3.1-8B, bf16 base, r 16 on every linear layer of the blocks; the adapters in bf16 (as inject_adapter_in_model
# leaves them: the ladder's setting) or in fp32 (as a PeftModel keeps them, TRL's path); dropout 0 (LlamaFactory's
# default) or 0.05 (TRL's and peft's examples').
LORA_SETTINGS = {
    f"{dtype_name} adapters, dropout {dropout}": Setting(
        "llama-3.1-8b", "", lora=True, lora_dropout=dropout, adapter_dtype=dtype
    )
    for dtype_name, dtype in (("bf16", None), ("fp32", torch.float32))
    for dropout in (0.0, 0.05)
}
LORA_SEQ_LEN = 2048
# Qwen3-30B-A3B, bf16 base, r 16 on q/k/v/o and on both expert tensors (target_parameters), bf16 adapters, dropout 0
# (peft refuses dropout on target_parameters); transformers + peft also with liger-kernel's patches (its fused MoE,
# op_models.LigerFusedMoEModel, over the weight + delta peft's layer forms; gpt-oss's experts stay grouped_mm)
# and QLoRA: NF4 attention and (ours) NF4 experts; transformers' bitsandbytes quantizer leaves its experts in bf16.
# peft's layers cannot form a delta over 4-bit expert codes: no ours_peft row there.
# The mixtures of experts `--lora_stacks --model` takes (OUR_MODELS' names; their titles MODEL_LADDERS', what Unsloth
# reports for each `unsloth_claim`: its own claims, rank, targets and sequence length as its notebooks set them)
MOE_LORA_MODELS = ("qwen3-30b-a3b", "gpt-oss-20b")


def moe_lora_settings(model: str) -> dict[str, Setting]:
    """LoRA and QLoRA of the mixture of experts `model` (one of MOE_LORA_MODELS)."""
    return {
        "bf16 adapters, dropout 0.0": Setting(model, "", lora=True),
        "QLoRA (NF4 base), bf16 adapters, dropout 0.0": Setting(model, "", lora=True, nf4=True),
    }


MOE_LORA_SETTINGS = moe_lora_settings("qwen3-30b-a3b")
MOE_LORA_STACKS = {
    "ours_fused": (LadderStack("ours", checkpointing=False), "ours, experts' LoRA as rank GEMMs (kernels.moe)"),
    "ours_peft": (LadderStack("ours", checkpointing=False, fused_lora=False), "ours, peft's layers (whole delta)"),
    "hf_peft": (LadderStack("hf", checkpointing=False), "transformers (grouped_mm experts) + peft"),
    "hf_peft_liger": (LadderStack("hf_liger", checkpointing=False), "transformers + peft + liger-kernel"),
}


def lora_stack_rows(
    seq_len: int = LORA_SEQ_LEN,
    config: dict | None = None,
    env: dict | None = None,
    settings: dict | None = None,
    stacks: dict | None = None,
) -> list[dict]:
    """One modelled step (micro batch 1, `seq_len` tokens) per setting x stack (default LORA_SETTINGS x
    LORA_STACKS): peak, what is live after forward above the parameters and optimizer state (the activations kept for
    backward), the step's modelled DRAM bytes and its time on each of DEVICES."""
    rows = []
    for setting_name, setting in (settings or LORA_SETTINGS).items():
        for stack_name, (stack, title) in (stacks or LORA_STACKS).items():
            if setting.nf4 and not stack.fused_lora:  # peft's delta over 4-bit expert codes: not a path that runs
                continue
            step = ladder_step(setting, stack, seq_len, config)
            rows.append(
                {
                    "bench": "roofline_lora",
                    "modelled": True,
                    "setting": setting_name,
                    "stack": stack_name,
                    "stack_title": title,
                    "seq_len": seq_len,
                    "peak_gb": step["peak_bytes"] / 1e9,
                    "activations_gb": (step["live_after_forward_bytes"] - step["setup_bytes"]) / 1e9,
                    "step_bytes_gb": step["step_bytes"] / 1e9,
                    "ms": {key: sum(phases.values()) for key, phases in step["ms"].items()},
                    **(env or {}),
                }
            )
    return rows


LLAMA_INTRO = (
    "Every figure here is **modelled** on meta tensors (bench/roofline/lora_stacks.py: `lora_stack_rows`), no "
    "checkpointing (every activation a step keeps is in its peak), bf16 base, bf16 autocast. activations = what is "
    "live after forward above the parameters and optimizer state; step bytes = the DRAM traffic of every op of the "
    "step. The fused path's values and gradients equal peft's bit for bit "
    "(tests/trainer/model/test_fused_lora.py). It keeps each input once and the thin x A^T; peft's layers keep, "
    "per adapted layer, dropout's mask and dropped copy, and with fp32 adapters the bf16 casts of their inputs. "
    "With dropout the fused backward draws the masks again (PyTorch's dropout on the saved generator state): bytes "
    "that peft's kept copies save."
)
MOE_INTRO = (
    "Every figure here is **modelled** on meta tensors (bench/roofline/lora_stacks.py: `lora_stack_rows`), no "
    "checkpointing (every activation a step keeps is in its peak), bf16 base, bf16 autocast. activations = what is "
    "live after forward above the parameters and optimizer state; step bytes = the DRAM traffic of every op of the "
    "step. Ours keeps the experts' inputs and pre-activations and the thin x A^T and h A^T (kernels/moe.py); peft's "
    "ParamWrapper forms each expert tensor's whole (E, out, in) delta every forward and adds it to the weight, and "
    "that sum is kept for backward, per layer (tests/trainer/model/test_moe_model.py holds the two to the same loss "
    "and gradients). Ours runs its optimizer over fp32 master copies of the bf16 adapters with fp32 moments "
    "(setup above transformers', whose AdamW keeps bf16 moments of bf16 adapters). QLoRA: NF4 attention and experts "
    "in ours (trainer.model.quant.Experts4bit, dequantized per layer as it runs and again in backward), NF4 attention "
    "only in transformers' (its bitsandbytes quantizer leaves the 3-D expert tensors in bf16, as loading a "
    "Qwen3-MoE with BitsAndBytesConfig(load_in_4bit=True) shows). For comparison, Unsloth reports "
)


def render_lora_stacks(rows: list[dict], env: dict, model: str = "llama-3.1-8b") -> str:
    moe = model in MOE_LORA_MODELS
    title = (
        f"# LoRA stacks (modelled): {MODEL_LADDERS[model]}, r 16 on attention and the experts, seq_len "
        f"{rows[0]['seq_len']}, micro batch 1"
        if moe
        else f"# LoRA stacks (modelled): Llama-3.1-8B, r 16 on every linear layer, seq_len {rows[0]['seq_len']}, "
        "micro batch 1"
    )
    intro = (
        MOE_INTRO + f"{unsloth_claim(model)} (its own claim; rank, targets and sequence length as its notebook "
        "sets them, not this table's)."
        if moe
        else LLAMA_INTRO
    )
    lines = [title, "", intro, "", common.env_header(env).replace("Measured on", "Modelled on"), ""]
    settings, stacks = (moe_lora_settings(model), MOE_LORA_STACKS) if moe else (LORA_SETTINGS, LORA_STACKS)
    for setting in settings:
        sel = {r["stack"]: r for r in rows if r["setting"] == setting}
        base = sel.get("ours_peft", sel["hf_peft"])  # QLoRA of an MoE: transformers + peft is the comparison
        versus = "vs ours-peft" if "ours_peft" in sel else "vs transformers"
        lines += [
            f"## {setting}",
            "",
            f"| stack | peak GB | activations GB | {versus} | step bytes GB | H100 ms | H200 ms |",
            "|---|---|---|---|---|---|---|",
        ]
        for name in stacks:
            if name not in sel:
                continue
            r = sel[name]
            ratio = r["activations_gb"] / base["activations_gb"]
            lines.append(
                f"| {r['stack_title']} | {r['peak_gb']:.2f} | {r['activations_gb']:.2f} | {ratio:.2f}x | "
                f"{r['step_bytes_gb']:.1f} | {r['ms']['h100']:.1f} | {r['ms']['h200']:.1f} |"
            )
        fused = sel["ours_fused"]

        def vs(other, key):
            a, b = (fused["ms"]["h100"], other["ms"]["h100"]) if key == "ms" else (fused[key], other[key])
            return f"{a / b:.2f}x"

        ours_peft = "ours_peft" in sel
        lines += [
            "",
            (
                f"Fused against peft's layers in our model: activations {vs(base, 'activations_gb')}, peak "
                f"{vs(base, 'peak_gb')}, modelled H100 step {vs(base, 'ms')}; "
                if ours_peft
                else ""
            )
            + "; ".join(
                f"against {stacks[name][1]}: activations {vs(sel[name], 'activations_gb')}, peak "
                f"{vs(sel[name], 'peak_gb')}, step {vs(sel[name], 'ms')}"
                for name in ("hf_peft", "hf_peft_liger")
                if name in sel
            )
            + ".",
            "",
        ]
    return "\n".join(lines)


def main_lora_stacks(args) -> list[dict]:
    env = common.env_info()
    moe = args.model in MOE_LORA_MODELS
    if moe:
        rows = lora_stack_rows(args.seq_len, env=env, settings=moe_lora_settings(args.model), stacks=MOE_LORA_STACKS)
    else:
        rows = lora_stack_rows(args.seq_len, env=env)
    stem = f"lora_stacks_{args.model}" if moe else "lora_stacks"
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    with (common.RESULTS / f"{stem}.jsonl").open("a") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")
    text = render_lora_stacks(rows, env, args.model if moe else "llama-3.1-8b")
    (common.RESULTS / f"{stem}.md").write_text(text)
    print(text)
    return rows
