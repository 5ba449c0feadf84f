"""The step roofline's results: a trace summed by category on a Device (`summarise`), the md (`render`: modelled ms by
category and stack, where the peak memory is, the targets, measured step times beside the modelled ones) and the
chart."""

from __future__ import annotations

import json
from pathlib import Path

from bench import common
from bench.roofline.stacks import FLA_PAIRS, OUR_MODELS
from bench.roofline.tracing import CATEGORIES, Device, Trace
from bench.roofline.transformers_stacks import REPORT_NOTE, TRANSFORMERS_MODELS

FLA_NOTE = (
    "flash-linear-attention's recurrence in place of the PyTorch one (fla-core installed: ours calls it, "
    "transformers' kernel hub finds it; its kernels' bytes and FLOPs read from fla's source, "
    "bench/roofline/op_models.py FlaGatedDeltaRuleModel; transformers' conv stays PyTorch's)."
)
LIGER_NOTE = (
    "liger-kernel 0.8.5's patches for its model_type (apply_liger_kernel_to_<model_type>(model=...), what "
    "transformers' use_liger_kernel=True applies; bench/roofline/stacks.py `_with_liger`)"
)
# What the md of another architecture of ours says about its stacks, by model type
OUR_MODELS_NOTES = {
    "qwen3_5_text": (
        "Stacks: **ours** = our CausalLM (use_kernels) + FusedAdamW: its Gated DeltaNet layers' causal conv + SiLU and "
        "gated norm by our Triton kernels' byte models (bench/bench_causal_conv1d.py, bench/bench_gated_rms_norm.py), "
        "the recurrence as the chunked reference in PyTorch runs it (kernels.chunk_gated_delta_rule_ref: what a GPU "
        "without fla-core runs), the q/k L2 norm and the decay and beta gating as PyTorch ops; **hf** = transformers' "
        "Qwen3_5ForCausalLM (sdpa) in its pure-PyTorch path (no fla, no causal-conv1d: its "
        "torch_chunk_gated_delta_rule and conv fallback) + torch's fused AdamW, the HF Trainer's loss call; "
        f"**ours_fla**, **hf_fla**: each with {FLA_NOTE} **hf_fla_liger** = hf_fla after {LIGER_NOTE} (for "
        "Qwen3.5: its zero-centred RMSNorm, SwiGLU MLP and fused linear cross-entropy; it has no RoPE for these "
        "models and leaves the Gated DeltaNet layers as they are). Attention (every fourth layer): sdpa, modelled "
        "as flash attention."
    ),
    "qwen3_moe": (
        "Stacks: **ours** = our CausalLM (use_kernels) + FusedAdamW: each MoE layer's experts by our Triton grouped "
        "GEMMs' byte model (bench/bench_moe.py's traffic_parts at an ideal tiling: each operand read once, as every "
        "aten matmul is counted; the fp32 master weights read in the kernels, dW written in fp32) and their FLOPs, the "
        "rows spread evenly over the experts; the routers and the routing sort as PyTorch ops; **hf** = transformers' "
        "Qwen3MoeForCausalLM (sdpa) with its default grouped_mm experts (torch._grouped_mm, its FLOPs counted here: "
        "torch's flop counter has none) + torch's fused AdamW, the HF Trainer's loss call; **hf_liger** = hf after "
        f"{LIGER_NOTE} (for Qwen3-MoE: its RoPE, RMSNorm, fused linear cross-entropy and fused MoE, LigerExperts: "
        "liger_kernel/ops/fused_moe.py's grouped GEMMs by their byte model, op_models.liger_fused_moe_parts, checked "
        "against the meter, at the same ideal tiling; it reads the fp32 weights in its kernels under autocast and "
        "zero-fills the fp32 weight gradients before writing them). A full fine-tune on one device, unsharded: the "
        "optimizer state alone exceeds a GPU; the figures compare the stacks' work per step, not a run that fits."
    ),
    "gpt_oss": (
        "Stacks: **ours** = our CausalLM (use_kernels) + FusedAdamW: the experts by our grouped GEMMs' byte model "
        "(the interleaved, biased, clamped-SwiGLU layout) as in roofline_qwen3-30b-a3b; attention through flex "
        "attention (what CUDA runs for sliding windows and sinks), modelled as flash attention with the layer's "
        "window (128 on every other layer) and the sinks' rescale from its log-sum-exp; **hf** = transformers' "
        "GptOssForCausalLM with eager attention (its default: it has no SDPA path, the sinks sit in its explicit "
        "softmax; the T x T scores are materialised) and its grouped_mm experts + torch's fused AdamW, the HF "
        f"Trainer's loss call; **hf_liger** = hf after {LIGER_NOTE} (for gpt-oss: its RoPE, RMSNorm and fused "
        "linear cross-entropy; liger's fused MoE does not cover gpt-oss's experts, which stay grouped_mm). A full "
        "fine-tune on one device, unsharded: the figures compare the stacks' work per step, not a run that fits."
    ),
    "qwen3_5_moe_text": (
        "Stacks: **ours** = our CausalLM (use_kernels) + FusedAdamW: Qwen3.5's layers as in roofline_qwen3.5-9b (our "
        "conv and gated norm by their byte models, the recurrence as the chunked reference in PyTorch runs it) and "
        "every layer's routed experts by our grouped GEMMs' byte model as in roofline_qwen3-30b-a3b, the gated shared "
        "expert through our SwiGLU kernel; **hf** = transformers' Qwen3_5MoeForCausalLM (sdpa) in its pure-PyTorch "
        "path (no fla, no causal-conv1d) with its default grouped_mm experts + torch's fused AdamW, the HF Trainer's "
        f"loss call; **ours_fla**, **hf_fla**: each with {FLA_NOTE} **hf_fla_liger** = hf_fla after {LIGER_NOTE} "
        "(for Qwen3.5-MoE: its zero-centred RMSNorm, fused linear cross-entropy and fused MoE for the routed experts, "
        "as in roofline_qwen3-30b-a3b). A full fine-tune on one device, unsharded: the figures compare the stacks' "
        "work per step, not a run that fits."
    ),
}
# Targets of issue 20 (modelled): ours / hf_liger step time at 0% and at 50% ignored, ours / hf, peak memory.
TARGET_VS_LIGER = {0.0: 0.97, 0.5: 0.92}
TARGET_VS_HF = 0.85


def summarise(trace: Trace, dev: Device) -> dict:
    ms = {c: 0.0 for c in CATEGORIES}
    launches = {c: 0 for c in CATEGORIES}
    total_bytes = total_flops = 0.0
    for op in trace.ops:
        ms[op.category] += 1e3 * op.seconds(dev)
        launches[op.category] += op.launches
        total_bytes += op.bytes
        total_flops += op.flops
    return {"ms_" + c: ms[c] for c in CATEGORIES} | {
        "ms_step": sum(ms.values()),
        "launches": sum(launches.values()),
        "bytes": total_bytes,
        "flops": total_flops,
        "peak_memory_gb": trace.peak / 1e9,
        "peak_at": trace.peak_phase,
        "peak_by_phase_gb": {k: v / 1e9 for k, v in trace.phase_peaks.items()},
        "peak_breakdown_gb": {k: v / 1e9 for k, v in sorted(trace.at_peak.items(), key=lambda kv: -kv[1])},
        "launch_overhead_ms": 1e3 * dev.launch_s * sum(launches.values()),
    }


def _measured(config_name: str, seq_len: int, micro_batch: int) -> dict:
    """The newest GPU row per impl in common.RESULTS / "train.jsonl" at this model, sequence and micro batch:
    {impl: {"step_ms", "grad_accum", "device"}}. A step of k accumulated micro batches is compared with k modelled
    forward + backward passes and one optimizer step (`modelled_step_ms`)."""
    path = common.RESULTS / "train.jsonl"
    out: dict = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if (
            row.get("perf_figure")
            and row.get("status") == "ok"
            and row.get("model") == config_name
            and row.get("seq_len") == seq_len
            and row.get("micro_batch") == micro_batch
        ):
            out[row["impl"]] = {
                "step_ms": row["step_ms"],
                "grad_accum": row.get("grad_accum", 1),
                "device": row.get("device"),
            }
    return out


def modelled_step_ms(row: dict, grad_accum: int) -> float:
    """A modelled row's step time with `grad_accum` micro batches per optimizer step: the forward and backward (and
    everything but the optimizer category) once per micro batch, clipping and the optimizer step once."""
    return grad_accum * (row["ms_step"] - row["ms_optimizer"]) + row["ms_optimizer"]


def results_stem(model: str) -> str:
    """The results files' name: roofline (.md, .jsonl, .png) for our model's Llama architectures (the Llama runs),
    roofline_<model> for a model of the transformers path or another architecture of ours (qwen3.5-9b), so that its
    run leaves the Llama results as they are."""
    return f"roofline_{model}" if model in TRANSFORMERS_MODELS or model in OUR_MODELS else "roofline"


def _stacks(rows: list[dict]) -> list[str]:
    """The stacks of the rows, in their order (ours, ours_liger, hf, hf_liger; a transformers-path model's three)."""
    return list(dict.fromkeys(r["stack"] for r in rows))


def _verdict(value: float, target: float) -> str:
    return "met" if value <= target else f"MISSED by {100 * (value / target - 1):.1f}%"


def render(rows: list[dict], dev: Device, measured: dict, args) -> str:
    lines = [
        f"# Step roofline (modelled): {args.model}, seq_len {args.seq_len}, micro batch {args.micro_batch}",
        "",
        f"Every figure here is **modelled** (bench/roofline/, its docstring says how) for an {dev.name}: "
        f"{dev.bandwidth / 1e12:.1f} TB/s, {dev.peak_flops / 1e12:.0f} TFLOP/s bf16, "
        f"{dev.launch_s * 1e6:.0f} us per launch. One step: forward (bf16 autocast over fp32 parameters), "
        "backward, clipping, optimizer step.",
        "",
        common.env_header(rows[-1]).replace("Measured on", "Modelled on"),
        "",
    ]
    if args.model in TRANSFORMERS_MODELS:
        lines += [REPORT_NOTE, ""]
    if args.model in OUR_MODELS:
        lines += [OUR_MODELS_NOTES[OUR_MODELS[args.model]["model_type"]], ""]
    stacks = _stacks(rows)
    baselines = [s for s in ("hf_liger", "hf") if s in stacks]  # what ours is divided by
    pairs = [("ours", b) for b in baselines] + [p for p in FLA_PAIRS if set(p) <= set(stacks)]
    for ignored in sorted({r["ignored"] for r in rows}):
        sel = {r["stack"]: r for r in rows if r["ignored"] == ignored}
        lines += [
            f"## {100 * ignored:.0f}% of targets ignored (modelled ms)",
            "",
            "| category | " + " | ".join(stacks) + "".join(f" | {a}/{b}" for a, b in pairs) + " |",
            "|---|" + "---|" * (len(stacks) + len(pairs)),
        ]
        for key in [f"ms_{c}" for c in CATEGORIES] + ["ms_step", "launch_overhead_ms"]:
            vals = [sel[s][key] for s in stacks]

            def ratio(pair, key=key):
                return f"{sel[pair[0]][key] / sel[pair[1]][key]:.3f}" if sel[pair[1]][key] else "-"

            label = key[3:] if key.startswith("ms_") else key
            lines.append(
                f"| {label} | " + " | ".join(f"{v:.3f}" for v in vals) + "".join(f" | {ratio(p)}" for p in pairs) + " |"
            )
        for key, fmt in (
            ("launches", "{:.0f}"),
            ("peak_memory_gb", "{:.2f}"),
            ("bytes", "{:.3g}"),
            ("flops", "{:.3g}"),
        ):
            vals = [sel[s][key] for s in stacks]
            lines.append(
                f"| {key} | "
                + " | ".join(fmt.format(v) for v in vals)
                + "".join(f" | {sel[a][key] / sel[b][key]:.3f}" for a, b in pairs)
                + " |"
            )
        lines.append("")
    zero = {r["stack"]: r for r in rows if r["ignored"] == 0.0}
    for other in baselines:
        diffs = sorted(((zero["ours"][f"ms_{c}"] - zero[other][f"ms_{c}"], c) for c in CATEGORIES), key=lambda d: d[0])
        lines.append(
            f"ours - {other} at 0% ignored, modelled ms by category (faster first): "
            + ", ".join(f"{c} {d:+.2f}" for d, c in diffs if abs(d) >= 0.05)
            + "."
        )
        lines.append("")
    lines += peak_lines(zero)
    if args.model in TRANSFORMERS_MODELS or args.model in OUR_MODELS:  # issue 20's targets are the Llama runs'
        lines += ["## Ratios (modelled)", ""]
        lines += [f"- {r}" for r in ratio_lines(rows)]
    else:
        lines += ["## Targets (modelled)", ""]
        for r in check_targets(rows):
            lines.append(f"- {r}")
    lines += ["", "## Measured beside modelled", ""]
    if measured.get("ours") and (measured.get("hf_liger") or measured.get("hf")):
        zero = {r["stack"]: r for r in rows if r["ignored"] == 0.0}
        k = {impl: m["grad_accum"] for impl, m in measured.items()}
        for impl in ("ours", "hf_liger", "hf"):
            if impl in measured and impl in zero:
                got, mod = measured[impl]["step_ms"], modelled_step_ms(zero[impl], k[impl])
                lines.append(
                    f"- {impl} at 0% ignored: measured {got:.1f} ms a step of {k[impl]} micro batches on "
                    f"{measured[impl]['device']}, modelled {mod:.1f} ms for an {dev.name}: measured/modelled "
                    f"{got / mod:.3f}"
                )
        for other in ("hf_liger", "hf"):
            if measured.get(other) and k[other] == k["ours"]:
                m = measured["ours"]["step_ms"] / measured[other]["step_ms"]
                mod = modelled_step_ms(zero["ours"], k["ours"]) / modelled_step_ms(zero[other], k[other])
                lines.append(
                    f"- ours/{other} at 0% ignored: measured {m:.3f} (train.jsonl beside this file), modelled "
                    f"{mod:.3f}, gap {m - mod:+.3f}"
                )
    else:
        lines.append(
            "No GPU rows of this model, sequence length and micro batch in the train.jsonl beside this file yet: "
            "the measured ratios will stand here beside the modelled ones, and the gap is a finding."
        )
    lines += ["", f"![modelled step time by category]({results_stem(args.model)}.png)", ""]
    return "\n".join(lines)


def peak_lines(sel: dict) -> list[str]:
    """Where each stack's modelled peak is (at one ignored fraction): the allocation that reached it, the peak of each
    phase, and the live bytes at the peak by where they were allocated (Trace.where), largest first."""
    lines = [
        "## Where the peak memory is (modelled, 0% ignored)",
        "",
        "Live bytes at each stack's peak by where they were allocated (setup: parameters, buffers and optimizer "
        "state; forward:<module or modelled op>; backward:<autograd node>), in GB; the peak of each phase after it.",
        "",
        "| stack | peak GB | reached at | live at the peak, largest first | phase peaks |",
        "|---|---|---|---|---|",
    ]
    for stack in sel:
        row = sel[stack]
        parts = ", ".join(f"{k} {v:.3f}" for k, v in row["peak_breakdown_gb"].items() if v >= 0.0005)
        phases = ", ".join(f"{k} {v:.2f}" for k, v in row["peak_by_phase_gb"].items())
        lines.append(f"| {stack} | {row['peak_memory_gb']:.3f} | {row['peak_at']} | {parts} | {phases} |")
    return [*lines, ""]


def check_targets(rows: list[dict]) -> list[str]:
    out = []
    for ignored in sorted({r["ignored"] for r in rows}):
        sel = {r["stack"]: r for r in rows if r["ignored"] == ignored}
        target = TARGET_VS_LIGER.get(ignored, TARGET_VS_LIGER[0.5] if ignored > 0 else TARGET_VS_LIGER[0.0])
        v = sel["ours"]["ms_step"] / sel["hf_liger"]["ms_step"]
        out.append(
            f"{100 * ignored:.0f}% ignored: modelled step ours/hf_liger {v:.3f} <= {target}: {_verdict(v, target)}"
        )
        v = sel["ours"]["ms_step"] / sel["hf"]["ms_step"]
        out.append(
            f"{100 * ignored:.0f}% ignored: modelled step ours/hf {v:.3f} <= {TARGET_VS_HF}: "
            f"{_verdict(v, TARGET_VS_HF)}"
        )
        v = sel["ours"]["peak_memory_gb"] / sel["hf_liger"]["peak_memory_gb"]
        out.append(f"{100 * ignored:.0f}% ignored: modelled peak memory ours/hf_liger {v:.3f} <= 1: {_verdict(v, 1.0)}")
    return out


def ratio_lines(rows: list[dict]) -> list[str]:
    """ours against each other stack (and FLA_PAIRS where both ran), modelled step time and peak memory,
    at each ignored fraction."""
    out = []
    for ignored in sorted({r["ignored"] for r in rows}):
        sel = {r["stack"]: r for r in rows if r["ignored"] == ignored}
        pairs = [("ours", other) for other in sel if other != "ours"]
        pairs += [p for p in FLA_PAIRS if set(p) <= set(sel)]
        for mine, other in pairs:
            step = sel[mine]["ms_step"] / sel[other]["ms_step"]
            peak = sel[mine]["peak_memory_gb"] / sel[other]["peak_memory_gb"]
            out.append(
                f"{100 * ignored:.0f}% ignored: {mine}/{other} modelled step time {step:.3f} "
                f"({sel[mine]['ms_step']:.1f} / {sel[other]['ms_step']:.1f} ms), peak memory {peak:.3f} "
                f"({sel[mine]['peak_memory_gb']:.2f} / {sel[other]['peak_memory_gb']:.2f} GB)"
            )
    return out


def chart(rows: list[dict], path: Path) -> Path:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(10, 5))
    labels = [f"{r['stack']}\n{100 * r['ignored']:.0f}% ign." for r in rows]
    bottom = [0.0] * len(rows)
    for c in CATEGORIES:
        vals = [r[f"ms_{c}"] for r in rows]
        ax.bar(labels, vals, bottom=bottom, label=c)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("modelled ms per step")
    ax.set_title(f"Step time by category, modelled for an {rows[0]['modelled_device']} (not measured)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return common.save_figure(fig, path)
