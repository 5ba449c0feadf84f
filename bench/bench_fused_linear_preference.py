"""Benchmark a DPO step's LM head: kernels.fused_linear_preference against the materialised torch reference and
liger-kernel's fused linear DPO loss.

The step (every provider, same inputs): P pairs of T tokens laid out [chosen; rejected] (S = 2P sequences), the
first `--prompt` fraction of each sequence a prompt (ignore_index), the rest the answer. The reference model's
log-probs (its own hidden states and a second weight, no gradient), the policy's, the sigmoid DPO loss (beta 0.1),
and in "full" the backward to the policy's hidden states and weight.
  ours   kernels.fused_linear_preference under no_grad (reference) and with autograd (policy), then
         kernels.preference_loss; targets on the host, so the prompt rows are skipped before any matmul
  fused  kernels.fused_linear_preference_loss for the policy (the loss inside the op, its gradients formed in the
         forward: `loss_matmul_flops`), the reference as in ours
  torch  the same with fused_linear_preference_ref: F.linear to the (S*T, V) logits, fp32 log_softmax, gather
  liger  liger_kernel.chunked_loss.LigerFusedLinearDPOLoss (its reference pass inside, from ref_input and
         ref_weight); skipped where liger-kernel is not installed, and on a CPU (its chunked loss is compiled for
         the GPU; on a CPU it is neither a figure nor fast)
Modes: forward (the loss with requires_grad=True), full (forward + backward), backward = full - forward (derived).

Physics. FLOPs are eager's matmuls over all N = S*T rows, the same for every provider (so TFLOP/s compares times):
forward 4 N H V (reference and policy logits), full 8 N H V. Ours runs them on the K answer rows and recomputes
the policy's logits in backward (kernels/fused_linear_preference.py): `matmul_flops` gives its count, forward
2 x (2 K H V + 4 N H) (the mean-logit matmul (N, H) x (H, 2) beside the logits), backward 6 K H V with an fp32
weight and 8 K H V with a bf16/fp16 one (the vocabulary pass), tested equal to torch's FlopCounterMode in
tests/kernels/test_fused_linear_preference.py. Peak extra memory over the step with the inputs allocated (GPU).

Byte model: `traffic_parts(mode, n_seqs, seq_len, hdim, vocab, s, n_ignored, w=s)` -> {launch: (read, write)} bytes
of one call of our op ("forward", the same with or without a gradient; "backward" from an fp32 (S,) upstream
gradient; "full"): fused linear cross-entropy's reduction="none" (bench/bench_fused_linear_cross_entropy.py's
`traffic_parts`, with fp32 losses) plus the sequence index (arange, floor_divide), the sums by sequence
(index_add_), the mean-logit matmul and the upstream gradient's spread to the rows, each torch op as one pass
over its operands as bench/traffic.py counts them; tested equal to the meter by tests/bench/test_byte_models.py.
`traffic_model` is the step: the reference forward, the policy forward and (full) its backward; the loss's
O(S) torch ops are left out. `min_traffic`: the kept rows of both hidden states and both weights read once,
grad_hidden and grad_weight written once. `byte_model` divides both by N*V (per logit element).

GPU: Llama-3.2-1B's head (H 2048, V 128256) at 8 pairs of 1024 tokens and Llama-3-8B's (H 4096) at 4 pairs of
2048, bf16, half of each sequence prompt. CPU (`--quick`): a tiny shape through the Triton interpreter
(perf_figure=False rows).

    python bench/bench_fused_linear_preference.py            # GPU
    python bench/bench_fused_linear_preference.py --quick    # CPU smoke run
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

import kernels  # noqa: E402
from bench import bench_cross_entropy, common  # noqa: E402
from bench import bench_fused_linear_cross_entropy as bench_flce  # noqa: E402
from bench.bench_cross_entropy import DTYPES, add_speedups  # noqa: E402
from kernels import fused_linear_preference, fused_linear_preference_ref, preference_loss  # noqa: E402

PROVIDERS = ("ours", "fused", "torch", "liger")
MODES = ("forward", "backward", "full")
GPU_SHAPES = [(8, 1024, 2048, 128256), (4, 2048, 4096, 128256)]  # (pairs, tokens per sequence, hidden, vocab)
CPU_SHAPES = [(2, 8, 64, 500)]
KEYS = ("mode", "pairs", "seq_len", "hidden", "vocab", "dtype", "prompt")
BETA = 0.1


def _liger_dpo():
    """liger-kernel's fused linear DPO loss as loss(hidden, weight, target, ref_hidden, ref_weight), or (None, why)."""
    if not common.on_gpu():
        return None, "liger's fused DPO loss is benchmarked on a GPU only"
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss
    except Exception as exc:  # not installed, or an incompatible version
        return None, f"liger-kernel's LigerFusedLinearDPOLoss is not importable ({exc})"
    loss_fn = LigerFusedLinearDPOLoss(beta=BETA, use_ref_model=True)
    return (lambda h, w, t, rh, rw: loss_fn(w, h, t, None, rh, rw)[0]), None


def make_step(provider):
    """(step(hidden, weight, target, ref_hidden, ref_weight) -> loss, None), or (None, why it is skipped)."""
    if provider == "liger":
        return _liger_dpo()
    if provider == "fused":  # the loss inside the op: 6 K H V for the policy (loss_matmul_flops)

        def fused_step(hidden, weight, target, ref_hidden, ref_weight):
            with torch.no_grad():
                ref_logps = fused_linear_preference(ref_hidden, ref_weight, target).logps
            return kernels.fused_linear_preference_loss(hidden, weight, target, None, ref_logps, beta=BETA)[0]

        return fused_step, None
    fn = {"ours": fused_linear_preference, "torch": fused_linear_preference_ref}.get(provider)
    if fn is None:
        raise ValueError(f"unknown provider {provider!r}; choose from {', '.join(PROVIDERS)}")

    def step(hidden, weight, target, ref_hidden, ref_weight):
        with torch.no_grad():
            ref_logps = fn(ref_hidden, ref_weight, target).logps
        return preference_loss(fn(hidden, weight, target), ref_logps, loss_type="sigmoid", beta=BETA)[0]

    return step, None


def make_inputs(pairs, seq_len, hdim, vocab, dtype, prompt, dev):
    gen = torch.Generator(device=dev).manual_seed(0)
    n_seqs = 2 * pairs
    hidden = torch.randn(n_seqs, seq_len, hdim, device=dev, dtype=dtype, generator=gen).requires_grad_()
    ref_hidden = torch.randn(n_seqs, seq_len, hdim, device=dev, dtype=dtype, generator=gen)
    weight = (torch.randn(vocab, hdim, device=dev, dtype=dtype, generator=gen) / hdim**0.5).requires_grad_()
    ref_weight = weight.detach() + 0.01 * torch.randn(vocab, hdim, device=dev, dtype=dtype, generator=gen) / hdim**0.5
    target = torch.randint(0, vocab, (n_seqs, seq_len), device=dev, generator=gen)
    target[:, : int(prompt * seq_len)] = -100
    return hidden, weight, target, ref_hidden, ref_weight


def bench_one(provider, pairs, seq_len, hdim, vocab, dtype, prompt, dev, reps=3):
    step, why = make_step(provider)
    if step is None:
        return None, why
    hidden, weight, target, ref_hidden, ref_weight = make_inputs(pairs, seq_len, hdim, vocab, dtype, prompt, dev)
    if provider in ("ours", "fused"):
        target = target.cpu()  # host labels, as the collator builds them: the prompt rows are known without a sync

    def forward():
        return step(hidden, weight, target, ref_hidden, ref_weight)

    def reset():
        hidden.grad = weight.grad = None

    def full():
        reset()
        step(hidden, weight, target, ref_hidden, ref_weight).backward()

    with kernels.backend("triton" if provider in ("ours", "fused") else "auto"):
        times, peak = common.mode_times(forward, full, reset, reps)
    n_seqs, s = 2 * pairs, hidden.element_size()
    n_rows, n_ignored = n_seqs * seq_len, int((target == -100).sum())
    logits_flops = (
        2 * n_rows * hdim * vocab
    )  # eager: reference and policy logits forward, the policy's gradients backward
    out = {}
    for mode in MODES:
        t, flops = times[mode], {"forward": 2, "backward": 2, "full": 4}[mode] * logits_flops
        row = {
            "op": "fused_linear_preference",
            "provider": provider,
            "mode": mode,
            "pairs": pairs,
            "seq_len": seq_len,
            "hidden": hdim,
            "vocab": vocab,
            "dtype": str(dtype).replace("torch.", ""),
            "prompt": prompt,
            "derived": mode == "backward",
        }
        row.update(t)
        if t["ms"] > 0:  # a derived backward can come out <= 0 within timing noise on a CPU
            row.update(common.physics(t["ms"], flops=flops))
            if provider == "ours":
                row["matmul_flops_ours"] = step_flops(mode, n_seqs, seq_len, hdim, vocab, n_ignored, s)
                row.update(
                    byte_model(mode, s, n_seqs, seq_len, hdim, vocab, n_ignored).columns(n_rows * vocab, t["ms"])
                )
        row["peak_extra_bytes"] = peak
        row["peak_extra_over_logits"] = None if peak is None else peak / (n_rows * vocab * s)
        out[mode] = row
    return out, None


def matmul_flops(mode, n_seqs, seq_len, hdim, vocab, n_ignored, w):
    """Matmul FLOPs of one call of our op (module docstring) with a weight of w bytes per element."""
    n = n_seqs * seq_len
    k = n - n_ignored
    forward = 2 * k * hdim * vocab + 4 * n * hdim
    backward = (6 if w == 4 else 8) * k * hdim * vocab
    return {"forward": forward, "backward": backward, "full": forward + backward}[mode]


def loss_matmul_flops(n_seqs, seq_len, hdim, vocab, n_ignored):
    """Matmul FLOPs of one policy call of kernels.fused_linear_preference_loss, forward and backward together (the
    gradients are formed in its forward, backward only scales them): logits, grad_hidden and grad_weight on the K
    answer rows (6 K H V, whatever the weight's dtype), and the mean-logit matmul (K, H) x (H, 2)."""
    k = n_seqs * seq_len - n_ignored
    return 6 * k * hdim * vocab + 4 * k * hdim


def step_flops(mode, n_seqs, seq_len, hdim, vocab, n_ignored, w):
    """The bench's step: the reference's forward, the policy's forward and (full, backward) its backward."""
    forward = matmul_flops("forward", n_seqs, seq_len, hdim, vocab, n_ignored, w)
    backward = matmul_flops("backward", n_seqs, seq_len, hdim, vocab, n_ignored, w)
    return {"forward": 2 * forward, "backward": backward, "full": 2 * forward + backward}[mode]


def traffic_parts(
    mode: str,
    n_seqs: int,
    seq_len: int,
    hdim: int,
    vocab: int,
    s: int,
    n_ignored: int = 0,
    *,
    w: int | None = None,
    cuda: bool = True,
) -> dict[str, tuple[int, int]]:
    """(read, write) bytes of one call of our op per kernel or torch op name (module docstring): hidden (S, T, H) of
    s bytes, weight (V, H) of w bytes (default s; w != s is autocast), no bias, host targets, n_ignored ignored."""
    w = s if w is None else w
    n, h, v, n_s = n_seqs * seq_len, hdim, vocab, n_seqs
    k = n - n_ignored
    parts = {
        name: list(rw)
        for name, rw in bench_flce.traffic_parts(
            mode, n, h, v, s, n_ignored, w=w, cuda=cuda, reduction="none", loss_size=4
        ).items()
    }

    def add(name, read, write):
        acc = parts.setdefault(name, [0, 0])
        acc[0] += read
        acc[1] += write

    if mode in ("forward", "full"):
        add("aten.arange", 0, 8 * n)  # the sequence of every row: row // T
        add("aten.floor_divide", 8 * n, 8 * n)
        if k < n:
            add("aten.index_select", 8 * k + 8 * k, 8 * k)  # the kept rows' sequences
        add("aten.neg", 4 * n, 4 * n)  # logp = -nll
        add("aten.zeros", 0, 4 * n_s + 8 * n_s + 4 * n_s)  # logps, counts, the mean-logit sums
        add("aten.ones_like", 0, 8 * k)
        add("aten.index_add_", (4 * n_s + 12 * n) + (8 * n_s + 16 * k) + (4 * n_s + 12 * k), 16 * n_s)
        # the mean logit: h . mean_v w_v, the fp32 mean as two parts in hidden's dtype
        add("aten.mean", v * h * w, 4 * h)
        if s != 4:
            add("aten._to_copy", 4 * h + s * h + 4 * h, s * h + 4 * h + s * h)  # high, high.float(), the low part
        add("aten.sub", 8 * h, 4 * h)
        add("aten.stack", 2 * h * s, 2 * h * s)
        if s != 4 and not cuda:  # _mm_fp32 upcasts its operands off CUDA
            add("aten._to_copy", n * h * s + 2 * h * s, 4 * (n * h + 2 * h))
            add("aten.mm", 4 * (n * h + 2 * h), 8 * n)
        else:
            add("aten.mm", n * h * s + 2 * h * s, 8 * n)
        add("aten.sum", 8 * n, 4 * n)
        if k < n:
            add("aten.index_select", 8 * k + 4 * k, 4 * k)  # the kept rows' means
        add("aten.clamp", 8 * n_s, 8 * n_s)
        add("aten.div", 4 * n_s + 8 * n_s, 4 * n_s)
    if mode in ("backward", "full"):
        add("aten.neg", 4 * n_s, 4 * n_s)  # the rows' upstream gradient: -grad_logps[seq]
        add("aten.index_select", 8 * n + 4 * n, 4 * n)
    return {name: (r, wr) for name, (r, wr) in parts.items()}


def loss_traffic_parts(
    mode: str,
    n_seqs: int,
    seq_len: int,
    hdim: int,
    vocab: int,
    s: int,
    per_pair: list[int],
    *,
    w: int | None = None,
    cuda: bool = True,
) -> dict[str, tuple[int, int]]:
    """(read, write) bytes of one policy call of kernels.fused_linear_preference_loss per kernel or torch op name:
    hidden (S, T, H) of s bytes, weight (V, H) of w bytes (default s), no bias, a reference, host targets;
    per_pair: the answer rows of each chunk's pairs, one list entry per chunk as (rows, pairs). "forward" forms
    every gradient, "backward" scales them by an fp32 upstream gradient of 1 (from loss.backward()). The loss's
    O(pairs) torch ops (the chunk's autograd of the pair losses, the final loss value) are left out; the test pauses
    the meter there."""
    w = s if w is None else w
    n, h, v, n_s = n_seqs * seq_len, hdim, vocab, n_seqs
    k = sum(rows for rows, _ in per_pair)
    parts: dict[str, list[int]] = {}

    def add(name, read, write):
        acc = parts.setdefault(name, [0, 0])
        acc[0] += read
        acc[1] += write

    mm_fp32 = functools.partial(bench_flce.mm_fp32_parts, add, cuda=cuda)

    if mode in ("forward", "full"):
        add("aten.ne", 8 * n, n)  # the kept rows, on the host
        add("aten._to_copy", 8 * n_s, 4 * n_s)  # counts.float()
        add("aten.sum", 4 * (n_s // 2), 4)  # the chosen answer tokens
        add("aten.clamp", 4, 4)
        add("aten.zeros", 0, 4 * n_s + 4 * n_s)  # logps, the per-sequence gradient
        if k < n:
            add("aten.index_select", 8 * k + 8 * k, 8 * k)  # the kept targets (host)
            add("aten.index_select", 8 * k + k * h * s, k * h * s)  # the kept rows of hidden
        if w != s:
            add("aten._to_copy", v * h * w, v * h * s)  # the weight in the matmuls' dtype
        start = 0
        for c, pairs in per_pair:
            add("aten.arange", 0, 16 * pairs)  # the chunk's sequences
            add("aten.cat", 16 * pairs, 16 * pairs)
            if c == 0:
                continue
            add("aten.mm", c * h * s + v * h * s, c * v * s)  # the chunk's logits
            add("_cross_entropy_fwd_kernel", 8 * c + c * (v + 1) * s, 8 * c)  # the losses only
            add("aten.index_add_", 4 * n_s + 12 * c, 4 * n_s)  # logps
            add("aten.index_select", 3 * (12 * 2 * pairs) + 12 * c, 3 * 4 * 2 * pairs + 4 * c)  # chunk's numbers
            add("aten.index_copy_", 12 * 2 * pairs, 4 * 2 * pairs)  # the chunk's dL/dlogps
            add("aten.neg_", 4 * c, 4 * c)  # the rows' scales
            add("_cross_entropy_fwd_kernel", 8 * c + c * (2 * v + 1) * s + 4 * c, c * v * s + 8 * c)  # the gradient
            mm_fp32(c, v, h, s, s, accumulate=False)  # grad_hidden
            mm_fp32(v, c, h, s, s, accumulate=start > 0, out_size=w)  # grad_weight
            start += c
        # the mean logits: h . mean_v w_v as two parts in hidden's dtype, on the kept rows
        add("aten.mean", v * h * w, 4 * h)
        if s != 4:
            add("aten._to_copy", 4 * h + s * h + 4 * h, s * h + 4 * h + s * h)
        add("aten.sub", 8 * h, 4 * h)
        add("aten.stack", 2 * h * s, 2 * h * s)
        mm_fp32(k, h, 2, s, s, accumulate=False)
        add("aten.sum", 8 * k, 4 * k)
        add("aten.zeros", 0, 4 * n_s)
        add("aten.index_add_", 4 * n_s + 12 * k, 4 * n_s)
        add("aten.clamp", 8 * n_s, 8 * n_s)
        add("aten.div", 12 * n_s, 4 * n_s)
    if mode in ("backward", "full"):
        add("aten.ones_like", 0, 4)  # autograd's grad of the fp32 loss

        def bwd_scale(numel, out_size, in_place):
            g = bench_cross_entropy._bwd_programs(numel, cuda) * 4
            add("_cross_entropy_bwd_kernel", g + (0 if in_place else 4 * numel), 0 if in_place else out_size * numel)

        bwd_scale(k * h, s, in_place=s == 4)  # grad_hidden, rounded to hidden's dtype
        bwd_scale(v * h, w, in_place=True)  # grad_weight, in place
        if k < n:
            add("aten.zeros", 0, n * h * s)
            add("aten.index_copy_", 8 * k + k * h * s, k * h * s)
    return {name: (r, wr) for name, (r, wr) in parts.items()}


def traffic_model(
    mode: str, n_seqs: int, seq_len: int, hdim: int, vocab: int, s: int, n_ignored: int = 0, **kwargs
) -> tuple[int, int]:
    """(read, write) bytes of the bench's step: the reference forward, the policy forward and (full) its backward."""
    calls = {"forward": ("forward", "forward"), "backward": ("backward",), "full": ("forward", "full")}[mode]
    totals = [traffic_parts(m, n_seqs, seq_len, hdim, vocab, s, n_ignored, **kwargs).values() for m in calls]
    return sum(r for parts in totals for r, _ in parts), sum(w for parts in totals for _, w in parts)


def min_traffic(
    mode: str, n_seqs: int, seq_len: int, hdim: int, vocab: int, s: int, n_ignored: int = 0
) -> tuple[int, int]:
    """The least the step moves: the kept rows of both hidden states and both weights read once; the gradients written
    once."""
    n = n_seqs * seq_len
    read = 2 * ((n - n_ignored) * hdim + vocab * hdim) * s
    write = (n * hdim + vocab * hdim) * s
    return {"forward": (read, 0), "full": (read, write), "backward": (0, write)}[mode]


def byte_model(
    mode: str, s: int, n_seqs: int, seq_len: int, hdim: int, vocab: int, n_ignored: int = 0
) -> common.ByteModel:
    """Our bytes read/written per logit element of the policy's N x V and the minimum (module docstring)."""
    ours = traffic_model(mode, n_seqs, seq_len, hdim, vocab, s, n_ignored, cuda=common.on_gpu())
    minimum = min_traffic(mode, n_seqs, seq_len, hdim, vocab, s, n_ignored)
    return common.ByteModel.from_totals(ours, minimum, n_seqs * seq_len * vocab)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--quick", action="store_true", help="one tiny shape (CPU smoke run)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--providers", nargs="*", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument(
        "--prompt", type=float, default=0.5, help="fraction of each sequence that is prompt (default 0.5)"
    )
    args = parser.parse_args(argv)
    if not 0.0 <= args.prompt < 1.0:
        parser.error(f"--prompt {args.prompt} must be a fraction in [0, 1)")
    dev = common.device()
    shapes = CPU_SHAPES if (args.quick or not common.on_gpu()) else GPU_SHAPES
    env = common.env_info()
    rows = []
    for pairs, seq_len, hdim, vocab in shapes:
        shape_rows = []
        for provider in args.providers:
            result, why = bench_one(
                provider, pairs, seq_len, hdim, vocab, DTYPES[args.dtype], args.prompt, dev, reps=1 if args.quick else 3
            )
            if result is None:
                print(f"skip {provider}: {why}")
                continue
            shape_rows.extend(result.values())
        add_speedups(shape_rows, KEYS)
        bench_flce.add_memory_ratio(shape_rows, KEYS)
        rows.extend(shape_rows)
    for row in rows:
        row.update(env)
        print(
            f"{row['provider']:>6} {row['mode']:>8} P={row['pairs']} T={row['seq_len']} "
            f"H={row['hidden']} V={row['vocab']} "
            f"prompt={row['prompt']:g} {row['ms']:.3f} ms"
            + (f" {row['tflop_s']:.3g} TFLOP/s" if row.get("tflop_s") else "")
            + common.byte_model_text(row)
        )
    path = common.write_rows("fused_linear_preference", rows)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
