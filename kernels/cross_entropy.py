"""Cross-entropy over a large vocabulary: loss and logit gradient in one launch.

Math, per row with logits x (V classes), target y, label smoothing s, z-loss weight z:

    m = max_j x_j,   d = sum_j exp(x_j - m),   lse = m + log d,   p_j = exp(x_j - m) / d
    loss = (1 - s) * (lse - x_y) + s * (lse - mean_j x_j) + z * lse^2      (0 when y == ignore_index)
    dloss/dx_j = p_j * (1 + 2 z lse) - s / V - (1 - s) [j == y]

which is `torch.nn.functional.cross_entropy` (same label-smoothing formula: (1-s)*nll + s * mean over
classes of -log p) plus PaLM's z-loss.

Softcapping (`softcap` c, Gemma 2's final_logit_softcapping): the loss is taken over x'_j = c tanh(x_j / c) instead
of x_j, as transformers' Gemma 2 caps its logits before the loss; every formula above holds with x' for x, and the
stored gradient is dloss/dx_j = dloss/dx'_j (1 - tanh^2(x_j / c)), tanh's own backward. tanh is computed in the
kernel from exp2 ((1 - e) / (1 + e), e = exp(-2|u|)) and, for |u| < 1/4 where 1 - e cancels, its odd Taylor series to
u^9: within 2.5e-7 relative and 4.1e-6 absolute of fp32 torch.tanh times c = 30 over [-200, 200] (torch's own fp32
rounding of c tanh is 1.9e-6 absolute there). The capped logits are never stored: each tile is capped as it is read,
in both passes. Reductions: "none" (per row), "sum", "mean" (sum over rows /
number of non-ignored rows; 0, not NaN, when every row is ignored, where torch returns NaN), or
sum / num_items when `num_items` is given (gradient accumulation / data-parallel normalisation: pass
the global token count; a tensor avoids a host sync; only with reduction="mean").

Accuracy. The target-class gradient p_y - 1 is computed as -d_other / d with d_other the sum over the
classes other than y, accumulated separately: the naive 1/d - 1 rounds to 0 in fp32 once p_y > 1 - 6e-8
(e.g. the target logit 30 above 5000 others: true value -4.7e-10). The nll uses log1p(d_other / e_y)
for the same reason. Everything after a load is fp32; only the gradient store rounds to the logits'
dtype.

Kernel and bytes moved. One program per row. Pass 1 streams the row in BLOCK-wide tiles with an
online log-sum-exp (running max m, rescaled sums; Milakov & Gimelshein 2018). Pass 2 streams it again
and writes the gradient (only when a gradient is required), scaled by 1/denominator for "mean"; the
mean's denominator is read from device memory, so nothing syncs with the host. Per element: 2 reads +
1 write of the logits' dtype with a gradient (6 bytes in bf16), 1 read without.
GPU launch: BLOCK = min(next_pow2(V), 8192), num_warps = BLOCK / 512 clamped to [4, 32], at most 64 registers
per thread (maxnreg). At V = 128256 that is 16 warps, and at 64 registers two 512-thread programs share an SM's 64K
registers, so one program's row start and reductions can overlap the other's streaming (what it was tried for; the
timings below chose it). Each loop loads its next tile into registers before reducing the current one; pass 1 loads
with evict_last and pass 2 walks the row in reverse (its first tiles are pass 1's last) with evict_first, so pass 2
can re-read from L2 rather than HBM (~264 rows in flight on 132 SMs hold ~68 MB in bf16, beyond the 50 MB L2; the
previous default's ~132 held ~33 MB).
The choice is measured, in one run on an H200 (triton 3.6.0, git 875a621; `python bench/bench_cross_entropy.py
--variant all` at N = 8192, V = 128256, bf16, label smoothing 0.1; forward / forward + backward ms, median of
do_bench; rows in bench/results/h200/kernels.md): this launch 1.511 / 1.515, 7% faster than the previous default,
BLOCK 16384 over 32 warps with no register cap (one 1024-thread program per SM, now the variant "block16384"),
1.617 / 1.624. On that BLOCK 16384 launch, evict 1.607 / 1.612, pipelined 2.316 / 2.324, persistent 1.884 / 1.883
(`FWD_VARIANTS`, selected with `fwd_variant`; comments there); forward + backward, liger-kernel 2.082 and
torch.compile 3.949. ptxas for sm_90 (Triton 3.9's, 12.9) at that shape with label smoothing 0.1: this launch 61
registers, no spills (79 without the cap: one program per SM); block16384 and evict 61, persistent 64, no spills;
pipelined 64 with 112 bytes of spill stores (none at label smoothing 0); BLOCK 32768 over 32 warps spills 288 bytes.
Interpreter: BLOCK = min(next_pow2(V), 8192) (one tile for the tests' V = 5003, since the interpreter pays
per op); a test forces 1024-wide tiles to cover the multi-tile path.

Gradient buffer: the forward writes the gradient into a fresh (N, V) buffer in the logits' dtype,
never into the caller's logits, so the caller can never observe a clobbered tensor; that buffer is the
only vocabulary-sized allocation (no fp32 copy of the logits) and it is freed after the backward.
Backward multiplies it in place by grad_output (a scalar for mean/sum, one value per row for "none");
the kernel reads grad_output on the device and skips the pass when it equals 1 (the usual
`loss.backward()`), so the common backward costs one tiny launch and no host sync. With grad_output != 1
the gradient is rounded twice (<= 1 ulp instead of 0.5; exact for powers of two such as loss scales).
Because the buffer is modified in place, its autograd version is bumped: a second backward through a
retained graph raises PyTorch's "modified by an inplace operation" error instead of returning a wrongly
scaled gradient. Under torch.compile the scale is left to the compiler (out of place).

Targets outside [0, V) that are not ignore_index give a NaN loss and NaN gradient row (checking them on
the host would need a sync); the reference path raises instead.

Test: `python -m pytest tests/kernels/test_cross_entropy.py -q` (Triton interpreter on CPU).
Bench: `python bench/bench_cross_entropy.py` (GPU), `--quick` for a CPU smoke run.
"""

from __future__ import annotations

import contextlib

import torch

from ._dispatch import HAS_TRITON, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from ._jit_math import tanh
else:  # pragma: no cover - machines without triton run the reference only
    triton = None

_REDUCTIONS = ("mean", "sum", "none")

if HAS_TRITON:

    @triton.jit
    def _lse_tile(x, offs, mask, y_safe, m, d_other, x_sum, LABEL_SMOOTHING: tl.constexpr, ROW_SUMS: tl.constexpr):
        """One pass-1 tile of the online log-sum-exp: (m, d_other, x_sum) updated with the fp32 tile x (x_sum only for
        label smoothing or ROW_SUMS)."""
        LOG2E: tl.constexpr = 1.4426950408889634
        m_new = tl.maximum(m, tl.max(x, axis=0))
        e = tl.exp2((x - m_new) * LOG2E)
        d_other = d_other * tl.exp2((m - m_new) * LOG2E) + tl.sum(tl.where(offs == y_safe, 0.0, e), axis=0)
        if LABEL_SMOOTHING > 0.0 or ROW_SUMS:
            x_sum += tl.sum(tl.where(mask, x, 0.0), axis=0)
        return m_new, d_other, x_sum

    @triton.jit
    def _capped(x, mask, SOFTCAP: tl.constexpr):
        """The fp32 tile x softcapped (c tanh(x / c)) where mask, -inf elsewhere; x itself without SOFTCAP."""
        if SOFTCAP > 0.0:
            x = tl.where(mask, SOFTCAP * tanh(x / SOFTCAP), -float("inf"))
        return x

    @triton.jit
    def _grad_tile(
        grad_row, x, offs, mask, y_safe, m, coef, shift, grad_y, GRAD_EVICTION: tl.constexpr, SOFTCAP: tl.constexpr
    ):
        """One pass-2 tile of raw logits x: store coef * exp(x' - m) - shift (times tanh's derivative with SOFTCAP, x'
        the capped x), grad_y (already the raw logit's) at the target column."""
        LOG2E: tl.constexpr = 1.4426950408889634
        if SOFTCAP > 0.0:
            th = tanh(x / SOFTCAP)
            g = (coef * tl.exp2((SOFTCAP * th - m) * LOG2E) - shift) * (1.0 - th * th)
        else:
            g = coef * tl.exp2((x - m) * LOG2E) - shift
        g = tl.where(offs == y_safe, grad_y, g)
        tl.store(grad_row + offs, g.to(grad_row.dtype.element_ty), mask=mask, eviction_policy=GRAD_EVICTION)

    @triton.jit
    def _cross_entropy_row(
        row,  # int64 row index into the flattened (N, V) logits
        logits_ptr,
        grad_ptr,
        target_ptr,
        loss_ptr,
        lse_ptr,
        sum_ptr,
        scale_ptr,  # as in _cross_entropy_fwd_kernel
        n_cols,
        seq_len,
        stride_lb,
        stride_lt,
        stride_grad,
        scale_stride,
        ignore_index,
        LABEL_SMOOTHING: tl.constexpr,
        Z_LOSS: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        COMPUTE_GRAD: tl.constexpr,
        BLOCK: tl.constexpr,
        GRAD_EVICTION: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        SOFTCAP: tl.constexpr,
        ROW_SUMS: tl.constexpr,
    ):
        """Loss, lse and (with COMPUTE_GRAD) the gradient of one row; the math is in the module docstring."""
        LOG2E: tl.constexpr = 1.4426950408889634
        # Strided 3-D logits (e.g. logits[:, :-1] of a causal LM) are read in place, never copied.
        logits_row = logits_ptr + (row // seq_len) * stride_lb + (row % seq_len) * stride_lt
        grad_row = grad_ptr + row * stride_grad
        y = tl.load(target_ptr + row).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        n_blocks = (n_cols + BLOCK - 1) // BLOCK

        if y == ignore_index:
            tl.store(loss_ptr + row, 0.0)
            tl.store(lse_ptr + row, 0.0)
            if ROW_SUMS:
                tl.store(sum_ptr + row, 0.0)
            if COMPUTE_GRAD:
                zeros = tl.zeros([BLOCK], dtype=tl.float32).to(grad_ptr.dtype.element_ty)
                for b in range(0, n_blocks):
                    offs = b * BLOCK + cols
                    tl.store(grad_row + offs, zeros, mask=offs < n_cols, eviction_policy=GRAD_EVICTION)
        else:
            bad = (y < 0) | (y >= n_cols)
            y_safe = tl.where(bad, 0, y)
            x_y_raw = tl.load(logits_row + y_safe).to(tl.float32)
            x_y = _capped(x_y_raw, True, SOFTCAP)

            # Pass 1: online log-sum-exp; d_other leaves the target class out (see the docstring).
            m = -float("inf")
            d_other = 0.0
            x_sum = 0.0
            if NUM_STAGES > 1:
                # Triton's software pipeliner stages the loads (cp.async into shared memory).
                for b in tl.range(0, n_blocks, num_stages=NUM_STAGES):
                    offs = b * BLOCK + cols
                    mask = offs < n_cols
                    x = tl.load(logits_row + offs, mask=mask, other=-float("inf"), eviction_policy="evict_last")
                    m, d_other, x_sum = _lse_tile(
                        _capped(x.to(tl.float32), mask, SOFTCAP),
                        offs,
                        mask,
                        y_safe,
                        m,
                        d_other,
                        x_sum,
                        LABEL_SMOOTHING,
                        ROW_SUMS,
                    )
            else:
                # The next tile is loaded before this one is reduced (register prefetch; a masked-off load past
                # the end touches no memory) so its latency hides behind the reductions.
                x_next = tl.load(
                    logits_row + cols, mask=cols < n_cols, other=-float("inf"), eviction_policy="evict_last"
                )
                for b in range(0, n_blocks):
                    offs = b * BLOCK + cols
                    mask = offs < n_cols
                    x = x_next.to(tl.float32)
                    x_next = tl.load(
                        logits_row + offs + BLOCK,
                        mask=offs + BLOCK < n_cols,
                        other=-float("inf"),
                        eviction_policy="evict_last",
                    )
                    x = _capped(x, mask, SOFTCAP)
                    m, d_other, x_sum = _lse_tile(x, offs, mask, y_safe, m, d_other, x_sum, LABEL_SMOOTHING, ROW_SUMS)

            e_y = tl.exp2((x_y - m) * LOG2E)
            d = d_other + e_y
            lse = m + tl.log(d)
            # nll = lse - x_y = log1p(d_other / e_y), with log1p(u) = log(w) * u / (w - 1), w = 1 + u (exact
            # where w rounds to 1). Only needed when y is near the max; far below it lse - x_y is accurate.
            near = x_y - m > -20.0
            u = d_other / tl.where(near, e_y, 1.0)
            w = 1.0 + u
            log1p_u = tl.where(w == 1.0, u, tl.log(w) * (u / tl.where(w == 1.0, 1.0, w - 1.0)))
            nll = tl.where(near, log1p_u, lse - x_y)
            loss = (1.0 - LABEL_SMOOTHING) * nll
            if LABEL_SMOOTHING > 0.0:
                loss += LABEL_SMOOTHING * (lse - x_sum / n_cols)
            if Z_LOSS > 0.0:
                loss += Z_LOSS * lse * lse
            loss = tl.where(bad, float("nan"), loss)
            tl.store(loss_ptr + row, loss)
            tl.store(lse_ptr + row, lse)
            if ROW_SUMS:
                tl.store(sum_ptr + row, x_sum)

            if COMPUTE_GRAD:
                scale = 1.0
                if HAS_SCALE:
                    scale = tl.load(scale_ptr + row * scale_stride).to(tl.float32)
                scale = tl.where(bad, float("nan"), scale)
                inv_d = 1.0 / d
                coef = (1.0 + 2.0 * Z_LOSS * lse) * inv_d * scale  # multiplies exp(x_j - m)
                shift = (LABEL_SMOOTHING / n_cols) * scale
                # p_y * (1 + 2 z lse) - s/V - (1 - s), with p_y - 1 = -d_other / d kept exact.
                p_y = e_y * inv_d
                grad_y = (-d_other * inv_d + 2.0 * Z_LOSS * lse * p_y + LABEL_SMOOTHING * (1.0 - 1.0 / n_cols)) * scale
                if SOFTCAP > 0.0:  # to the raw logit's gradient: times tanh's derivative there
                    th_y = x_y / SOFTCAP
                    grad_y = grad_y * (1.0 - th_y * th_y)
                # Pass 2, tiles in reverse (the last tiles of pass 1 are the likeliest still in L2).
                if NUM_STAGES > 1:
                    for i in tl.range(0, n_blocks, num_stages=NUM_STAGES):
                        offs = (n_blocks - 1 - i) * BLOCK + cols
                        mask = offs < n_cols
                        x = tl.load(logits_row + offs, mask=mask, other=0.0, eviction_policy="evict_first")
                        _grad_tile(
                            grad_row,
                            x.to(tl.float32),
                            offs,
                            mask,
                            y_safe,
                            m,
                            coef,
                            shift,
                            grad_y,
                            GRAD_EVICTION,
                            SOFTCAP,
                        )
                else:
                    # Same register prefetch as pass 1; a tile index of -1 is fully masked.
                    last = (n_blocks - 1) * BLOCK + cols
                    x_next = tl.load(logits_row + last, mask=last < n_cols, other=0.0, eviction_policy="evict_first")
                    for i in range(0, n_blocks):
                        offs = (n_blocks - 1 - i) * BLOCK + cols
                        mask = offs < n_cols
                        x = x_next.to(tl.float32)
                        prev = offs - BLOCK
                        x_next = tl.load(logits_row + prev, mask=prev >= 0, other=0.0, eviction_policy="evict_first")
                        _grad_tile(grad_row, x, offs, mask, y_safe, m, coef, shift, grad_y, GRAD_EVICTION, SOFTCAP)

    @triton.jit
    def _cross_entropy_fwd_kernel(
        logits_ptr,  # (N, V) or (B, T, V) logits, fp32/bf16/fp16, unit stride over V, any leading strides
        grad_ptr,  # (N, V) gradient out in the logits' dtype (may be logits_ptr itself); unused without COMPUTE_GRAD
        target_ptr,  # (N,) contiguous int32/int64 class indices, N = B * T
        loss_ptr,  # (N,) fp32 per-row loss out
        lse_ptr,  # (N,) fp32 per-row log-sum-exp out (0 for ignored rows)
        sum_ptr,  # (N,) fp32 per-row sum of the (capped) logits out (0 for ignored rows); unused without ROW_SUMS
        scale_ptr,  # fp32 gradient scale: 0-d (scale_stride 0) or per row; unused without HAS_SCALE
        n_rows,
        n_cols,
        seq_len,  # T: row r of the flattened logits is (r // T, r % T); 1 for 2-D logits
        stride_lb,  # logits stride over B (over N for 2-D logits), elements
        stride_lt,  # logits stride over T (unused for 2-D logits), elements
        stride_grad,  # row stride of the contiguous grad (V), elements
        scale_stride,  # 0 for one scale for all rows, else the row stride of scale_ptr
        ignore_index,
        LABEL_SMOOTHING: tl.constexpr,
        Z_LOSS: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        COMPUTE_GRAD: tl.constexpr,
        BLOCK: tl.constexpr,
        GRAD_EVICTION: tl.constexpr,  # "" (no hint) or "evict_first" for the gradient stores
        NUM_STAGES: tl.constexpr,  # 1: register prefetch by hand; > 1: tl.range software pipelining
        PERSISTENT: tl.constexpr,  # False: one program per row; True: a fixed grid strides over the rows
        SOFTCAP: tl.constexpr,  # c > 0: the loss over c tanh(logits / c); 0.0: none
        ROW_SUMS: tl.constexpr,  # store each row's sum of its (capped) logits at sum_ptr
    ):
        pid = tl.program_id(0).to(tl.int64)
        if PERSISTENT:
            for row in range(pid, n_rows, tl.num_programs(0)):
                _cross_entropy_row(
                    row,
                    logits_ptr,
                    grad_ptr,
                    target_ptr,
                    loss_ptr,
                    lse_ptr,
                    sum_ptr,
                    scale_ptr,
                    n_cols,
                    seq_len,
                    stride_lb,
                    stride_lt,
                    stride_grad,
                    scale_stride,
                    ignore_index,
                    LABEL_SMOOTHING,
                    Z_LOSS,
                    HAS_SCALE,
                    COMPUTE_GRAD,
                    BLOCK,
                    GRAD_EVICTION,
                    NUM_STAGES,
                    SOFTCAP,
                    ROW_SUMS,
                )
        else:
            _cross_entropy_row(
                pid,
                logits_ptr,
                grad_ptr,
                target_ptr,
                loss_ptr,
                lse_ptr,
                sum_ptr,
                scale_ptr,
                n_cols,
                seq_len,
                stride_lb,
                stride_lt,
                stride_grad,
                scale_stride,
                ignore_index,
                LABEL_SMOOTHING,
                Z_LOSS,
                HAS_SCALE,
                COMPUTE_GRAD,
                BLOCK,
                GRAD_EVICTION,
                NUM_STAGES,
                SOFTCAP,
                ROW_SUMS,
            )

    @triton.jit
    def _cross_entropy_bwd_kernel(
        grad_ptr,  # (R, C) contiguous gradient stored by the forward (any float dtype)
        out_ptr,  # (R, C) contiguous output: grad * grad_output in its own dtype; may be grad_ptr (in place)
        g_ptr,  # grad_output: one value (PER_ROW False) or one per row at stride g_stride
        n_rows,
        n_cols,
        g_stride,  # row stride of grad_output (0 when it was expanded from a scalar)
        PER_ROW: tl.constexpr,
        IN_PLACE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # A fixed, small grid striding over the work: when an in-place scale is skipped (grad_output == 1)
        # the launch costs a few waves of programs that read one value, not one program per tile.
        pid = tl.program_id(0).to(tl.int64)  # int64 loop counters: offsets may pass 2^31
        n_progs = tl.num_programs(0)
        cols = tl.arange(0, BLOCK)
        if PER_ROW:
            for row in range(pid, n_rows, n_progs):
                g = tl.load(g_ptr + row * g_stride).to(tl.float32)
                if (g != 1.0) or (not IN_PLACE):
                    base = row * n_cols
                    for start in range(0, n_cols, BLOCK):
                        offs = start + cols
                        mask = offs < n_cols
                        v = tl.load(grad_ptr + base + offs, mask=mask).to(tl.float32)
                        tl.store(out_ptr + base + offs, (v * g).to(out_ptr.dtype.element_ty), mask=mask)
        else:
            g = tl.load(g_ptr).to(tl.float32)
            if (g != 1.0) or (not IN_PLACE):
                # flat: the launcher passes n_rows = 1 and n_cols = numel
                for tile in range(pid, tl.cdiv(n_cols, BLOCK), n_progs):
                    offs = tile * BLOCK + cols
                    mask = offs < n_cols
                    v = tl.load(grad_ptr + offs, mask=mask).to(tl.float32)
                    tl.store(out_ptr + offs, (v * g).to(out_ptr.dtype.element_ty), mask=mask)


# Forward-kernel variants, timed side by side by `bench/bench_cross_entropy.py --variant all`. "default" is the
# library's choice (BLOCK 8192 over 16 warps at most 64 registers: two 512-thread programs per SM), the fastest in the
# H200 run the module docstring cites, and the only one used unless `fwd_variant` says otherwise. The other four
# launch BLOCK 16384 over 32 warps with no register cap, the default before that run: evict, pipelined and persistent
# were measured on top of it, so they stay on it to keep meaning what was measured.
#   block16384  that launch alone: one 1024-thread program per SM
#   evict       the gradient stores carry an L2 evict_first policy, so they do not push the row that pass 2
#               re-reads out of L2 (PTX st.global.L1::evict_first.L2::cache_hint)
#   pipelined   plain loops under tl.range(num_stages=3), no hand-written register prefetch, for Triton's
#               pipeliner to stage the loads. Triton 3.9 leaves these loads alone for sm_90 (no ttg.async_copy in
#               the TTGIR, no cp.async in the PTX), so this measures whether the hand prefetch pays
#   persistent  one program per SM striding over the rows: no per-row program launch and retirement
FWD_VARIANTS = ("default", "block16384", "evict", "pipelined", "persistent")
_fwd_variant = "default"  # a module global (not thread-local) so torch.compile can guard on it


@contextlib.contextmanager
def fwd_variant(name: str):
    """Run the forward kernel launched inside as variant `name` (one of FWD_VARIANTS); for benchmarks and tests."""
    global _fwd_variant
    if name not in FWD_VARIANTS:
        raise ValueError(f"fwd_variant: {name!r} is not one of {', '.join(FWD_VARIANTS)}")
    previous = _fwd_variant
    _fwd_variant = name
    try:
        yield
    finally:
        _fwd_variant = previous


def _fwd_config(n_cols: int, on_cuda: bool, variant: str) -> tuple[int, int]:
    """(BLOCK, num_warps) for the forward kernel; see the module docstring for the reasoning."""
    if not on_cuda:
        return min(triton.next_power_of_2(n_cols), 8192), 4
    block = min(triton.next_power_of_2(n_cols), 8192 if variant == "default" else 16384)
    return block, max(4, min(32, block // 512))


def _fwd_grid(n_rows: int, device: torch.device, variant: str) -> int:
    """Programs to launch: one per row, or for "persistent" one per SM (4 under the interpreter, so tests
    cover programs that take several rows)."""
    if variant != "persistent":
        return n_rows
    programs = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return min(n_rows, programs)


def cross_entropy_fwd(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    compute_grad: bool = True,
    grad_scale: torch.Tensor | None = None,
    grad_out: torch.Tensor | None = None,
    loss_out: torch.Tensor | None = None,
    softcap: float | None = None,
    sums_out: torch.Tensor | None = None,
):
    """Launch the forward kernel on logits (N, V) or (B, T, V), any strides but unit stride over V,
    and targets of their leading shape; no autograd. With `softcap` c the loss (and lse) is over c tanh(logits / c)
    and the gradient the raw logits'. `sums_out` (fp32 (N,)) optionally receives each row's sum of its (capped)
    logits, 0 on ignored rows (the preference heads' mean logits; pass 1 adds it up as it reads the row).

    Returns (loss_rows fp32 (N,), lse fp32 (N,), grad (*lead, V) contiguous, or None). The gradient is that of the
    per-row losses (reduction "sum"), multiplied by `grad_scale` (fp32, 0-d or (N,)) when given. It is
    written to `grad_out` when given (the logits themselves for an in-place gradient), else to a fresh
    buffer in the logits' dtype. `loss_out` optionally receives the per-row losses.
    """
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n_cols = logits.shape[-1]
    n_rows = logits.numel() // n_cols if n_cols else 0
    if logits.dim() == 3:
        seq_len, stride_lb, stride_lt = logits.shape[1], logits.stride(0), logits.stride(1)
    else:
        seq_len, stride_lb, stride_lt = 1, logits.stride(0), 0
    target = target.reshape(-1).contiguous()  # (N,)
    loss_rows = loss_out if loss_out is not None else torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    grad = None
    if compute_grad:
        grad = grad_out if grad_out is not None else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if n_rows == 0:
        return loss_rows, lse, grad
    if grad_scale is not None:
        scale_stride = grad_scale.stride(0) if grad_scale.dim() == 1 else 0
    else:
        scale_stride = 0
    variant = _fwd_variant
    block, num_warps = _fwd_config(n_cols, logits.is_cuda, variant)
    _cross_entropy_fwd_kernel[(_fwd_grid(n_rows, logits.device, variant),)](
        logits,
        grad if grad is not None else logits,
        target,
        loss_rows,
        lse,
        sums_out if sums_out is not None else lse,
        grad_scale if grad_scale is not None else lse,
        n_rows,
        n_cols,
        seq_len,
        stride_lb,
        stride_lt,
        n_cols if grad is not None else 0,
        scale_stride,
        ignore_index,
        LABEL_SMOOTHING=float(label_smoothing),
        Z_LOSS=float(z_loss),
        HAS_SCALE=grad_scale is not None,
        COMPUTE_GRAD=grad is not None,
        BLOCK=block,
        GRAD_EVICTION="evict_first" if variant == "evict" else "",
        NUM_STAGES=3 if variant == "pipelined" else 1,
        PERSISTENT=variant == "persistent",
        SOFTCAP=float(softcap or 0.0),
        ROW_SUMS=sums_out is not None,
        num_warps=num_warps,
        # ptxas (sm_90, Triton 3.9's 12.9) gives the default's 16-warp program 79 registers at label smoothing 0.1 when
        # free to: one program per SM; capped at 64 (61 used, no spills), two fit. A softcapped row with label smoothing
        # spills 12 bytes under that cap, so softcapped launches are not capped (one program per SM; not yet timed).
        maxnreg=64 if variant == "default" and not softcap else None,
    )
    return loss_rows, lse, grad


def cross_entropy_bwd(grad: torch.Tensor, grad_output: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """grad * grad_output (0-d, or one value per row: per (..., V) slice) into `out` (default: grad, in place).

    In place, the work is skipped on the device where grad_output is exactly 1; never syncs with the host.
    `out` (contiguous, any float dtype) lets a caller keep an fp32 gradient and round it once, here.
    """
    out = grad if out is None else out
    if grad.numel() == 0:
        return out
    per_row = grad_output.dim() > 0
    if per_row:
        n_cols = grad.shape[-1]
        n_rows = grad.numel() // n_cols
        g = grad_output.reshape(-1)
        g_stride = g.stride(0)
        n_tiles = n_rows
    else:
        n_rows, n_cols = 1, grad.numel()
        g = grad_output
        g_stride = 0
    # GPU: 4096-element tiles over 8 warps, at most 1024 programs (~8 per SM on an H100). The interpreter
    # pays per program and per op: a few programs with big tiles.
    block = 4096 if grad.is_cuda else 1 << 18
    if per_row:
        block = min(block, triton.next_power_of_2(n_cols))
    else:
        n_tiles = triton.cdiv(n_cols, block)
    grid = (max(1, min(n_tiles, 1024 if grad.is_cuda else 4)),)
    _cross_entropy_bwd_kernel[grid](
        grad,
        out,
        g,
        n_rows,
        n_cols,
        g_stride,
        PER_ROW=per_row,
        IN_PLACE=out is grad,
        BLOCK=block,
        num_warps=8 if grad.is_cuda else 4,
    )
    return out


def _scale_saved_(grad: torch.Tensor, grad_output: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """grad * grad_output for a gradient the forward saved, as `dtype` (default grad's).

    Same dtype: in place on the device (eager) and the saved tensor's version is bumped; another dtype:
    one rounding into a fresh buffer. Under torch.compile, out of place and left to the compiler.
    """
    dtype = grad.dtype if dtype is None else dtype
    if torch.compiler.is_compiling():
        g = grad_output.reshape(*grad.shape[:-1], 1) if grad_output.dim() > 0 else grad_output
        return (grad * g.to(grad.dtype)).to(dtype)
    if dtype != grad.dtype:
        return cross_entropy_bwd(grad, grad_output, out=torch.empty(grad.shape, dtype=dtype, device=grad.device))
    cross_entropy_bwd(grad, grad_output)
    # The saved tensor changed under autograd's feet: a second backward through a retained graph must
    # fail loudly instead of scaling twice.
    torch.autograd.graph.increment_version(grad)
    return grad


def _check_args(name, logits_or_hidden, target, label_smoothing, ignore_index, reduction, z_loss, num_items):
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{name}: reduction={reduction!r} is not one of {', '.join(map(repr, _REDUCTIONS))}")
    if (
        not isinstance(label_smoothing, (int, float))
        or isinstance(label_smoothing, bool)
        or not 0.0 <= label_smoothing <= 1.0
    ):
        raise ValueError(f"{name}: label_smoothing={label_smoothing!r} must be a float in [0, 1]")
    if not isinstance(z_loss, (int, float)) or isinstance(z_loss, bool) or z_loss < 0.0:
        raise ValueError(f"{name}: z_loss={z_loss!r} must be a float >= 0")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise ValueError(f"{name}: ignore_index={ignore_index!r} must be an int")
    if target.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: target dtype {target.dtype} must be torch.int64 or torch.int32")
    if not logits_or_hidden.dtype.is_floating_point:
        raise ValueError(f"{name}: inputs must be floating point, got {logits_or_hidden.dtype}")
    if num_items is not None:
        if reduction != "mean":
            raise ValueError(f"{name}: num_items is only valid with reduction='mean', got reduction={reduction!r}")
        if isinstance(num_items, torch.Tensor):
            if num_items.numel() != 1:
                raise ValueError(
                    f"{name}: num_items must be an int or a one-element tensor, got shape {tuple(num_items.shape)}"
                )
        elif not isinstance(num_items, int) or isinstance(num_items, bool) or num_items <= 0:
            raise ValueError(f"{name}: num_items={num_items!r} must be a positive int or a one-element tensor")


def check_softcap(name: str, softcap) -> None:
    """softcap is None (no capping) or a number > 0, else a one-line ValueError."""
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0):
        raise ValueError(f"{name}: softcap={softcap!r} must be None or a number > 0")


def softcapped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """c tanh(logits / c) in the logits' dtype (transformers' Gemma 2 order: divide, tanh, multiply), or the logits
    themselves without a cap: what the references compute."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def _denominator(target: torch.Tensor, ignore_index: int, reduction: str, num_items, device) -> torch.Tensor | None:
    """fp32 0-d device tensor dividing the summed loss (None for "sum"/"none"); never syncs with the host."""
    if reduction != "mean":
        return None
    if num_items is None:
        # clamp to 1: an all-ignored batch has loss 0 and gradient 0, not 0/0.
        return (target != ignore_index).sum().clamp(min=1).to(torch.float32)
    if isinstance(num_items, torch.Tensor):
        return num_items.reshape(()).to(device=device, dtype=torch.float32)
    return torch.full((), float(num_items), dtype=torch.float32, device=device)


def _reduce(loss_rows: torch.Tensor, reduction: str, denom: torch.Tensor | None) -> torch.Tensor:
    if reduction == "none":
        return loss_rows
    total = loss_rows.sum()
    return total / denom if denom is not None else total


class CrossEntropyFunction(torch.autograd.Function):
    """Autograd wrapper: the forward kernel writes the gradient; backward scales it by grad_output."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, ignore_index, reduction, z_loss, num_items, out_dtype, softcap):
        denom = _denominator(target, ignore_index, reduction, num_items, logits.device)
        loss_rows, _, grad = cross_entropy_fwd(
            logits,
            target,
            label_smoothing=label_smoothing,
            ignore_index=ignore_index,
            z_loss=z_loss,
            compute_grad=ctx.needs_input_grad[0],
            grad_scale=denom.reciprocal() if denom is not None else None,
            softcap=softcap,
        )
        if grad is not None:
            ctx.save_for_backward(grad)
        return _reduce(loss_rows, reduction, denom).to(out_dtype)

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return _scale_saved_(grad, grad_output), None, None, None, None, None, None, None, None


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    z_loss: float = 0.0,
    num_items: int | torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Cross-entropy of logits (N, V) or (B, T, V) against class indices (N,) or (B, T).

    Semantics of `torch.nn.functional.cross_entropy` with the class dimension last, plus `z_loss`
    (adds z_loss * logsumexp^2 per non-ignored row), `num_items` (reduction="mean" only: divide the
    summed loss by num_items instead of the number of non-ignored rows) and `softcap` (the loss over
    softcap * tanh(logits / softcap), Gemma 2's final logit softcapping). An all-ignored batch gives 0.
    Returns a 0-d tensor ("mean"/"sum") or the per-row losses shaped like target ("none"), in the
    logits' dtype.
    """
    _check_args("cross_entropy", logits, target, label_smoothing, ignore_index, reduction, z_loss, num_items)
    check_softcap("cross_entropy", softcap)
    if logits.dim() not in (2, 3) or tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"cross_entropy: logits must be (N, V) or (B, T, V) and target its leading shape; "
            f"got logits {tuple(logits.shape)}, target {tuple(target.shape)}"
        )
    if not use_triton(logits, target):
        return cross_entropy_ref(
            logits,
            target,
            label_smoothing=label_smoothing,
            ignore_index=ignore_index,
            reduction=reduction,
            z_loss=z_loss,
            num_items=num_items,
            softcap=softcap,
        )
    # Not flattened here: reshaping strided 3-D logits (logits[:, :-1]) would copy them; the kernel
    # takes their strides instead.
    # F.cross_entropy runs in fp32 under autocast and returns an fp32 loss; the kernel computes in fp32
    # anyway, so only the loss's dtype changes (the gradient keeps the logits' dtype).
    out_dtype = torch.float32 if torch.is_autocast_enabled(logits.device.type) else logits.dtype
    if torch.is_grad_enabled() and logits.requires_grad:
        loss = CrossEntropyFunction.apply(
            logits,
            target,
            float(label_smoothing),
            ignore_index,
            reduction,
            float(z_loss),
            num_items,
            out_dtype,
            softcap,
        )
    else:
        denom = _denominator(target, ignore_index, reduction, num_items, logits.device)
        loss_rows, _, _ = cross_entropy_fwd(
            logits,
            target,
            label_smoothing=label_smoothing,
            ignore_index=ignore_index,
            z_loss=z_loss,
            compute_grad=False,
            softcap=softcap,
        )
        loss = _reduce(loss_rows, reduction, denom).to(out_dtype)
    return loss.reshape(target.shape) if reduction == "none" else loss


def cross_entropy_ref(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    z_loss: float = 0.0,
    num_items: int | torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Plain PyTorch reference (fp32 math, result in the logits' dtype, fp32 under autocast); differentiable."""
    out_dtype = torch.float32 if torch.is_autocast_enabled(logits.device.type) else logits.dtype
    x = softcapped(logits.float(), softcap).reshape(-1, logits.shape[-1])  # (N, V)
    t = target.reshape(-1)  # (N,)
    valid = t != ignore_index
    t_safe = torch.where(valid, t, torch.zeros_like(t))
    lse = torch.logsumexp(x, dim=-1)  # (N,)
    nll = lse - x.gather(1, t_safe.unsqueeze(1).long()).squeeze(1)
    loss = (1.0 - label_smoothing) * nll
    if label_smoothing > 0.0:
        loss = loss + label_smoothing * (lse - x.mean(dim=-1))
    if z_loss > 0.0:
        loss = loss + z_loss * lse * lse
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss.reshape(target.shape).to(out_dtype)
    total = loss.sum()
    if reduction == "sum":
        return total.to(out_dtype)
    denom = _denominator(t, ignore_index, "mean", num_items, logits.device)
    return (total / denom).to(out_dtype)
