"""Benchmark the routed experts of an MoE block (`kernels.moe_experts`): ours (the Triton grouped GEMMs) vs
transformers' eager expert loop (`moe_experts_ref`, one matmul pair per expert) vs `torch._grouped_mm`
(`moe_experts_grouped_mm`, transformers 5's "grouped_mm" experts and torchtitan's MoE).

Modes: forward (out), backward (dx, dtop_k_weights, dW and db from a saved forward), full (forward + backward).
FLOPs (N = T k assignment rows): forward 6 N H I (gate_up 4 N H I, down 2 N H I), backward 12 N H I (dh 2, dx 4,
dW_down 2, dW_gate_up 4), full 18 N H I; TFLOP/s from them.
Bytes: the least the op moves (s = activation element size, w = the weights'), per call
    forward   read x (T H s), the weights (3 E H I w) and the router weights; write out (T H s)
    backward  read dout, x, the weights and the saved gate_up (2 N I s); write dx, dW (3 E H I w), dtop_k_weights
Our issued bytes per launch are `traffic_parts` (equal to bench/traffic.py's meter in tests/bench/test_byte_models.py):
gemm1 reads x once per I block and each expert's W_gate_up once per row tile; gemm2 reads h once per H block and
W_down once per row tile, and writes (T k, H) rows that torch's sum folds to (T, H); the backward likewise plus the
(T k, H) dx rows and the per-expert weight-gradient passes (gate_up read once per H block, dout once per I block).

GPU: Qwen3-30B-A3B's experts (H 2048, I 768, E 128, k 8, SwiGLU) and gpt-oss-20b's (H 2880, I 2880, E 32, k 4,
transposed, interleaved, biases, clamped SwiGLU), bf16, tokens per expert (T k / E, random top-k routing) from 64 to
4096. CPU (--quick): one tiny shape through the Triton interpreter; rows say perf_figure=False (not performance).

    python bench/bench_moe.py                         # GPU, appends to bench/results/moe.jsonl
    python bench/bench_moe.py --model qwen3-30b-a3b --tokens-per-expert 512
    python bench/bench_moe.py --quick                 # CPU smoke run
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `bench` and `kernels` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if not torch.cuda.is_available():
    # Read when kernels' @triton.jit decorates, so before `kernels` is imported (see bench_rms_norm.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kernels  # noqa: E402
from bench import common  # noqa: E402
from kernels import moe  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("forward", "backward", "full")
PROVIDERS = ("ours", "torch", "grouped_mm")
SILU = dict(transposed=False, interleaved=False, act="silu")
GPT_OSS = dict(transposed=True, interleaved=True, act="gpt_oss")
# name: (hidden, intermediate, experts, k, layout and activation, biases)
MODELS = {
    "qwen3-30b-a3b": (2048, 768, 128, 8, SILU, False),
    "gpt-oss-20b": (2880, 2880, 32, 4, GPT_OSS, True),
    "tiny": (40, 24, 5, 2, GPT_OSS, True),  # --quick
}
GPU_TOKENS_PER_EXPERT = (64, 256, 1024, 4096)
CPU_TOKENS_PER_EXPERT = (13,)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def flops(mode: str, n: int, hidden: int, inter: int) -> int:
    return {"forward": 6, "backward": 12, "full": 18}[mode] * n * hidden * inter


def traffic_parts(
    mode: str,
    counts: list[int],
    tokens: int,
    k: int,
    hidden: int,
    inter: int,
    s: int,
    w: int,
    *,
    bias: bool,
    router_size: int | None = None,
    tiles: moe.Tiles | None = None,
) -> dict[str, tuple[int, int]]:
    """Exact issued (read, write) bytes per kernel for expert row counts `counts` (sum T k), activations of element
    size s, weights and biases of w, router weights of `router_size` (default s): the Triton kernels' names and the
    torch ops between them as bench/traffic.py's `torch_ops` names them (the k slots' sums, the dtop_k_weights
    partials' sum and cast). The routing sort's torch ops are not modelled (O(T k) integers).
    Every program reads two int32 of the tile table (row start, end), a real tile's a third (its expert)."""
    tiles = tiles or (moe.GPU_TILES if common.on_gpu() else moe.CPU_TILES)
    r = router_size or s
    n, experts, bm = tokens * k, len(counts), tiles.block_m
    real = sum(_cdiv(c, bm) for c in counts)  # tiles with rows
    grid = moe.max_tiles(n, experts, bm)
    nb1, nb2 = _cdiv(inter, tiles.block_n1), _cdiv(hidden, tiles.block_n2)
    table1, table2 = 8 * grid * nb1 + 4 * real * nb1, 8 * grid * nb2 + 4 * real * nb2
    b = w if bias else 0
    out: dict[str, tuple[int, int]] = {}
    slot_sum = (n * hidden * s, tokens * hidden * s) if k > 1 else (0, 0)
    if mode in ("forward", "full"):
        # gemm1: tokens and x rows per I block, W_gate_up (2I columns over H) and the bias per tile; h and gate_up
        g1 = (table1 + nb1 * n * (4 + hidden * s) + real * 2 * inter * (hidden * w + b), 3 * n * inter * s)
        # gemm2: h rows, assignments and router weights per H block, W_down and the bias per tile; (T k, H) rows
        g2 = (table2 + nb2 * n * (inter * s + 4 + r) + real * hidden * (inter * w + b), n * hidden * s)
        out["_moe_gemm1_kernel"], out["_moe_gemm2_kernel"] = g1, g2
        out["aten.sum"] = slot_sum
    if mode in ("backward", "full"):
        # dgrad: tokens, dout rows, assignments, router weights per I block; W_down per tile, the down bias by block 0;
        # the saved gate_up once; writes d gate_up and the fp32 dtop_k_weights partials
        dg = table1 + nb1 * n * (4 + hidden * s + 4 + r) + real * hidden * (inter * w + b) + 2 * n * inter * s
        out["_moe_dgrad_kernel"] = (dg, 2 * n * inter * s + nb1 * n * 4)
        # dx pass (gemm2 again): d gate_up rows and assignments per H block, W_gate_up per tile; (T k, H) rows
        dx = (table2 + nb2 * n * (2 * inter * s + 4) + real * 2 * inter * hidden * w, n * hidden * s)
        dx = (dx[0] + out.get("_moe_gemm2_kernel", (0, 0))[0], dx[1] + out.get("_moe_gemm2_kernel", (0, 0))[1])
        out["_moe_gemm2_kernel"] = dx
        # weight gradients, one program per (expert, P block, Q block): expert offsets (8 B), per row tokens; DOWN
        # (P = I, Q = H) reads gate_up per Q block, dout per P block, assignments and router weights per program;
        # UP (P = H, Q = 2I) x per Q block, d gate_up per P block
        p1, q1 = _cdiv(inter, tiles.block_p), _cdiv(hidden, tiles.block_q)
        down = 8 * experts * p1 * q1 + p1 * q1 * n * (4 + 4 + r) + q1 * n * 2 * inter * s + p1 * n * hidden * s
        out["_moe_wgrad_kernel"] = (down, experts * inter * hidden * w + experts * hidden * b)
        p2, q2 = _cdiv(hidden, tiles.block_p), _cdiv(2 * inter, tiles.block_q)
        up = 8 * experts * p2 * q2 + p2 * q2 * n * 4 + q2 * n * hidden * s + p2 * n * 2 * inter * s
        out["_moe_wgrad_kernel"] = (down + up, out["_moe_wgrad_kernel"][1] + experts * 2 * inter * (hidden * w + b))
        fwd_sum = out["aten.sum"] if mode == "full" else (0, 0)
        partials = (nb1 * n * 4, n * 4)
        out["aten.sum"] = tuple(a + b_ + c for a, b_, c in zip(fwd_sum, slot_sum, partials))
        if r != 4:
            out["aten._to_copy"] = (n * 4, n * r)
    return out


def byte_model(mode, counts, tokens, k, hidden, inter, s, w, bias, router_size) -> common.ByteModel:
    """Our issued bytes (`traffic_parts`) and the op's least (module docstring), per assignment row."""
    parts = traffic_parts(mode, counts, tokens, k, hidden, inter, s, w, bias=bias, router_size=router_size)
    ours = (sum(rd for rd, _ in parts.values()), sum(wr for _, wr in parts.values()))
    n, experts = tokens * k, len(counts)
    weights = experts * (3 * hidden * inter + (2 * inter + hidden if bias else 0)) * w
    fwd = (tokens * hidden * s + weights + n * router_size, tokens * hidden * s)
    bwd = (
        2 * tokens * hidden * s + weights + 2 * n * inter * s + n * router_size,
        tokens * hidden * s + weights + n * 4,
    )
    minimum = {"forward": fwd, "backward": bwd, "full": (fwd[0] + bwd[0], fwd[1] + bwd[1])}[mode]
    return common.ByteModel.from_totals(ours, minimum, n)


def _providers() -> dict:
    def ours(*args, **kwargs):
        with kernels.backend("triton"):
            return kernels.moe_experts(*args, **kwargs)

    return {"ours": ours, "torch": moe.moe_experts_ref, "grouped_mm": moe.moe_experts_grouped_mm}


def _inputs(model: str, tokens_per_expert: int, dtype, dev):
    hidden, inter, experts, k, layout, bias = MODELS[model]
    tokens = max(1, tokens_per_expert * experts // k)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(tokens, hidden, device=dev, generator=g).to(dtype)
    logits = torch.randn(tokens, experts, device=dev, generator=g)
    top, index = torch.softmax(logits, -1).topk(k, dim=-1)
    weights = (top / top.sum(-1, keepdim=True)).to(dtype)
    w1 = (experts, hidden, 2 * inter) if layout["transposed"] else (experts, 2 * inter, hidden)
    w2 = (experts, inter, hidden) if layout["transposed"] else (experts, hidden, inter)
    params = [torch.randn(shape, device=dev, generator=g).to(dtype) * shape[-1] ** -0.5 for shape in (w1, w2)]
    if bias:
        params += [0.1 * torch.randn(experts, n, device=dev, generator=g).to(dtype) for n in (2 * inter, hidden)]
    else:
        params += [None, None]
    dout = torch.randn(tokens, hidden, device=dev, generator=g).to(dtype)
    return x, index, weights, params, dout, layout


def _case(fn, mode, x, index, weights, params, dout, layout):
    leaves = [x, weights, *(p for p in params if p is not None)]
    if mode == "forward":
        return lambda: fn(x, index, weights, *params, **layout)
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    x, weights = leaves[:2]
    params = leaves[2:] + [None] * (4 - len(leaves[2:]))

    def step():
        return fn(x, index, weights, *params, **layout)

    if mode == "backward":
        out = step()
        return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)
    return lambda: torch.autograd.grad(step(), leaves, dout)


def run(models, tokens_per_expert, dtype, modes, providers, *, cpu_reps=3, kernel_times=False):
    fns = {k: v for k, v in _providers().items() if k in providers}
    dev = common.device()
    env = common.env_info()
    rows = []
    for model in models:
        hidden, inter, experts, k, _, bias = MODELS[model]
        for tpe in tokens_per_expert:
            x, index, weights, params, dout, layout = _inputs(model, tpe, dtype, dev)
            tokens, n = x.shape[0], x.shape[0] * k
            counts = torch.bincount(index.reshape(-1), minlength=experts).tolist()
            s = x.element_size()
            for mode in modes:
                timings = {}
                for name, fn in fns.items():
                    step = _case(fn, mode, x, index, weights, params, dout, layout)
                    t = common.measure(step, cpu_reps=cpu_reps)
                    model_bytes = byte_model(mode, counts, tokens, k, hidden, inter, s, s, bias, s)
                    minimum = (model_bytes.min_read + model_bytes.min_write) * n
                    row = {
                        "op": "moe_experts",
                        "provider": name,
                        "mode": mode,
                        "model": model,
                        "tokens": tokens,
                        "hidden": hidden,
                        "inter": inter,
                        "experts": experts,
                        "k": k,
                        "tokens_per_expert": tpe,
                        "dtype": str(dtype).replace("torch.", ""),
                        **t,
                        "bytes": minimum,
                        "flops": flops(mode, n, hidden, inter),
                        **common.physics(t["ms"], bytes_moved=minimum, flops=flops(mode, n, hidden, inter)),
                        "peak_extra_bytes": common.peak_extra_memory(step) if mode == "full" else None,
                        **(common.kernel_times(step) if kernel_times else {}),
                        **env,
                    }
                    if name == "ours":
                        row.update(model_bytes.columns(n, t["ms"]))
                    timings[name] = t["ms"]
                    rows.append(row)
                common.finish_case(rows[-len(fns) :], timings, f"{model} {tpe}/expert {mode:8s}")
                for row in rows[-len(fns) :]:
                    print(f"    {row['provider']}: {row['tflop_s']:.3g} TFLOP/s")
    return rows


def main(argv=None):
    ap = common.provider_parser(__doc__, DTYPES, MODES, PROVIDERS, "activation and weight dtype")
    ap.add_argument("--model", nargs="+", choices=sorted(MODELS), help="default: both GPU models (tiny with --quick)")
    ap.add_argument("--tokens-per-expert", nargs="+", type=int, help="T k / E; default 64 256 1024 4096 on GPU")
    args = ap.parse_args(argv)
    quick = args.quick or not common.on_gpu()
    models = args.model or (["tiny"] if quick else ["qwen3-30b-a3b", "gpt-oss-20b"])
    tpe = args.tokens_per_expert or (CPU_TOKENS_PER_EXPERT if quick else GPU_TOKENS_PER_EXPERT)
    rows = run(
        models,
        tpe,
        DTYPES[args.dtype],
        args.modes,
        args.providers,
        cpu_reps=1 if args.quick else 5,
        kernel_times=args.kernel_times,
    )
    path = common.write_rows("moe", rows)
    print(f"wrote {len(rows)} rows to {path}")
    return rows


if __name__ == "__main__":
    main()
