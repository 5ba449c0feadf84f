"""The LoRA stacks (`python -m bench.roofline --lora_stacks`, issue 34): one step of Llama-3.1-8B with LoRA r=16 per
LORA_SETTINGS x LORA_STACKS, fused LoRA (kernels.lora) against peft's layers, in our model and in transformers'."""

from __future__ import annotations

import json

import torch

from bench import common
from bench.roofline.ladder import LadderStack, Setting, ladder_step

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


def lora_stack_rows(seq_len: int = LORA_SEQ_LEN, config: dict | None = None, env: dict | None = None) -> list[dict]:
    """One modelled step (micro batch 1, `seq_len` tokens) per LORA_SETTINGS x LORA_STACKS: peak, what is live after
    forward above the parameters and optimizer state (the activations kept for backward), the step's modelled DRAM
    bytes and its time on each of DEVICES."""
    rows = []
    for setting_name, setting in LORA_SETTINGS.items():
        for stack_name, (stack, title) in LORA_STACKS.items():
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


def render_lora_stacks(rows: list[dict], env: dict) -> str:
    lines = [
        f"# LoRA stacks (modelled): Llama-3.1-8B, r 16 on every linear layer, seq_len {rows[0]['seq_len']}, "
        "micro batch 1",
        "",
        "Every figure here is **modelled** on meta tensors (bench/roofline/lora_stacks.py: `lora_stack_rows`), no "
        "checkpointing (every activation a step keeps is in its peak), bf16 base, bf16 autocast. activations = what is "
        "live after forward above the parameters and optimizer state; step bytes = the DRAM traffic of every op of the "
        "step. The fused path's values and gradients equal peft's bit for bit "
        "(tests/trainer/model/test_fused_lora.py). It keeps each input once and the thin x A^T; peft's layers keep, "
        "per adapted layer, dropout's mask and dropped copy, and with fp32 adapters the bf16 casts of their inputs. "
        "With dropout the fused backward draws the masks again (PyTorch's dropout on the saved generator state): bytes "
        "that peft's kept copies save.",
        "",
        common.env_header(env).replace("Measured on", "Modelled on"),
        "",
    ]
    for setting in LORA_SETTINGS:
        sel = {r["stack"]: r for r in rows if r["setting"] == setting}
        base = sel["ours_peft"]
        lines += [
            f"## {setting}",
            "",
            "| stack | peak GB | activations GB | vs ours-peft | step bytes GB | H100 ms | H200 ms |",
            "|---|---|---|---|---|---|---|",
        ]
        for name in LORA_STACKS:
            r = sel[name]
            ratio = r["activations_gb"] / base["activations_gb"]
            lines.append(
                f"| {r['stack_title']} | {r['peak_gb']:.2f} | {r['activations_gb']:.2f} | {ratio:.2f}x | "
                f"{r['step_bytes_gb']:.1f} | {r['ms']['h100']:.1f} | {r['ms']['h200']:.1f} |"
            )
        fused, hf = sel["ours_fused"], sel["hf_peft"]

        def vs(other, key):
            a, b = (fused["ms"]["h100"], other["ms"]["h100"]) if key == "ms" else (fused[key], other[key])
            return f"{a / b:.2f}x"

        lines += [
            "",
            f"Fused against peft's layers in our model: activations {vs(base, 'activations_gb')}, peak "
            f"{vs(base, 'peak_gb')}, modelled H100 step {vs(base, 'ms')}; against transformers + peft: activations "
            f"{vs(hf, 'activations_gb')}, step {vs(hf, 'ms')}.",
            "",
        ]
    return "\n".join(lines)


def main_lora_stacks(args) -> list[dict]:
    env = common.env_info()
    rows = lora_stack_rows(args.seq_len, env=env)
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    with (common.RESULTS / "lora_stacks.jsonl").open("a") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")
    text = render_lora_stacks(rows, env)
    (common.RESULTS / "lora_stacks.md").write_text(text)
    print(text)
    return rows
