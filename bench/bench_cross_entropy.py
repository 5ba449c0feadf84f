"""Benchmark kernels.cross_entropy against torch eager, torch.compile and liger-kernel.

Providers (same run, same inputs):
  ours           kernels.cross_entropy (Triton)
  torch          cross_entropy_ref, the fp32 reference (what Hugging Face does: upcast, then F.cross_entropy)
  torch_native   F.cross_entropy directly in the logits' dtype
  torch_compile  torch.compile(cross_entropy_ref)
  liger          liger_kernel's cross-entropy (skipped when not installed; it overwrites its input with the gradient)
Modes: forward (loss with requires_grad=True: ours and liger compute the gradient here), full (forward +
backward), backward = full - forward (derived: our backward cannot be re-run on a retained graph, by design).

Physics: `gb_s` is at the algorithmic minimum, the same for every provider: forward reads the logits
(N*V*elt), full also writes the gradient (2*N*V*elt). Peak extra memory is measured over a full step with the
logits already allocated, and given as a ratio to the logits' size.
Byte model: `traffic_model(mode, n_tokens, vocab, elt, n_ignored)` -> (read, write) bytes of our kernels (per
kernel: `traffic_parts`), exact
(O(N) targets, losses, lse and the gradient scale included; tests/bench/test_byte_models.py checks it against
bench/traffic.py's count under the interpreter); `min_traffic(...)` the least the op must move; `byte_model`
divides both by N*V for the printed columns. Per logit element, K = N - I kept rows (s = element size):
    forward   ours reads each kept row twice (pass 1, pass 2) and writes every row's gradient: 2s K/N + 1s
              (an ignored row costs 1s, its gradient zeros, not 3s)                       min 1s K/N + 0
    full      the same: backward skips its pass when grad_output == 1, as here          min 1s K/N + 1s
    backward  ours 0 + 0 (one grad_output read per program)                             min 0 + 1s
(backward = full - forward, for the minimum too). The model printed before this meter charged 3s to every
row: at the bench's 10% ignored rows it overstated our bytes, so GB/s, by 1/(1 - 0.1*2/3) = 7.1% (measured
with the meter: 2.8s per element, not 3s).

Forward-kernel variants (kernels/cross_entropy.py, FWD_VARIANTS): `--variant all` times every one as its
own "ours" row (column `variant`) beside the library's launch, "default" (the default here too); the first H200
run's rows chose that launch (BLOCK 8192, 16 warps, 64 registers; bench/results/h200/kernels.md).

GPU: tokens 8192 x vocab {32000, 128256, 151936}, bf16. CPU (`--quick`): a tiny shape through the Triton
interpreter; those rows are flagged perf_figure=False.

    python bench/bench_cross_entropy.py            # GPU, all shapes
    python bench/bench_cross_entropy.py --quick    # CPU smoke run
    python bench/bench_cross_entropy.py --providers ours --variant all   # the forward variants side by side
    python bench/bench_cross_entropy.py --tokens 8192 --vocab 128256 --label-smoothing 0.1   # the issue-16 anchor
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the interpreter flag must precede every @triton.jit decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch.nn.functional as F  # noqa: E402

import kernels  # noqa: E402
from bench import common  # noqa: E402
from kernels.cross_entropy import FWD_VARIANTS, cross_entropy, cross_entropy_ref, fwd_variant  # noqa: E402

PROVIDERS = ("ours", "torch", "torch_native", "torch_compile", "liger")
MODES = ("forward", "backward", "full")
GPU_SHAPES = [(8192, 32000), (8192, 128256), (8192, 151936)]
CPU_SHAPES = [(8, 1000)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _bwd_programs(n_elements: int, cuda: bool) -> int:
    """Programs of cross_entropy_bwd's flat launch (kernels/cross_entropy.py): each reads grad_output once."""
    block = 4096 if cuda else 1 << 18
    return max(1, min(-(-n_elements // block), 1024 if cuda else 4))


def traffic_parts(
    mode: str,
    n_tokens: int,
    vocab: int,
    elt: int,
    n_ignored: int = 0,
    *,
    target_elt: int = 8,
    mean: bool = True,
    grad_output_one: bool = True,
    cuda: bool = True,
) -> dict[str, tuple[int, int]]:
    """Exact (read, write) bytes per Triton kernel of our cross-entropy for `mode` ("forward" with a gradient, as
    the bench runs it; "forward_nograd"; "backward"; "full"), N = n_tokens rows of `vocab` logits of `elt` bytes,
    n_ignored of them ignore_index. mean: reduction "mean" (the forward reads the fp32 1/denominator once per
    kept row); grad_output_one: backward's grad_output is 1 (0-d, in the logits' dtype), so backward only reads
    that value, once per program. cuda: the backward's grid. The torch ops around (the loss sum, the
    denominator) are O(N) and not counted."""
    n, v, k = n_tokens, vocab, n_tokens - n_ignored
    out = {}
    if mode == "forward_nograd":
        out["_cross_entropy_fwd_kernel"] = (
            n * target_elt + k * (v + 1) * elt,
            8 * n,
        )  # targets, x_y + 1 pass; loss, lse
    if mode in ("forward", "full"):
        read = n * target_elt + k * (2 * v + 1) * elt + (4 * k if mean else 0)  # targets; x_y + two passes; scale
        out["_cross_entropy_fwd_kernel"] = (read, 4 * n + 4 * n + n * v * elt)  # loss, lse, the gradient
    if mode in ("backward", "full"):
        g_reads = _bwd_programs(n * v, cuda) * elt
        grad = 0 if grad_output_one else n * v * elt
        out["_cross_entropy_bwd_kernel"] = (g_reads + grad, grad)
    return out


def traffic_model(mode: str, n_tokens: int, vocab: int, elt: int, n_ignored: int = 0, **kwargs) -> tuple[int, int]:
    """(read, write) bytes of our launches (`traffic_parts` summed)."""
    parts = traffic_parts(mode, n_tokens, vocab, elt, n_ignored, **kwargs).values()
    return sum(r for r, _ in parts), sum(w for _, w in parts)


def min_traffic(mode: str, n_tokens: int, vocab: int, elt: int, n_ignored: int = 0) -> tuple[int, int]:
    """The least the op must move: the kept rows' logits once (the loss), and the whole gradient once (full)."""
    logits_read = (n_tokens - n_ignored) * vocab * elt
    grad_write = n_tokens * vocab * elt
    return {"forward": (logits_read, 0), "backward": (0, grad_write), "full": (logits_read, grad_write)}[mode]


def byte_model(mode: str, n_tokens: int, vocab: int, elt: int, n_ignored: int = 0) -> common.ByteModel:
    """Our bytes read/written per logit element and the minimum (module docstring; exact totals / (N * V))."""
    return common.ByteModel.from_totals(
        traffic_model(mode, n_tokens, vocab, elt, n_ignored, cuda=common.on_gpu()),
        min_traffic(mode, n_tokens, vocab, elt, n_ignored),
        n_tokens * vocab,
    )


def _liger():
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy
    except Exception:
        return None
    return liger_cross_entropy


def make_loss_fn(provider: str, compile_backend: str, label_smoothing: float = 0.0):
    ls = label_smoothing
    if provider == "ours":
        return lambda x, t: cross_entropy(x, t, label_smoothing=ls)
    if provider == "torch":
        return lambda x, t: cross_entropy_ref(x, t, label_smoothing=ls)
    if provider == "torch_native":
        return lambda x, t: F.cross_entropy(x, t, label_smoothing=ls)
    if provider == "torch_compile":
        compiled = torch.compile(cross_entropy_ref, backend=compile_backend)
        return lambda x, t: compiled(x, t, label_smoothing=ls)
    if provider == "liger":
        liger = _liger()
        return None if liger is None else (lambda x, t: liger(x, t, label_smoothing=ls))
    raise ValueError(f"unknown provider {provider!r}; choose from {', '.join(PROVIDERS)}")


def bench_one(provider, n_tokens, vocab, dtype, compile_backend, dev, reps=3, variant="default", label_smoothing=0.0):
    fn = make_loss_fn(provider, compile_backend, label_smoothing)
    if fn is None:
        return None
    gen = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(n_tokens, vocab, device=dev, dtype=dtype, generator=gen).requires_grad_()
    target = torch.randint(0, vocab, (n_tokens,), device=dev, generator=gen)
    target[::10] = -100

    def forward():
        return fn(logits, target)

    def full():
        logits.grad = None
        fn(logits, target).backward()

    with kernels.backend("triton" if provider == "ours" else "auto"), fwd_variant(variant):
        t_fwd = common.measure(forward, cpu_reps=reps)
        t_full = common.measure(full, cpu_reps=reps)
        logits.grad = None
        peak = common.peak_extra_memory(full)
    logits.grad = None
    elt = logits.element_size()
    logits_bytes = n_tokens * vocab * elt
    out = {}
    for mode in MODES:
        if mode == "forward":
            t, nbytes = t_fwd, logits_bytes
        elif mode == "full":
            t, nbytes = t_full, 2 * logits_bytes
        else:
            t = {k: t_full[k] - t_fwd[k] for k in ("ms", "ms_p20", "ms_p80")}
            nbytes = logits_bytes
        row = {
            "op": "cross_entropy",
            "provider": provider,
            "mode": mode,
            "tokens": n_tokens,
            "vocab": vocab,
            "dtype": str(dtype).replace("torch.", ""),
            "label_smoothing": label_smoothing,
        }
        if provider == "ours":
            row["variant"] = variant
        row.update(t)
        row["derived"] = mode == "backward"
        if t["ms"] > 0:  # a derived backward can come out <= 0 within timing noise on a CPU
            row.update(common.physics(t["ms"], bytes_moved=nbytes))
            if provider == "ours":
                n_ignored = int((target == -100).sum())
                row.update(byte_model(mode, n_tokens, vocab, elt, n_ignored).columns(n_tokens * vocab, t["ms"]))
        row["peak_extra_bytes"] = peak
        row["peak_extra_over_logits"] = None if peak is None else peak / logits_bytes
        out[mode] = row
    return out


def add_speedups(rows, keys=("mode", "tokens", "vocab", "dtype")):
    """speedup_vs_<provider> on our rows: their median time over ours, same shape (keys) and mode."""
    for row in rows:
        if row["provider"] != "ours":
            continue
        for other in rows:
            same = all(other[k] == row[k] for k in keys)
            if same and other["provider"] != "ours" and row["ms"] > 0:
                row[f"speedup_vs_{other['provider']}"] = other["ms"] / row["ms"]


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--quick", action="store_true", help="one tiny shape (CPU smoke run)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--tokens", type=int, nargs="*", help="override the token counts")
    parser.add_argument("--vocab", type=int, nargs="*", help="override the vocabulary sizes")
    parser.add_argument("--providers", nargs="*", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument(
        "--variant",
        choices=(*FWD_VARIANTS, "all"),
        default="default",
        help="our forward kernel's variant (kernels/cross_entropy.py FWD_VARIANTS); all: each as its own row",
    )
    parser.add_argument(
        "--label-smoothing",
        type=float,
        default=0.0,
        help="for every provider (default 0; the GPU target is stated at 0.1)",
    )
    parser.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend for torch_compile (default inductor)"
    )
    args = parser.parse_args(argv)
    if not 0.0 <= args.label_smoothing <= 1.0:
        parser.error(f"--label-smoothing {args.label_smoothing} must be in [0, 1]")

    dev = common.device()
    shapes = CPU_SHAPES if (args.quick or not common.on_gpu()) else GPU_SHAPES
    if args.tokens or args.vocab:
        tokens = args.tokens or sorted({s[0] for s in shapes})
        vocabs = args.vocab or sorted({s[1] for s in shapes})
        shapes = [(n, v) for n in tokens for v in vocabs]
    env = common.env_info()
    rows = []
    for n_tokens, vocab in shapes:
        shape_rows = []
        variants = FWD_VARIANTS if args.variant == "all" else (args.variant,)
        runs = [(p, v) for p in args.providers for v in (variants if p == "ours" else ("default",))]
        for provider, variant in runs:
            result = bench_one(
                provider,
                n_tokens,
                vocab,
                DTYPES[args.dtype],
                args.compile_backend,
                dev,
                reps=1 if args.quick else 3,
                variant=variant,
                label_smoothing=args.label_smoothing,
            )
            if result is None:
                print(f"skip {provider}: not installed")
                continue
            shape_rows.extend(result.values())
        add_speedups(shape_rows)
        rows.extend(shape_rows)
    for row in rows:
        row.update(env)
        name = row["provider"] + (f"[{row['variant']}]" if "variant" in row else "")
        print(
            f"{name:>20} {row['mode']:>8} N={row['tokens']} V={row['vocab']} {row['ms']:.3f} ms"
            + (f" {row['gb_s']:.3g} GB/s" if row.get("gb_s") else "")
            + common.byte_model_text(row)
        )
    path = common.write_rows("cross_entropy", rows)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
