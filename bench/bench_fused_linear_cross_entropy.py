"""Benchmark kernels.fused_linear_cross_entropy against the unfused torch ops and liger-kernel.

Providers (same run, same inputs):
  ours           kernels.fused_linear_cross_entropy (chunked matmuls + the Triton cross-entropy kernel)
  torch          F.linear + F.cross_entropy in the inputs' dtype (torch eager linear+CE)
  torch_ref      fused_linear_cross_entropy_ref: F.linear, then the fp32 cross_entropy_ref (Hugging Face's upcast)
  torch_compile  torch.compile(fused_linear_cross_entropy_ref)
  liger          liger_kernel's fused linear cross-entropy (skipped when not installed)
Modes: forward (loss with requires_grad=True: ours and liger compute every gradient here), full
(forward + backward), backward = full - forward (derived; our backward cannot re-run on a retained graph).
Ignored fraction (--ignored, default 0 and 0.5): that share of the targets, at random positions, is
ignore_index (SFT's prompt tokens). Ours gets the targets on the CPU, as a collator builds them, so it
skips those rows' matmuls: with half ignored, expect close to half the time. The others get them on the
device.

Physics: FLOPs are the matmuls' nominal work over all N tokens, the same for every provider and ignored
fraction (so TFLOP/s compares times): forward 2*N*H*V, full 6*N*H*V (logits, grad_hidden, grad_weight),
which is what ours and liger both run for any weight dtype (the kept rows only, for ours; reduction="none"
with a bf16/fp16 weight, not benchmarked, takes 8*N*H*V). Peak extra memory is measured over a full step
with hidden and weight already allocated; reported as bytes, as a ratio to the (N, V) logits' size and
to torch's peak in the same run.

GPU: hidden {2048, 4096} x vocab 128256 x tokens {4096, 8192, 16384}, bf16. CPU (`--quick`): a tiny
shape through the Triton interpreter; those rows are flagged perf_figure=False.

    python bench/bench_fused_linear_cross_entropy.py            # GPU, all shapes
    python bench/bench_fused_linear_cross_entropy.py --quick    # CPU smoke run

Byte model of our rows, per logit element (s = element size of hidden and weight, which the benchmark gives one
dtype; fh = H / V and fw = H / N: hidden's and weight's elements per logit, f = fh + fw; w = the bytes of a
grad_weight element, 4 for an fp32 weight, s for bf16/fp16; grad_weight's re-read per token chunk not counted):
    forward   ours (4s + s f) read + (2s + 4 fh + w fw) write: each chunk's logits written, read twice by the
              cross-entropy kernel, its gradient written in place and read by both gradient matmuls;
              grad_hidden in fp32, grad_weight in w                               min s f + 0
    backward  ours (4 fh + w fw) + (s fh + w fw): grad_hidden rounded, grad_weight scaled in place
                                                                                  min 0 + s f
    full      the sum                                                             min s f + s f
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
from bench.bench_cross_entropy import DTYPES, add_speedups  # noqa: E402
from kernels.fused_linear_cross_entropy import fused_linear_cross_entropy, fused_linear_cross_entropy_ref  # noqa: E402

PROVIDERS = ("ours", "torch", "torch_ref", "torch_compile", "liger")
MODES = ("forward", "backward", "full")
GPU_SHAPES = [(n, h, 128256) for h in (2048, 4096) for n in (4096, 8192, 16384)]
CPU_SHAPES = [(16, 64, 500)]
KEYS = ("mode", "tokens", "hidden", "vocab", "dtype", "ignored")
IGNORED = (0.0, 0.5)


def _liger():
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except Exception:
        return None
    return lambda h, w, t: liger_fused_linear_cross_entropy(h, w, t)


def make_loss_fn(provider: str, compile_backend: str):
    if provider == "ours":
        return lambda h, w, t: fused_linear_cross_entropy(h, w, t)
    if provider == "torch":
        return lambda h, w, t: F.cross_entropy(F.linear(h, w), t)
    if provider == "torch_ref":
        return lambda h, w, t: fused_linear_cross_entropy_ref(h, w, t)
    if provider == "torch_compile":
        return torch.compile(fused_linear_cross_entropy_ref, backend=compile_backend)
    if provider == "liger":
        return _liger()
    raise ValueError(f"unknown provider {provider!r}; choose from {', '.join(PROVIDERS)}")


def bench_one(provider, n_tokens, hdim, vocab, dtype, ignored, compile_backend, dev, reps=3):
    fn = make_loss_fn(provider, compile_backend)
    if fn is None:
        return None
    gen = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(n_tokens, hdim, device=dev, dtype=dtype, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, hdim, device=dev, dtype=dtype, generator=gen) / hdim**0.5).requires_grad_()
    target = torch.randint(0, vocab, (n_tokens,), device=dev, generator=gen)
    target[torch.randperm(n_tokens, device=dev, generator=gen)[: int(ignored * n_tokens)]] = -100
    if provider == "ours":
        target = target.cpu()  # host labels: the kept rows are known without a device sync

    def forward():
        return fn(hidden, weight, target)

    def full():
        hidden.grad = weight.grad = None
        fn(hidden, weight, target).backward()

    with kernels.backend("triton" if provider == "ours" else "auto"):
        t_fwd = common.measure(forward, cpu_reps=reps)
        t_full = common.measure(full, cpu_reps=reps)
        hidden.grad = weight.grad = None
        peak = common.peak_extra_memory(full)
    hidden.grad = weight.grad = None
    logits_bytes = n_tokens * vocab * hidden.element_size()
    matmul = 2 * n_tokens * hdim * vocab
    out = {}
    for mode in MODES:
        if mode == "forward":
            t, flops = t_fwd, matmul
        elif mode == "full":
            t, flops = t_full, 3 * matmul
        else:
            t = {k: t_full[k] - t_fwd[k] for k in ("ms", "ms_p20", "ms_p80")}
            flops = 2 * matmul
        row = {
            "op": "fused_linear_cross_entropy", "provider": provider, "mode": mode, "tokens": n_tokens,
            "hidden": hdim, "vocab": vocab, "dtype": str(dtype).replace("torch.", ""), "ignored": ignored, "derived": mode == "backward",
        }
        row.update(t)
        if t["ms"] > 0:  # a derived backward can come out <= 0 within timing noise on a CPU
            row.update(common.physics(t["ms"], flops=flops))
            if provider == "ours":
                model = byte_model(mode, hidden.element_size(), n_tokens, hdim, vocab)
                row.update(model.columns(n_tokens * vocab, t["ms"]))
        row["peak_extra_bytes"] = peak
        row["peak_extra_over_logits"] = None if peak is None else peak / logits_bytes
        out[mode] = row
    return out


def byte_model(mode: str, s: int, n_tokens: int, hdim: int, vocab: int) -> common.ByteModel:
    """Our bytes read/written per logit element and the minimum (module docstring)."""
    fh, fw = hdim / vocab, hdim / n_tokens
    f, w = fh + fw, 4 if s == 4 else s
    fwd_read, fwd_write = 4 * s + s * f, 2 * s + 4 * fh + w * fw
    bwd_read, bwd_write = 4 * fh + w * fw, s * fh + w * fw
    return {
        "forward": common.ByteModel(fwd_read, fwd_write, s * f, 0),
        "full": common.ByteModel(fwd_read + bwd_read, fwd_write + bwd_write, s * f, s * f),
        "backward": common.ByteModel(bwd_read, bwd_write, 0, s * f),
    }[mode]


def add_memory_ratio(rows):
    """peak_vs_torch on every row: its peak extra memory over torch eager's, same shape."""
    torch_peaks = {tuple(r[k] for k in KEYS): r["peak_extra_bytes"] for r in rows if r["provider"] == "torch"}
    for row in rows:
        base = torch_peaks.get(tuple(row[k] for k in KEYS))
        row["peak_vs_torch"] = row["peak_extra_bytes"] / base if base and row["peak_extra_bytes"] is not None else None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--quick", action="store_true", help="one tiny shape (CPU smoke run)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--tokens", type=int, nargs="*", help="override the token counts")
    parser.add_argument("--hidden", type=int, nargs="*", help="override the hidden sizes")
    parser.add_argument("--vocab", type=int, nargs="*", help="override the vocabulary sizes")
    parser.add_argument("--providers", nargs="*", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--ignored", type=float, nargs="*", default=list(IGNORED), help="fractions of ignored targets (default 0 0.5)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend for torch_compile (default inductor)")
    args = parser.parse_args(argv)
    bad = [f for f in args.ignored if not 0.0 <= f < 1.0]
    if bad:
        parser.error(f"--ignored {bad[0]} must be a fraction in [0, 1)")

    dev = common.device()
    shapes = CPU_SHAPES if (args.quick or not common.on_gpu()) else GPU_SHAPES
    if args.tokens or args.hidden or args.vocab:
        tokens = args.tokens or sorted({s[0] for s in shapes})
        hiddens = args.hidden or sorted({s[1] for s in shapes})
        vocabs = args.vocab or sorted({s[2] for s in shapes})
        shapes = [(n, h, v) for h in hiddens for n in tokens for v in vocabs]
    env = common.env_info()
    rows = []
    for (n_tokens, hdim, vocab), ignored in ((shape, f) for shape in shapes for f in args.ignored):
        shape_rows = []
        for provider in args.providers:
            result = bench_one(provider, n_tokens, hdim, vocab, DTYPES[args.dtype], ignored, args.compile_backend, dev, reps=1 if args.quick else 3)
            if result is None:
                print(f"skip {provider}: not installed")
                continue
            shape_rows.extend(result.values())
        add_speedups(shape_rows, KEYS)
        add_memory_ratio(shape_rows)
        rows.extend(shape_rows)
    for row in rows:
        row.update(env)
        print(
            f"{row['provider']:>13} {row['mode']:>8} N={row['tokens']} H={row['hidden']} V={row['vocab']} "
            f"ignored={row['ignored']:g} {row['ms']:.3f} ms"
            + (f" {row['tflop_s']:.3g} TFLOP/s" if row.get("tflop_s") else "") + common.byte_model_text(row)
        )
    path = common.write_rows("fused_linear_cross_entropy", rows)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
