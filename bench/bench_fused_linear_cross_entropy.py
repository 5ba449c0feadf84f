"""Benchmark kernels.fused_linear_cross_entropy against the unfused torch ops and liger-kernel.

Providers (same run, same inputs):
  ours           kernels.fused_linear_cross_entropy (chunked matmuls + the Triton cross-entropy kernel)
  torch          F.linear + F.cross_entropy in the inputs' dtype (torch eager linear+CE)
  torch_ref      fused_linear_cross_entropy_ref: F.linear, then the fp32 cross_entropy_ref (Hugging Face's upcast)
  torch_compile  torch.compile(fused_linear_cross_entropy_ref)
  liger          liger_kernel's fused linear cross-entropy (skipped when not installed)
Modes: forward (loss with requires_grad=True: ours and liger compute every gradient here), full
(forward + backward), backward = full - forward (derived; our backward cannot re-run on a retained graph).
Softcap (--softcap C, default none): every provider's loss over C tanh(logits / C) (Gemma 2's final logit
softcapping, 30): ours inside the cross-entropy kernel, liger's its own softcap argument, torch's as transformers
applies it to the logits.
Ignored fraction (--ignored, default 0 and 0.5): that share of the targets, at random positions, is
ignore_index (SFT's prompt tokens). Ours gets the targets on the CPU, as a collator builds them, so it
skips those rows' matmuls: with half ignored, expect close to half the time. The others get them on the
device.

Physics: FLOPs are the matmuls' nominal work over all N tokens, the same for every provider and ignored
fraction (so TFLOP/s compares times): forward 2*N*H*V, full 6*N*H*V (logits, grad_hidden, grad_weight), which
is what ours (on the kept rows only) and liger run for any weight dtype (reduction="none" with a bf16/fp16
weight, not benchmarked, takes 8*N*H*V). Peak extra memory is measured over a full step
with hidden and weight already allocated; reported as bytes, as a ratio to the (N, V) logits' size and
to torch's peak in the same run.

GPU: hidden {2048, 4096} x vocab 128256 x tokens {4096, 8192, 16384}, bf16. CPU (`--quick`): a tiny
shape through the Triton interpreter; those rows are flagged perf_figure=False.

    python bench/bench_fused_linear_cross_entropy.py            # GPU, all shapes
    python bench/bench_fused_linear_cross_entropy.py --quick    # CPU smoke run

Byte model: `traffic_parts(mode, n_tokens, hdim, vocab, s, n_ignored, w=s)` -> {launch: (read, write)} bytes of
everything our op runs (the Triton kernels exactly; each torch op as one pass over its operands, as
bench/traffic.py's `torch_ops` counts them: a matmul reads both operands once and writes its output), tested
equal to the meter by tests/bench/test_byte_models.py; `traffic_model` sums it; `min_traffic` is the least:
hidden and weight read once, grad_hidden and grad_weight written once. `byte_model` divides both by N*V (per
logit element, the printed columns). K = N - I kept rows (the ignored ones are skipped on the host), C rows per
chunk, s the activations' element size. Forward, per chunk: the logits matmul (reads C H s + V H s, writes
C V s), the cross-entropy kernel (reads the chunk's logits twice, writes the gradient in place), then the
grad_hidden matmul (an fp32 output; its operands read in their dtype on CUDA, out_dtype=float32, and upcast
first elsewhere, `cuda=False`: two more copies) and the grad_weight matmul: with an fp32 weight into the fp32
gradient (reads C V 4 + C H 4, + V H 4 when accumulating; writes V H 4), with a bf16/fp16 weight into the
gradient in its dtype (reads C V s + C H s, + V H s when accumulating; writes V H s; elsewhere via fp32 copies
and one rounding copy). Backward (mean, grad_output 1): grad_output reads (grad_weight's in-place scale skipped),
grad_hidden's rounding (reads K H 4, writes K H s; none in fp32) and its scatter into the ignored rows' zeros.
Until issue 20 item 4 a bf16/fp16 weight's gradient came from a backward vocabulary pass (the logits matmul
again, a slice-gradient kernel, an fp32 slice buffer): at N = 8192, H = 4096, V = 128256 bf16 that backward
moved 16.2 bytes per logit element.
The per-element model printed before this meter (forward 4s + s f read, 2s + 4f write; f = (N + V) H / (N V))
counted the weight once, but every token chunk's matmuls re-read it (C = 2048 rows: 4 chunks at N = 8192, two
weight reads each in bf16, three and a read-modify-write of the fp32 grad_weight in fp32); it left out the bf16
backward's vocabulary pass (the logits matmul again, the slice kernel, the hidden re-read per vocabulary tile)
and charged the ignored rows, which are skipped. At N = 8192, H = 4096, V = 128256 (bytes per logit element,
read + write, new model / old): bf16 forward 18.2 / 15.2 (1.20x), backward 16.2 / 3.2 (5.1x), full 34.4 / 18.4
(1.87x); with half the rows ignored bf16 full 20.5 / 18.4 (1.11x) and forward 9.2 / 15.2 (0.60x); fp32 full 54.4
/ 32.5 (1.67x). The GB/s columns moved by those factors.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the interpreter flag must precede every @triton.jit decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch.nn.functional as F  # noqa: E402

import kernels  # noqa: E402
from bench import (
    bench_cross_entropy,  # noqa: E402
    common,  # noqa: E402
)
from bench.bench_cross_entropy import DTYPES, add_speedups  # noqa: E402
from kernels.fused_linear_cross_entropy import (  # noqa: E402
    _chunk_rows,
    _vocab_tile,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_ref,
)

PROVIDERS = ("ours", "torch", "torch_ref", "torch_compile", "liger")
MODES = ("forward", "backward", "full")
GPU_SHAPES = [(n, h, 128256) for h in (2048, 4096) for n in (4096, 8192, 16384)]
CPU_SHAPES = [(16, 64, 500)]
KEYS = ("mode", "tokens", "hidden", "vocab", "dtype", "ignored")
IGNORED = (0.0, 0.5)


def _liger(softcap=None):
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except Exception:
        return None
    return lambda h, w, t: liger_fused_linear_cross_entropy(h, w, t, softcap=softcap)


def make_loss_fn(provider: str, compile_backend: str, softcap: float | None = None):
    if provider == "ours":
        return lambda h, w, t: fused_linear_cross_entropy(h, w, t, softcap=softcap)
    if provider == "torch":
        return lambda h, w, t: F.cross_entropy(kernels.softcapped(F.linear(h, w), softcap), t)
    if provider == "torch_ref":
        return lambda h, w, t: fused_linear_cross_entropy_ref(h, w, t, softcap=softcap)
    if provider == "torch_compile":
        return torch.compile(
            functools.partial(fused_linear_cross_entropy_ref, softcap=softcap), backend=compile_backend
        )
    if provider == "liger":
        return _liger(softcap)
    raise ValueError(f"unknown provider {provider!r}; choose from {', '.join(PROVIDERS)}")


def bench_one(provider, n_tokens, hdim, vocab, dtype, ignored, compile_backend, dev, reps=3, softcap=None):
    fn = make_loss_fn(provider, compile_backend, softcap)
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

    def reset():
        hidden.grad = weight.grad = None

    with kernels.backend("triton" if provider == "ours" else "auto"):
        times, peak = common.mode_times(forward, full, reset, reps)
    logits_bytes = n_tokens * vocab * hidden.element_size()
    matmul = 2 * n_tokens * hdim * vocab
    out = {}
    for mode in MODES:
        t, flops = times[mode], {"forward": 1, "backward": 2, "full": 3}[mode] * matmul
        row = {
            "op": "fused_linear_cross_entropy",
            "provider": provider,
            "mode": mode,
            "tokens": n_tokens,
            "hidden": hdim,
            "vocab": vocab,
            "dtype": str(dtype).replace("torch.", ""),
            "ignored": ignored,
            "softcap": softcap,
            "derived": mode == "backward",
        }
        row.update(t)
        if t["ms"] > 0:  # a derived backward can come out <= 0 within timing noise on a CPU
            row.update(common.physics(t["ms"], flops=flops))
            if provider == "ours":
                model = byte_model(mode, hidden.element_size(), n_tokens, hdim, vocab, int((target == -100).sum()))
                row.update(model.columns(n_tokens * vocab, t["ms"]))
        row["peak_extra_bytes"] = peak
        row["peak_extra_over_logits"] = None if peak is None else peak / logits_bytes
        out[mode] = row
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def mm_fp32_parts(add, m_rows, inner, cols, a_size, b_size, accumulate, out_size=4, *, cuda):
    """The torch ops of the fused loss's `_mm_fp32` into `add(name, read, write)`: out (m, cols) of out_size bytes =
    a (m, inner) @ b (inner, cols), operands of a_size / b_size bytes (off CUDA through fp32 copies). Shared by
    the byte models of every op built on fused linear cross-entropy's chunks."""
    if out_size != 4 and not cuda:  # a bf16/fp16 out elsewhere: fp32 copies, an fp32 product, one rounding copy
        if accumulate:
            add("aten._to_copy", m_rows * cols * out_size, 4 * m_rows * cols)
        add("aten._to_copy", m_rows * inner * a_size + inner * cols * b_size, 4 * (m_rows * inner + inner * cols))
        add(
            "aten.addmm" if accumulate else "aten.mm",
            4 * (m_rows * inner + inner * cols) + (4 * m_rows * cols if accumulate else 0),
            4 * m_rows * cols,
        )
        add("aten.copy_", 4 * m_rows * cols, out_size * m_rows * cols)
        return
    if a_size != 4 and not cuda:  # upcast copies first
        add("aten._to_copy", m_rows * inner * a_size + inner * cols * b_size, 4 * (m_rows * inner + inner * cols))
        a_size = b_size = 4
    name = ("aten.addmm_" if a_size == 4 else "aten.addmm") if accumulate else "aten.mm"  # addmm: out_dtype
    add(
        name,
        m_rows * inner * a_size + inner * cols * b_size + (out_size * m_rows * cols if accumulate else 0),
        out_size * m_rows * cols,
    )


def traffic_parts(
    mode: str,
    n_tokens: int,
    hdim: int,
    vocab: int,
    s: int,
    n_ignored: int = 0,
    *,
    w: int | None = None,
    cuda: bool = True,
    reduction: str = "mean",
    loss_size: int | None = None,
) -> dict[str, tuple[int, int]]:
    """(read, write) bytes of every launch of our op, summed per kernel or torch op name, for `mode` ("forward" with
    every gradient, as the bench runs it; "backward" with grad_output 1; "full"): hidden (N, H) of element size s,
    weight (V, H) of element size w (default s), no bias, int64 targets on the host with n_ignored ignored,
    reduction "mean". w != s is autocast (an fp32 weight with bf16/fp16 hidden states, as the trainer runs it): the
    weight is cast for the matmuls and the loss is fp32. cuda: the CUDA matmuls read bf16/fp16 operands with an
    fp32 output (no upcast copies), and the launch grids of the GPU. Module docstring for the algorithm.
    reduction "none" (the per-row losses, kernels.fused_linear_preference's use): the forward computes the losses
    only; the backward, with a per-row grad_output of loss_size bytes (default: the loss's dtype), runs the token
    pass and, for a bf16/fp16 weight, the vocabulary pass."""
    w = s if w is None else w
    n, h, v, k = n_tokens, hdim, vocab, n_tokens - n_ignored
    autocast = w != s
    if loss_size is None:
        loss_size = 4 if autocast else s  # the loss, and so grad_output, in hidden's dtype, fp32 under autocast
    none = reduction == "none"
    parts: dict[str, list[int]] = {}

    def add(name, read, write):
        acc = parts.setdefault(name, [0, 0])
        acc[0] += read
        acc[1] += write

    mm_fp32 = functools.partial(mm_fp32_parts, add, cuda=cuda)

    def bwd_scale(numel, out_size, in_place):
        """cross_entropy_bwd on a flat gradient with a 0-d grad_output of 1 (in the loss's dtype, s)."""
        if numel == 0:
            return
        g = bench_cross_entropy._bwd_programs(numel, cuda) * loss_size
        add("_cross_entropy_bwd_kernel", g + (0 if in_place else 4 * numel), 0 if in_place else out_size * numel)

    def gather_rows():  # hidden[kept] (and the index), on the device
        if k < n:
            add("aten.index_select", 8 * k + k * h * s, k * h * s)

    def scatter_rows(size):  # grad_hidden into zeros at the kept rows
        if k < n:
            add("aten.zeros", 0, n * h * size)
            add("aten.index_copy_", 8 * k + k * h * size, k * h * size)

    def chunk_starts():
        chunk = _chunk_rows(k, h, v) if k else 1
        return [(start, min(chunk, k - start)) for start in range(0, k, chunk)]

    if mode in ("forward", "full"):
        # the kept rows (and for "mean" the denominator), on the host
        add("aten.ne", (1 if none else 2) * 8 * n, (1 if none else 2) * n)
        if not none:
            add("aten.sum", n + 4 * k, 8 + 4)
            add("aten.clamp", 8, 8)
            add("aten._to_copy", 8, 4)
        add("aten.nonzero", n, 8 * k)
        if k < n:
            add("aten.index_select", 8 * k + 8 * k, 8 * k)  # the kept targets
        gather_rows()
        if not none:
            add("aten.reciprocal", 4, 4)
        if autocast:
            add("aten._to_copy", v * h * w, v * h * s)  # the weight in the matmuls' dtype
        if k == 0 and not none:
            add("aten.zeros", 0, w * v * h)  # grad_weight of no rows
        for start, c in chunk_starts():
            add("aten.mm", c * h * s + v * h * s, c * v * s)  # the chunk's logits
            if none:  # the losses only
                add("_cross_entropy_fwd_kernel", 8 * c + c * (v + 1) * s, 8 * c)
                continue
            add("_cross_entropy_fwd_kernel", 8 * c + c * (2 * v + 1) * s + 4 * c, c * v * s + 8 * c)
            mm_fp32(c, v, h, s, s, accumulate=False)  # grad_hidden
            mm_fp32(v, c, h, s, s, accumulate=start > 0, out_size=w)  # grad_weight, in the weight's dtype
        if none:
            if k < n:  # the kept rows' losses into zeros
                add("aten.zeros", 0, 4 * n)
                add("aten.index_copy_", 8 * k + 4 * k, 4 * k)
            if loss_size != 4:
                add("aten._to_copy", 4 * n, loss_size * n)
        else:
            add("aten.div", 8, 4)  # the mean
            if loss_size != 4:
                add("aten._to_copy", 4, loss_size)  # the loss in hidden's dtype
    if mode in ("backward", "full") and none:
        # grad_output per row in fp32 at the kept rows, then the token pass with it folded in
        if loss_size != 4:
            add("aten._to_copy", loss_size * n, 4 * n)
        if k < n:
            add("aten.index_select", 8 * k + 4 * k, 4 * k)
        gather_rows()
        if autocast:
            add("aten._to_copy", v * h * w, v * h * s)
        vocab_pass = w != 4  # a bf16/fp16 weight's gradient is summed in fp32 per vocabulary slice
        if k == 0 and not vocab_pass:
            add("aten.zeros", 0, w * v * h)
        for start, c in chunk_starts():
            add("aten.mm", c * h * s + v * h * s, c * v * s)
            add("_cross_entropy_fwd_kernel", 8 * c + c * (2 * v + 1) * s + 4 * c, c * v * s + 8 * c)
            if vocab_pass:  # lse and the target column's gradient kept for the vocabulary pass
                add("aten.copy_", 4 * c + c * s, 4 * c + c * s)
                add("aten.clamp", 8 * c, 8 * c)
                add("aten.gather", 8 * c + c * s, c * s)
            mm_fp32(c, v, h, s, s, accumulate=False)  # grad_hidden
            if not vocab_pass:
                mm_fp32(v, c, h, s, s, accumulate=start > 0, out_size=w)
        if vocab_pass and k == 0:
            add("aten.zero_", 0, w * v * h)
        elif vocab_pass:
            tile_rows, tile_cols = _vocab_tile(k, h, v)
            for col_start in range(0, v, tile_cols):
                cols = min(tile_cols, v - col_start)
                block = min(1 << (cols - 1).bit_length(), 4096 if cuda else 8192)  # _slice_grad_'s tile
                for start in range(0, k, tile_rows):
                    c = min(tile_rows, k - start)
                    add("aten.mm", c * h * s + cols * h * s, c * cols * s)  # the slice's logits
                    programs = c * _cdiv(cols, block)  # each reads its row's target, lse, scale and target gradient
                    add("_flce_slice_grad_kernel", programs * (8 + 4 + 4 + s) + c * cols * s, c * cols * s)
                    mm_fp32(cols, c, h, s, s, accumulate=start > 0)  # into the fp32 slice accumulator
                add("aten.copy_", 4 * cols * h, w * cols * h)  # rounded once into grad_weight
        if s != 4:
            add("aten._to_copy", 4 * k * h, s * k * h)  # grad_hidden rounded once
        scatter_rows(s)
    elif mode in ("backward", "full"):
        add("aten.ones_like", 0, loss_size)  # autograd's grad_output
        bwd_scale(v * h, w, in_place=True)  # grad_weight, skipped: grad_output is 1
        bwd_scale(k * h, s, in_place=s == 4)  # grad_hidden: skipped in fp32, else rounded once
        scatter_rows(s)
    return {name: (r, wr) for name, (r, wr) in parts.items()}


def traffic_model(
    mode: str, n_tokens: int, hdim: int, vocab: int, s: int, n_ignored: int = 0, **kwargs
) -> tuple[int, int]:
    """(read, write) bytes of our op (`traffic_parts` summed)."""
    parts = traffic_parts(mode, n_tokens, hdim, vocab, s, n_ignored, **kwargs).values()
    return sum(r for r, _ in parts), sum(w for _, w in parts)


def min_traffic(mode: str, n_tokens: int, hdim: int, vocab: int, s: int, n_ignored: int = 0) -> tuple[int, int]:
    """The least the op moves: the kept rows of hidden and the weight read once; both gradients written once."""
    read = ((n_tokens - n_ignored) * hdim + vocab * hdim) * s
    write = (n_tokens * hdim + vocab * hdim) * s
    return {"forward": (read, 0), "full": (read, write), "backward": (0, write)}[mode]


def byte_model(mode: str, s: int, n_tokens: int, hdim: int, vocab: int, n_ignored: int = 0) -> common.ByteModel:
    """Our bytes read/written per logit element and the minimum (module docstring)."""
    ours = traffic_model(mode, n_tokens, hdim, vocab, s, n_ignored, cuda=common.on_gpu())
    return common.ByteModel.from_totals(ours, min_traffic(mode, n_tokens, hdim, vocab, s, n_ignored), n_tokens * vocab)


def add_memory_ratio(rows, keys=KEYS):
    """peak_vs_torch on every row: its peak extra memory over torch eager's, same shape (keys)."""
    torch_peaks = {tuple(r[k] for k in keys): r["peak_extra_bytes"] for r in rows if r["provider"] == "torch"}
    for row in rows:
        base = torch_peaks.get(tuple(row[k] for k in keys))
        row["peak_vs_torch"] = row["peak_extra_bytes"] / base if base and row["peak_extra_bytes"] is not None else None


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--quick", action="store_true", help="one tiny shape (CPU smoke run)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--tokens", type=int, nargs="*", help="override the token counts")
    parser.add_argument("--hidden", type=int, nargs="*", help="override the hidden sizes")
    parser.add_argument("--vocab", type=int, nargs="*", help="override the vocabulary sizes")
    parser.add_argument("--providers", nargs="*", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument(
        "--ignored", type=float, nargs="*", default=list(IGNORED), help="fractions of ignored targets (default 0 0.5)"
    )
    parser.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend for torch_compile (default inductor)"
    )
    parser.add_argument("--softcap", type=float, help="final logit softcapping for every provider (Gemma 2's: 30)")
    args = parser.parse_args(argv)
    bad = [f for f in args.ignored if not 0.0 <= f < 1.0]
    if bad:
        parser.error(f"--ignored {bad[0]} must be a fraction in [0, 1)")
    if args.softcap is not None and not args.softcap > 0:
        parser.error(f"--softcap {args.softcap:g} must be > 0")

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
            result = bench_one(
                provider,
                n_tokens,
                hdim,
                vocab,
                DTYPES[args.dtype],
                ignored,
                args.compile_backend,
                dev,
                reps=1 if args.quick else 3,
                softcap=args.softcap,
            )
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
            + (f" {row['tflop_s']:.3g} TFLOP/s" if row.get("tflop_s") else "")
            + common.byte_model_text(row)
        )
    path = common.write_rows("fused_linear_cross_entropy", rows)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
