"""Benchmark one AdamW step: ours (`kernels.FusedAdamW`) vs torch.optim.AdamW foreach=True and fused=True.

The parameter list is a Llama-3.2-1B-like model's (16 layers, hidden 2048, MLP 8192, 32/8 heads of 64,
vocab 128256, tied embeddings: 1.24 B parameters in 146 tensors) on a GPU; a tiny model of the same
structure on a CPU. Every variant keeps fp32 optimizer state:
- torch_foreach_fp32 / torch_fused_fp32: torch.optim.AdamW on fp32 parameters (the usual way to get fp32
  state from torch: fp32 master parameters, grads in fp32);
- ours_fp32: the same fp32 parameters through FusedAdamW;
- ours_bf16_master: bf16 parameters and grads, fp32 master copy inside the optimizer (our default);
- ours_bf16_sr: bf16 parameters and grads, stochastic rounding, no master copy.
Reference row, not like-for-like: torch_fused_bf16 is torch fused=True on bf16 parameters, whose state is
then bf16 too (14 B per element instead of 28).

GB/s is effective bandwidth: the bytes a step must move with that variant's layout (28 B per element for
fp32 state with fp32 params or with bf16 params + master, 22 B with stochastic rounding, 14 B for the bf16
reference row; see kernels/adamw.py) over the measured time; foreach moves about 80 B in ten passes but is
credited with 28. Byte model of our rows, per parameter (read + write), against the least an AdamW step on
parameters of that dtype with fp32 moments must move:
    ours_fp32         16 + 12    min 16 + 12
    ours_bf16_master  14 + 14    min 12 + 10 (the fp32 master copy costs 6 B per element, for exactness)
    ours_bf16_sr      12 + 10    min 12 + 10
Exact totals: `traffic_model(variant, numels)` -> (read, write) bytes of the step: the per-element bytes above,
plus 84 B read per 2048-element program (its block-table entry, 8 B; its tensor's table row, 6 addresses and
numel, 56 B; the betas, 16 B; its step counter, 4 B), plus the step counters' `torch._foreach_add_` (4 B read
and written per tensor); checked against bench/traffic.py's count by tests/bench/test_byte_models.py (it
agrees with the per-element figures: the meter measured 16 + 12, 14 + 14 and 12 + 10 exactly).
Speed-ups are against torch_fused_fp32 and torch_foreach_fp32 measured in the same run.
GPU target: ours_bf16_master >= 1.0x torch_fused_fp32 and >= 2.5x torch_foreach_fp32.
ours_*_cuda: the same variants through the CUDA C++ op (csrc/adamw.cu, kernels._C) instead of the Triton kernel, run
where the extension is built (skipped otherwise, with the reason); kernels/adamw.py's dispatch default
(_CUDA_OP_FASTER_DTYPES: the parameter dtypes KERNELS_ADAMW_IMPL=auto sends to the op, bf16) was set from these rows
of the first H200 run (bench/results/h200/kernels.md).

Usage:
    python bench/bench_adamw.py              # GPU: the Llama-3.2-1B parameter list
    python bench/bench_adamw.py --quick      # CPU: a tiny parameter list, only proves the script runs
    python bench/bench_adamw.py --variants ours_bf16_master,torch_fused_fp32
Rows go to bench/results/adamw.jsonl (+ .md) via bench.common.write_rows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import common  # noqa: E402
from kernels import FusedAdamW  # noqa: E402
from kernels.adamw import adamw_impl, cuda_op_unavailable, forced_impl  # noqa: E402

# name: (param dtype, implementation, bytes per element a step must move). ours_*_cuda: the same optimizer through
# the CUDA C++ op (csrc/adamw.cu) instead of the Triton kernel; skipped where kernels._C is not built.
VARIANTS = {
    "torch_foreach_fp32": (torch.float32, "foreach", 28),
    "torch_fused_fp32": (torch.float32, "fused", 28),
    "ours_fp32": (torch.float32, "ours", 28),
    "ours_bf16_master": (torch.bfloat16, "ours", 28),
    "ours_bf16_sr": (torch.bfloat16, "ours_sr", 22),
    "ours_fp32_cuda": (torch.float32, "ours", 28),
    "ours_bf16_master_cuda": (torch.bfloat16, "ours", 28),
    "ours_bf16_sr_cuda": (torch.bfloat16, "ours_sr", 22),
    "torch_fused_bf16": (torch.bfloat16, "fused", 14),
}
# Our variants: bytes read/written per parameter and the minimum for their parameter dtype (module docstring).
BYTE_MODELS = {
    "ours_fp32": common.ByteModel(16, 12, 16, 12),
    "ours_bf16_master": common.ByteModel(14, 14, 12, 10),
    "ours_bf16_sr": common.ByteModel(12, 10, 12, 10),
}
BYTE_MODELS.update({f"{name}_cuda": model for name, model in BYTE_MODELS.items()})
# Per 2048-element program of the Triton kernel: block-table entry (8) + table row (6 addresses + numel, 56) + betas
# (16) + step counter (4), measured with bench/traffic.py.
PROGRAM_READ_BYTES = 84
BLOCK = 2048


def traffic_parts(variant: str, numels: list[int]) -> dict[str, tuple[int, int]]:
    """Exact (read, write) bytes of one step of our variant ("ours_fp32", "ours_bf16_master", "ours_bf16_sr") on
    tensors of these sizes, per launch: the Triton kernel and the step counters' "aten._foreach_add_"."""
    model = BYTE_MODELS[variant.removesuffix("_cuda")]
    n = sum(numels)
    programs = sum(-(-k // BLOCK) for k in numels)
    return {
        "_adamw_kernel": (int(model.read * n) + PROGRAM_READ_BYTES * programs, int(model.write * n)),
        "aten._foreach_add_": (4 * len(numels), 4 * len(numels)),
    }


def traffic_model(variant: str, numels: list[int]) -> tuple[int, int]:
    """(read, write) bytes of one step (`traffic_parts` summed)."""
    parts = traffic_parts(variant, numels).values()
    return sum(r for r, _ in parts), sum(w for _, w in parts)


# (layers, hidden, intermediate, heads, kv heads, vocab)
MODELS = {
    "llama-3.2-1b": (16, 2048, 8192, 32, 8, 128256),
    "tiny": (2, 64, 256, 4, 2, 512),
    "micro": (1, 32, 64, 2, 1, 96),
}


def _exact_byte_model(variant: str, numels: list[int]) -> common.ByteModel:
    """Per element: `traffic_model`'s exact bytes and the per-element minimum."""
    n = sum(numels)
    per_elem = BYTE_MODELS[variant]
    return common.ByteModel.from_totals(
        traffic_model(variant, numels), (per_elem.min_read * n, per_elem.min_write * n), n
    )


def llama_shapes(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int) -> list[tuple]:
    """Parameter shapes of a Llama-family decoder with tied embeddings, in model order."""
    head_dim = hidden // heads
    per_layer = [
        (hidden,),  # input_layernorm
        (heads * head_dim, hidden),  # q_proj
        (kv_heads * head_dim, hidden),  # k_proj
        (kv_heads * head_dim, hidden),  # v_proj
        (hidden, heads * head_dim),  # o_proj
        (hidden,),  # post_attention_layernorm
        (intermediate, hidden),  # gate_proj
        (intermediate, hidden),  # up_proj
        (hidden, intermediate),  # down_proj
    ]
    return [(vocab, hidden)] + per_layer * layers + [(hidden,)]


def build(variant: str, shapes: list[tuple], device: torch.device):
    """(params with grads, optimizer) for one variant; grads are fixed random values."""
    dtype, impl, _ = VARIANTS[variant]
    gen = torch.Generator(device="cpu").manual_seed(0)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.02).to(device=device, dtype=dtype))
        p.grad = (torch.randn(shape, generator=gen) * 1e-3).to(device=device, dtype=dtype)
        params.append(p)
    hyper = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if impl == "foreach":
        opt = torch.optim.AdamW(params, foreach=True, **hyper)
    elif impl == "fused":
        opt = torch.optim.AdamW(params, fused=True, **hyper)
    else:
        opt = FusedAdamW(params, master_weights=impl == "ours", **hyper)
    return params, opt


def bench_variant(variant: str, shapes: list[tuple], quick: bool) -> dict:
    device = common.device()
    params, opt = build(variant, shapes, device)
    _, impl, bytes_per_elem = VARIANTS[variant]
    with forced_impl("cuda" if variant.endswith("_cuda") else "triton"):
        opt.step()  # state allocation and compilation outside the timing
        reps = {"rep": 20, "cpu_reps": 2} if quick else {}
        timing = common.measure(opt.step, **reps)
        path = adamw_impl(params[0])[0] if impl.startswith("ours") else "torch"
        peak = common.peak_extra_memory(opt.step)
    numel = sum(p.numel() for p in params)
    row = {
        "op": "adamw",
        "impl": variant,
        "path": path,
        "n_params": numel,
        "n_tensors": len(params),
        "bytes_per_elem": bytes_per_elem,
        **timing,
        **common.physics(timing["ms"], bytes_moved=bytes_per_elem * numel),
        "peak_extra_bytes": peak,
        **(
            _exact_byte_model(variant, [p.numel() for p in params]).columns(numel, timing["ms"])
            if variant in BYTE_MODELS
            else {}
        ),
    }
    del params, opt
    if common.on_gpu():
        torch.cuda.empty_cache()
    return row


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="a tiny parameter list and few repetitions (CPU smoke run)")
    p.add_argument(
        "--model",
        choices=sorted(MODELS),
        default=None,
        help="parameter list (default: llama-3.2-1b on GPU, tiny on CPU, micro with --quick)",
    )
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of: {', '.join(VARIANTS)}")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants:
        p.error(f"--variants: {', '.join(unknown) or '(empty)'} not in {', '.join(VARIANTS)}")
    if args.model is None:
        args.model = "llama-3.2-1b" if common.on_gpu() else ("micro" if args.quick else "tiny")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    shapes = llama_shapes(*MODELS[args.model])
    missing = cuda_op_unavailable() if common.on_gpu() else "the CUDA op needs a GPU"
    if missing:
        skipped = [v for v in args.variants if v.endswith("_cuda")]
        if skipped:
            print(f"skipping {', '.join(skipped)}: {missing}")
        args.variants = [v for v in args.variants if v not in skipped]
    rows = [bench_variant(v, shapes, args.quick) for v in args.variants]
    env = common.env_info()
    base = {r["impl"]: r["ms"] for r in rows}
    for r in rows:
        r["model"] = args.model
        for baseline in ("torch_fused_fp32", "torch_foreach_fp32"):
            r[f"speedup_vs_{baseline}"] = base[baseline] / r["ms"] if baseline in base else None
        r.update(env)
    path = common.write_rows("adamw", rows)
    for r in rows:
        gbs = f"{r['gb_s']:8.1f} GB/s" if r.get("gb_s") is not None else ""
        fused = r["speedup_vs_torch_fused_fp32"]
        vs = f"  x{fused:.2f} vs torch fused" if fused is not None else ""
        print(f"{args.model} {r['impl']:<20} {r['ms']:9.3f} ms {gbs}{vs}" + common.byte_model_text(r))
    print(f"rows -> {path}" + ("" if common.on_gpu() else "  (CPU: not performance figures)"))
    return rows


if __name__ == "__main__":
    main()
