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
    python bench/bench_moe.py --lora-rank 16          # LoRA on the experts: ours vs loop vs peft's delta + grouped_mm
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


def flops(mode: str, n: int, hidden: int, inter: int, rank: int = 0) -> int:
    """The GEMMs' FLOPs; with LoRA rank r on both tensors (the experts' weights frozen: no dW of their own) the rank
    GEMMs too: forward 2 N r (2H + 3I), backward dh and dx (6 N H I) and 2 N r (4H + 6I) (the input gradients' and
    the four factors' rank GEMMs); peft's whole delta (3 E r H I each way) is not counted for anyone."""
    if not rank:
        return {"forward": 6, "backward": 12, "full": 18}[mode] * n * hidden * inter
    fwd = 6 * n * hidden * inter + 2 * n * rank * (2 * hidden + 3 * inter)
    bwd = 6 * n * hidden * inter + 2 * n * rank * (4 * hidden + 6 * inter)
    return {"forward": fwd, "backward": bwd, "full": fwd + bwd}[mode]


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
    lora_rank: int | tuple[int, int] = 0,
    lora_size: int | None = None,
) -> dict[str, tuple[int, int]]:
    """Exact issued (read, write) bytes per kernel for expert row counts `counts` (sum T k), activations of element
    size s, weights and biases of w, router weights of `router_size` (default s): the Triton kernels' names and the
    torch ops between them as bench/traffic.py's `torch_ops` names them (the k slots' sums, the dtop_k_weights
    partials' sum and cast). The routing sort's torch ops are not modelled (O(T k) integers).
    Every program reads two int32 of the tile table (row start, end), a real tile's a third (its expert).
    `lora_rank` r > 0: LoRA on both expert tensors, or (r gate_up, r down) with 0 for a tensor not adapted (factors of
    element size `lora_size`, default w), the experts' weights frozen (no weight-gradient passes of their own): each
    row kernel of an adapted tensor reads its (K, r) factor over its K loop and its (r, columns) factor in the
    epilogue, and saves an (N, r) intermediate; two rank-r weight passes per adapted tensor follow."""
    tiles = tiles or (moe.GPU_TILES if common.on_gpu() else moe.CPU_TILES)
    r = router_size or s
    n, experts, bm = tokens * k, len(counts), tiles.block_m
    real = sum(_cdiv(c, bm) for c in counts)  # tiles with rows
    grid = moe.max_tiles(n, experts, bm)
    nb1, nb2 = _cdiv(inter, tiles.block_n1), _cdiv(hidden, tiles.block_n2)
    table1, table2 = 8 * grid * nb1 + 4 * real * nb1, 8 * grid * nb2 + 4 * real * nb2
    b = w if bias else 0
    r1, r2 = lora_rank if isinstance(lora_rank, tuple) else (lora_rank, lora_rank)  # gate_up's, down's
    lw = lora_size or w
    out: dict[str, tuple[int, int]] = {}
    slot_sum = (n * hidden * s, tokens * hidden * s) if k > 1 else (0, 0)
    if mode in ("forward", "full"):
        # gemm1: tokens and x rows per I block, W_gate_up (2I columns over H) and the bias per tile; h and gate_up
        g1 = (table1 + nb1 * n * (4 + hidden * s) + real * 2 * inter * (hidden * w + b), 3 * n * inter * s)
        # gemm2: h rows, assignments and router weights per H block, W_down and the bias per tile; (T k, H) rows
        g2 = (table2 + nb2 * n * (inter * s + 4 + r) + real * hidden * (inter * w + b), n * hidden * s)
        # LoRA: A1 (H x r) per program, B1 (r x 2I) per tile; A2 (I x r) per program, B2 (r x H) per tile
        g1 = _plus(g1, (real * r1 * lw * (nb1 * hidden + 2 * inter), n * r1 * s))
        g2 = _plus(g2, (real * r2 * lw * (nb2 * inter + hidden), n * r2 * s))
        out["_moe_gemm1_kernel"], out["_moe_gemm2_kernel"] = g1, g2
        out["aten.sum"] = slot_sum
    if mode in ("backward", "full"):
        # dgrad: tokens, dout rows, assignments, router weights per I block; W_down per tile, the down bias by block 0;
        # the saved gate_up once; writes d gate_up and the fp32 dtop_k_weights partials
        dg = table1 + nb1 * n * (4 + hidden * s + 4 + r) + real * hidden * (inter * w + b) + 2 * n * inter * s
        # LoRA: B2 (H x r) per program, A2 (r x I) per tile, dy B2 saved
        dg += real * r2 * lw * (nb1 * hidden + inter)
        out["_moe_dgrad_kernel"] = (dg, 2 * n * inter * s + nb1 * n * 4 + n * r2 * s)
        # dx pass (gemm2 again): d gate_up rows and assignments per H block, W_gate_up per tile; (T k, H) rows; LoRA:
        # B1 (2I x r) per program, A1 (r x H) per tile, d gate_up B1 saved
        dx = (table2 + nb2 * n * (2 * inter * s + 4) + real * 2 * inter * hidden * w, n * hidden * s)
        dx = _plus(dx, (real * r1 * lw * (nb2 * 2 * inter + hidden), n * r1 * s))
        dx = (dx[0] + out.get("_moe_gemm2_kernel", (0, 0))[0], dx[1] + out.get("_moe_gemm2_kernel", (0, 0))[1])
        out["_moe_gemm2_kernel"] = dx

        # weight gradients, one program per (expert, P block, Q block): expert offsets (8 B), per row tokens; DOWN
        # (P = I, Q = H) reads gate_up per Q block, dout per P block, assignments and router weights per program;
        # UP (P = H, Q = 2I) x per Q block, d gate_up per P block
        def wgrad(p, q, a_bytes, b_bytes, scaled, bp, bq, out_size):
            # (expert, P block, Q block) programs: expert offsets (8 B); per row and program its token, with the
            # router weight its assignment and weight; A's row (a_bytes) per Q block, B's (b_bytes) per P block
            pb, qb = _cdiv(p, bp), _cdiv(q, bq)
            per_row = 4 + (4 + r if scaled else 0)
            return (
                8 * experts * pb * qb + pb * qb * n * per_row + qb * n * a_bytes + pb * n * b_bytes,
                experts * p * q * out_size,
            )

        bp, bq = tiles.block_p, tiles.block_q
        passes = []
        if not (r1 or r2):  # DOWN: A = act(gate_up) (2I per row), B = w dout[token]; UP: A = x[token], B = d gate_up
            passes += [wgrad(inter, hidden, 2 * inter * s, hidden * s, True, bp, bq, w), (0, experts * hidden * b)]
            passes += [wgrad(hidden, 2 * inter, hidden * s, 2 * inter * s, False, bp, bq, w)]
            passes += [(0, experts * 2 * inter * b)]
        if r1:  # the factors' passes: dA1 (r, H), dB1 (2I, r)
            br = max(16, 1 << (r1 - 1).bit_length())
            passes += [wgrad(r1, hidden, r1 * s, hidden * s, False, br, bq, lw)]
            passes += [wgrad(2 * inter, r1, 2 * inter * s, r1 * s, False, bp, br, lw)]
        if r2:  # dA2 (I, r), dB2 (r, H)
            br = max(16, 1 << (r2 - 1).bit_length())
            passes += [wgrad(inter, r2, 2 * inter * s, r2 * s, True, bp, br, lw)]
            passes += [wgrad(r2, hidden, r2 * s, hidden * s, True, br, bq, lw)]
        out["_moe_wgrad_kernel"] = tuple(sum(part[i] for part in passes) for i in (0, 1))
        fwd_sum = out["aten.sum"] if mode == "full" else (0, 0)
        partials = (nb1 * n * 4, n * 4)
        out["aten.sum"] = tuple(a + b_ + c for a, b_, c in zip(fwd_sum, slot_sum, partials))
        if r != 4:
            out["aten._to_copy"] = (n * 4, n * r)
    return out


def _plus(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return a[0] + b[0], a[1] + b[1]


def byte_model(mode, counts, tokens, k, hidden, inter, s, w, bias, router_size, rank=0) -> common.ByteModel:
    """Our issued bytes (`traffic_parts`) and the op's least (module docstring), per assignment row. With LoRA rank
    r: the factors are read each way and their gradients written instead of the weights' (frozen), and the backward
    reads the two saved (N, r) intermediates."""
    parts = traffic_parts(
        mode, counts, tokens, k, hidden, inter, s, w, bias=bias, router_size=router_size, lora_rank=rank
    )
    ours = (sum(rd for rd, _ in parts.values()), sum(wr for _, wr in parts.values()))
    n, experts = tokens * k, len(counts)
    weights = experts * (3 * hidden * inter + (2 * inter + hidden if bias else 0)) * w
    factors = experts * rank * (2 * hidden + 3 * inter) * w
    fwd = (tokens * hidden * s + weights + factors + n * router_size, tokens * hidden * s + 2 * n * rank * s)
    bwd = (
        2 * tokens * hidden * s + weights + factors + 2 * n * inter * s + 2 * n * rank * s + n * router_size,
        tokens * hidden * s + (factors if rank else weights) + n * 4,
    )
    minimum = {"forward": fwd, "backward": bwd, "full": (fwd[0] + bwd[0], fwd[1] + bwd[1])}[mode]
    return common.ByteModel.from_totals(ours, minimum, n)


def _peft_grouped_mm(x, index, weights, w1, w2, b1, b2, *, gate_up_lora=None, down_lora=None, **layout):
    """What transformers 5 + peft's target_parameters run: each adapted weight plus its whole (E, out, in) delta
    (peft's ParamWrapper, a baddbmm of the expert-stacked factors), then transformers' grouped_mm experts."""
    adapted = []
    for weight, lora in ((w1, gate_up_lora), (w2, down_lora)):
        if lora is not None:
            experts = weight.shape[0]
            a = lora.lora_A.view(experts, -1, lora.lora_A.shape[1])  # (E, r, in)
            b = lora.lora_B.view(lora.lora_B.shape[0], -1, experts).permute(2, 0, 1)  # (E, out, r)
            lhs, rhs = (a.transpose(1, 2), b.transpose(1, 2)) if layout["transposed"] else (b, a)
            weight = torch.baddbmm(weight, lhs, rhs, alpha=lora.scaling)
        adapted.append(weight)
    return moe.moe_experts_grouped_mm(x, index, weights, *adapted, b1, b2, **layout)


def _providers(lora: bool) -> dict:
    def ours(*args, **kwargs):
        with kernels.backend("triton"):
            return kernels.moe_experts(*args, **kwargs)

    grouped_mm = _peft_grouped_mm if lora else moe.moe_experts_grouped_mm
    return {"ours": ours, "torch": moe.moe_experts_ref, "grouped_mm": grouped_mm}


def _inputs(model: str, tokens_per_expert: int, dtype, dev, rank: int = 0):
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
    factors = []  # peft's (lora_A (r E, in), lora_B (out, r E)) of gate_up and of down, B not zero
    for fan_in, fan_out in ((hidden, 2 * inter), (inter, hidden)) if rank else ():
        factors += [torch.randn(rank * experts, fan_in, device=dev, generator=g).to(dtype) * fan_in**-0.5]
        factors += [torch.randn(fan_out, rank * experts, device=dev, generator=g).to(dtype) * 0.01]
    return x, index, weights, params, dout, layout, factors


def _case(fn, mode, x, index, weights, params, dout, layout, factors=()):
    """The step of `mode`: with LoRA `factors` the experts' weights are frozen and the factors trained."""
    leaves = [x, weights, *(factors or [p for p in params if p is not None])]
    if mode != "forward":
        leaves = [t.detach().clone().requires_grad_() for t in leaves]
    x, weights = leaves[:2]
    if factors:
        a1, b1, a2, b2 = leaves[2:]
        loras = dict(gate_up_lora=moe.ExpertLoRA(a1, b1, 2.0), down_lora=moe.ExpertLoRA(a2, b2, 2.0))
    else:
        params = leaves[2:] + [None] * (4 - len(leaves[2:]))
        loras = {}

    def step():
        return fn(x, index, weights, *params, **layout, **loras)

    if mode == "forward":
        return step

    if mode == "backward":
        out = step()
        return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)
    return lambda: torch.autograd.grad(step(), leaves, dout)


def run(models, tokens_per_expert, dtype, modes, providers, *, cpu_reps=3, kernel_times=False, lora_rank=0):
    fns = {k: v for k, v in _providers(bool(lora_rank)).items() if k in providers}
    dev = common.device()
    env = common.env_info()
    rows = []
    for model in models:
        hidden, inter, experts, k, _, bias = MODELS[model]
        for tpe in tokens_per_expert:
            x, index, weights, params, dout, layout, factors = _inputs(model, tpe, dtype, dev, lora_rank)
            tokens, n = x.shape[0], x.shape[0] * k
            counts = torch.bincount(index.reshape(-1), minlength=experts).tolist()
            s = x.element_size()
            for mode in modes:
                timings = {}
                for name, fn in fns.items():
                    step = _case(fn, mode, x, index, weights, params, dout, layout, factors)
                    t = common.measure(step, cpu_reps=cpu_reps)
                    model_bytes = byte_model(mode, counts, tokens, k, hidden, inter, s, s, bias, s, lora_rank)
                    n_flops = flops(mode, n, hidden, inter, lora_rank)
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
                        "lora_rank": lora_rank,
                        "dtype": str(dtype).replace("torch.", ""),
                        **t,
                        "bytes": minimum,
                        "flops": n_flops,
                        **common.physics(t["ms"], bytes_moved=minimum, flops=n_flops),
                        "peak_extra_bytes": common.peak_extra_memory(step) if mode == "full" else None,
                        **(common.kernel_times(step) if kernel_times else {}),
                        **env,
                    }
                    if name == "ours":
                        row.update(model_bytes.columns(n, t["ms"]))
                    timings[name] = t["ms"]
                    rows.append(row)
                lora = f" LoRA r {lora_rank}" if lora_rank else ""
                common.finish_case(rows[-len(fns) :], timings, f"{model} {tpe}/expert{lora} {mode:8s}")
                for row in rows[-len(fns) :]:
                    print(f"    {row['provider']}: {row['tflop_s']:.3g} TFLOP/s")
    return rows


def main(argv=None):
    ap = common.provider_parser(__doc__, DTYPES, MODES, PROVIDERS, "activation and weight dtype")
    ap.add_argument("--model", nargs="+", choices=sorted(MODELS), help="default: both GPU models (tiny with --quick)")
    ap.add_argument("--tokens-per-expert", nargs="+", type=int, help="T k / E; default 64 256 1024 4096 on GPU")
    ap.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="LoRA of this rank on both expert tensors, the weights frozen: ours (rank GEMMs in the kernels) vs the "
        "eager loop vs peft's whole delta + grouped_mm (transformers 5 + peft's target_parameters)",
    )
    args = ap.parse_args(argv)
    if args.lora_rank < 0:
        ap.error(f"--lora-rank {args.lora_rank}: must be 0 (no LoRA) or a positive rank")
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
        lora_rank=args.lora_rank,
    )
    path = common.write_rows("moe", rows)
    print(f"wrote {len(rows)} rows to {path}")
    return rows


if __name__ == "__main__":
    main()
