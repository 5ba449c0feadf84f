"""The ladder's md (`render_ladder`: the modelled max context per setting x stack x GPU, each rung, the targets, the
optimizer state bytes, the calibration, published figures beside) and chart; `main_ladder` runs --ladder."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench import common
from bench.roofline.ladder import (
    ADAMW_STATE_BYTES_PER_PARAM,
    BNB_MIN_8BIT_SIZE,
    GIB,
    GPUS,
    LADDER_CHECK_SEQ_LEN,
    LADDER_FIT_SEQ_LENS,
    LADDER_RUNG,
    LADDER_TRACE_MAX_TILED,
    PCIE_BYTES_S,
    RESERVE_BYTES,
    SETTINGS,
    adamw_state_bytes,
    calibration_rows,
    ladder,
    ladder_config,
)

UNSLOTH_QLORA_8B = {  # Unsloth's published max context, Llama-3.1-8B QLoRA, batch 1
    "hf": {"24 GB": 5789, "40 GB": 12264, "80 GB": 28454},
    "unsloth": {"24 GB": 78475, "40 GB": 153977, "80 GB": 342733},
}
ALST_8B_FULL = {"80 GB": 32768, "141 GB": 65536}  # Snowflake ALST's baseline (ZeRO-3 CPU offload), one GPU
LADDER_TARGETS = {  # (setting, gpu): the modelled context ours should reach
    ("8b_qlora", "80 GB"): 500_000,
    ("8b_lora", "80 GB"): 400_000,
    ("8b_full_offload", "80 GB"): 600_000,
    ("8b_full_offload", "141 GB"): 1_500_000,
}
TARGET_VS_HF_LIGER_1B = 8.0  # 1B full fine-tune: ours' context over hf_liger's
TARGET_OFFLOAD_COST = 0.03  # offloading's modelled step-time cost at 32k tokens, of the step without it


def _top_live(step: dict, n: int = 3) -> str:
    largest = sorted(step["peak_breakdown_gb"].items(), key=lambda kv: -kv[1])[:n]  # the jsonl sorts keys by name
    return ", ".join(f"{k} {v:.2f} GB" for k, v in largest)


def _ladder_index(rows: list[dict]) -> dict:
    return {(r["setting"], r["stack"], r["gpu"]): r for r in rows if r["kind"] == "ladder"}


def ladder_targets(rows: list[dict]) -> list[str]:
    """Each target of the ladder, met or missed, with what bounds a miss (the largest live bytes at the peak)."""
    index = _ladder_index(rows)
    out = []
    for (setting, gpu), target in LADDER_TARGETS.items():
        r = index.get((setting, "ours", gpu))
        if r is None:
            continue
        verdict = "met" if r["max_seq_len"] >= target else "MISSED"
        line = f"{SETTINGS[setting].title}, {gpu}: modelled {r['max_seq_len']:,} tokens >= {target:,}: {verdict}"
        if verdict != "met":
            line += f"; bounded by (live at the peak, {r['peak_at']}): {_top_live(r)}"
        out.append(line)
    for gpu in GPUS:
        ours, liger = index.get(("1b_full", "ours", gpu)), index.get(("1b_full", "hf_liger", gpu))
        if ours and liger:
            ratio = ours["max_seq_len"] / liger["max_seq_len"] if liger["max_seq_len"] else math.inf
            verdict = "met" if ratio >= TARGET_VS_HF_LIGER_1B else "MISSED"
            line = (
                f"Llama-3.2-1B full fine-tune, {gpu}: modelled ours/hf_liger context {ratio:.2f}x "
                f">= {TARGET_VS_HF_LIGER_1B:.0f}x: {verdict}"
            )
            if verdict != "met":
                allowance = (ours["budget_bytes"] - 1e9 * ours["fit_a_gb"]) / (
                    TARGET_VS_HF_LIGER_1B * liger["max_seq_len"]
                )
                line += (
                    f"; 8x needs at most {allowance / 1e3:.1f} kB a token over ours' fixed "
                    f"{ours['fit_a_gb']:.2f} GB, ours' fitted slope is {ours['fit_b_bytes_per_token'] / 1e3:.1f} kB "
                    f"(hf_liger's {liger['fit_b_bytes_per_token'] / 1e3:.1f} kB); live at ours' peak "
                    f"({ours['peak_at']}): {_top_live(ours)}"
                )
            out.append(line)
    for r in rows:
        if r["kind"] == "offload_cost":
            verdict = "met" if r["offload_cost_frac"] <= TARGET_OFFLOAD_COST else "MISSED"
            out.append(
                f"{SETTINGS[r['setting']].title}: offloading's modelled step-time cost at {r['seq_len']:,} tokens "
                f"{100 * r['offload_cost_frac']:.2f}% ({r['offload_cost_ms']:.1f} ms over "
                f"{r['ms_step_without_offloading']:.0f} ms; {r['offloaded_gb']:.1f} GB each way) "
                f"<= {100 * TARGET_OFFLOAD_COST:.0f}%: {verdict}"
            )
    return out


def render_ladder(rows: list[dict], env: dict) -> str:
    index = _ladder_index(rows)
    stacks = list(dict.fromkeys(r["stack"] for r in rows if r["kind"] == "ladder"))
    lines = [
        "# Memory ladder (modelled): the largest context that fits, micro batch 1",
        "",
        "Every figure here is **modelled** (bench/roofline/ `--ladder`; its docstring says how): meta-tensor traces "
        "of one training step, peak = the largest sum of live device bytes. A context fits when its modelled peak is "
        f"at most the GPU's memory less a runtime reserve of {RESERVE_BYTES / GIB:.1f} GiB (CUDA context + allocator "
        f"fragmentation). Answers are multiples of {LADDER_RUNG} tokens. GPU totals: "
        + ", ".join(f"{g} = {t / GIB:.2f} GiB" for g, (t, _) in GPUS.items())
        + f". PCIe: {PCIE_BYTES_S / 1e9:.0f} GB/s effective per direction (Gen5 x16's 64 GB/s derated).",
        "",
        common.env_header(env).replace("Measured on", "Modelled on"),
        "",
        "Stacks: **hf** = transformers + flash attention (modelled as flash, as SDPA is) + gradient checkpointing; "
        "**hf_liger** = the same + liger-kernel (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy); **ours** = "
        "our kernels + gradient checkpointing + activation offloading + tiled MLP.",
        "",
        "## Modelled max context (tokens)",
        "",
        "| setting | stack | " + " | ".join(GPUS) + " |",
        "|---|---|" + "---|" * len(GPUS),
    ]
    for setting_name, setting in SETTINGS.items():
        for stack in stacks:
            cells = [index.get((setting_name, stack, g)) for g in GPUS]
            if not any(cells):
                continue
            lines.append(
                f"| {setting.title} | {stack} | "
                + " | ".join(f"{c['max_seq_len']:,}" if c else "-" for c in cells)
                + " |"
            )
    lines += [
        "",
        "## Each rung (modelled): peak, what is live at it, host memory, step time and offloading's cost",
        "",
        "Peak at the answer on the fit and, where traced, by the trace at it and at the next rung (GB = 1e9 bytes; "
        f"'fit only': ours with a tiled MLP past {LADDER_TRACE_MAX_TILED:,} tokens, where a trace takes minutes; its "
        "live bytes, host bytes and step time are extrapolated from the traces, `extrapolated_step`); live at the "
        "peak, largest first (for 'fit only' rows: at the longest trace); host = pinned "
        "host memory for the offloaded activations + (FSDP2 CPU offload) fp32 parameters, gradients and AdamW state "
        "(16 B/param); step = modelled compute + what PCIe copies outlast it by; offload cost = what activation "
        "offloading's copies add.",
        "",
        "| setting | stack | GPU | max T | traced | peak GB (fit) | peak GB (trace) | next rung GB | "
        "live at the peak | host GB | step ms | PCIe ms | offload cost ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["kind"] != "ladder":
            continue
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        lines.append(
            f"| {r['setting']} | {r['stack']} | {r['gpu']} | {r['max_seq_len']:,} | "
            f"{'yes' if r['confirmed_by_trace'] else 'fit only'} | {r['fit_peak_gb']:.2f} | "
            f"{fmt(r['peak_gb'], '.2f')} | {fmt(r['next_rung_peak_gb'], '.2f')} | {_top_live(r)} | "
            f"{r['host_total_gb']:.1f} | "
            f"{fmt(r['ms_step'], '.0f')} | {fmt(r['pcie_ms'], '.0f')} | {fmt(r['offload_cost_ms'], '.1f')} |"
        )
    lines += [
        "",
        "How linear the peak is: each (setting, stack)'s fit through traces at "
        + " and ".join(f"{t:,}" for t in LADDER_FIT_SEQ_LENS)
        + f" tokens, and the trace at {LADDER_CHECK_SEQ_LEN:,} against it:",
        "",
    ]
    seen = set()
    for r in rows:
        if r["kind"] == "ladder" and (r["setting"], r["stack"]) not in seen:
            seen.add((r["setting"], r["stack"]))
            lines.append(
                f"- {r['setting']} {r['stack']}: peak = {r['fit_a_gb']:.2f} GB + "
                f"{r['fit_b_bytes_per_token'] / 1e3:.1f} kB x T; the {LADDER_CHECK_SEQ_LEN:,}-token trace is "
                f"{100 * r['fit_check_deviation']:+.2f}% off it"
            )
    lines += ["", "## Targets (modelled)", ""] + [f"- {t}" for t in ladder_targets(rows)]
    lines += optimizer_state_lines()
    lines += [
        "",
        "## Calibration: the measured H200 ladder (Llama-3.2-1B full fine-tune, no checkpointing)",
        "",
        "bench/results/h200/train_memory_seq_len.jsonl (torch.cuda.max_memory_allocated, 1e9-byte GB) against the "
        "modelled peak at the same settings (stacks ours, hf, hf_liger without checkpointing or offloading).",
        "",
        "| stack | T | measured GB | modelled GB | modelled/measured |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if r["kind"] == "calibration":
            lines.append(
                f"| {r['stack']} | {r['seq_len']:,} | {r['measured_peak_gb']:.2f} | {r['modelled_peak_gb']:.2f} | "
                f"{r['modelled_over_measured']:.3f} |"
            )
    ratios = [r["modelled_over_measured"] for r in rows if r["kind"] == "calibration"]
    if ratios:
        worst = max(ratios, key=lambda v: abs(v - 1))
        lines += [
            "",
            f"Every rung within {100 * abs(worst - 1):.1f}% (the largest gap); none is over 25%, so no gap needs "
            "explaining beyond the model's stated limits."
            if abs(worst - 1) <= 0.25
            else f"The largest gap is {100 * (worst - 1):+.1f}%, over 25%: see the notes below.",
        ]
    lines += [
        "",
        "## Beside published figures",
        "",
        "Unsloth's published max context, Llama-3.1-8B QLoRA, batch 1, against the modelled QLoRA setting:",
        "",
        "| GPU | transformers + FA2 (Unsloth's) | hf (modelled) | modelled/published | Unsloth | ours (modelled) | "
        "ours/Unsloth |",
        "|---|---|---|---|---|---|---|",
    ]
    for gpu in ("24 GB", "40 GB", "80 GB"):
        hf, ours = index.get(("8b_qlora", "hf", gpu)), index.get(("8b_qlora", "ours", gpu))
        theirs_hf, theirs = UNSLOTH_QLORA_8B["hf"][gpu], UNSLOTH_QLORA_8B["unsloth"][gpu]
        if hf and ours:
            lines.append(
                f"| {gpu} | {theirs_hf:,} | {hf['max_seq_len']:,} | {hf['max_seq_len'] / theirs_hf:.2f} | "
                f"{theirs:,} | {ours['max_seq_len']:,} | {ours['max_seq_len'] / theirs:.2f} |"
            )
    gaps = [
        index[("8b_qlora", "hf", g)]["max_seq_len"] / v
        for g, v in UNSLOTH_QLORA_8B["hf"].items()
        if ("8b_qlora", "hf", g) in index
    ]
    if gaps and max(abs(g - 1) for g in gaps) > 0.25:
        hf80 = index.get(("8b_qlora", "hf", "80 GB"))
        lines += [
            "",
            f"The modelled transformers + FA2 contexts are {min(gaps):.2f}-{max(gaps):.2f}x Unsloth's published ones, "
            "a gap over 25%. What the model holds at hf's peak is the loss's full-vocabulary logits and their "
            f"gradients (fp32, 128,256 columns: at 80 GB, {_top_live(hf80) if hf80 else '-'}), and it counts exact "
            "allocations with a fixed reserve: the allocator's fragmentation around those multi-GB allocations, and "
            "whatever else their run held (their transformers/bitsandbytes versions, their checkpointing variant), "
            "are not in it. Their runs are not reproduced here, so the gap stands as a finding; on the measured H200 "
            "ladder (above) the same hf model is within the calibration table's ratios.",
        ]
    lines += [
        "",
        "Snowflake ALST's Llama-8B full fine-tune baselines (ZeRO-3 CPU offload of parameters and optimizer state) "
        "against the modelled FSDP2 CPU offload setting:",
        "",
        "| GPU | ALST baseline | hf (modelled) | hf/ALST | hf_liger (modelled) | ours (modelled) |",
        "|---|---|---|---|---|---|",
    ]
    for gpu, alst in ALST_8B_FULL.items():
        cells = [index.get(("8b_full_offload", s, gpu)) for s in ("hf", "hf_liger", "ours")]
        if all(cells):
            hf, liger, ours = (c["max_seq_len"] for c in cells)
            lines.append(f"| {gpu} | {alst:,} | {hf:,} | {hf / alst:.2f} | {liger:,} | {ours:,} |")
    lines += ["", "![modelled max context against GPU memory](ladder.png)", ""]
    return "\n".join(lines)


def optimizer_state_lines() -> list[str]:
    """The md's table of AdamW state bytes per parameter (measured) and what each option holds for a full fine-tune
    of the ladder's models."""
    models = {"llama-3.2-1b": "Llama-3.2-1B", "llama-3.1-8b": "Llama-3.1-8B"}
    configs = {model: ladder_config(model) for model in models}
    lines = [
        "",
        "## Optimizer state bytes per parameter (measured)",
        "",
        "AdamW's state by `--optim`, measured on the real optimizers (the state's bytes after one step, as the slope "
        "between a 4096 x 4096 and a 4096 x 4352 tensor: per-tensor constants left out; tests/bench/test_ladder.py "
        "holds the figures). The full fine-tunes above run the first (on the host under FSDP2 CPU offload, which "
        f"the 8-bit state cannot join). bitsandbytes keeps fp32 moments for tensors under {BNB_MIN_8BIT_SIZE:,} "
        "elements and, as transformers sets it up, for every embedding's weight; the GB columns count that.",
        "",
        "| --optim | state bytes / param | " + " | ".join(f"{t} full: state GB" for t in models.values()) + " |",
        "|---|---|" + "---|" * len(models),
    ]
    names = {
        "adamw_fused": "adamw_fused, adamw_torch, adamw_torch_fused (fp32 moments)",
        "adamw_fused state_dtype=bfloat16": "adamw_fused + optim_args state_dtype=bfloat16 (bf16 moments)",
        "adamw_bnb_8bit": "adamw_bnb_8bit, adamw_8bit, paged_adamw_8bit (bitsandbytes, 8-bit blockwise)",
    }
    for optim, rate in ADAMW_STATE_BYTES_PER_PARAM.items():
        cells = " | ".join(f"{adamw_state_bytes(configs[m], optim) / 1e9:.2f}" for m in models)
        lines.append(f"| {names[optim]} | {rate:g} | {cells} |")
    return lines


def ladder_chart(rows: list[dict], path: Path) -> Path:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, len(SETTINGS), figsize=(4.2 * len(SETTINGS), 4.2), sharey=True)
    index = _ladder_index(rows)
    stacks = list(dict.fromkeys(r["stack"] for r in rows if r["kind"] == "ladder"))
    xs = [GPUS[g][0] / 1e9 for g in GPUS]
    for ax, (setting_name, setting) in zip(axes, SETTINGS.items()):
        for stack in stacks:
            cells = [index.get((setting_name, stack, g)) for g in GPUS]
            pts = [(x, c["max_seq_len"]) for x, c in zip(xs, cells) if c and c["max_seq_len"]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=stack)
        if setting_name == "8b_qlora":
            for who, marker in (("hf", "x"), ("unsloth", "+")):
                pts = [(GPUS[g][0] / 1e9, v) for g, v in UNSLOTH_QLORA_8B[who].items()]
                ax.plot(*zip(*pts), marker=marker, linestyle="none", label=f"{who} (Unsloth's published)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(xs, [g for g in GPUS])
        ax.xaxis.set_minor_locator(plt.NullLocator())  # only the four GPUs' labels
        ax.set_title(setting.title, fontsize=8)
        ax.set_xlabel("GPU memory")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("modelled max context (tokens, batch 1)")
    fig.suptitle("Modelled memory ladder (not measured)")
    return common.save_figure(fig, path)


def main_ladder(args) -> list[dict]:
    jsonl = common.RESULTS / "ladder.jsonl"
    if args.render_only:  # the md and chart again from the rows a --ladder run wrote
        rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
        env = rows[0]
    else:
        env = common.env_info()
        rows = ladder(args.settings.split(","), args.ladder_stacks.split(","), GPUS, args.jobs)
        if args.calibration:
            rows += calibration_rows()
        rows = [r | env for r in rows]
        common.RESULTS.mkdir(parents=True, exist_ok=True)
        with jsonl.open("w") as f:
            for row in rows:
                f.write(json.dumps(row, sort_keys=True) + "\n")
    text = render_ladder(rows, env)
    (common.RESULTS / "ladder.md").write_text(text)
    ladder_chart(rows, common.RESULTS / "ladder.png")
    print(text)
    return rows
