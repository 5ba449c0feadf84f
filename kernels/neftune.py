"""NEFTune: uniform noise added to the token embeddings during fine-tuning (Jain et al., 2023,
"NEFTune: Noisy Embeddings Improve Instruction Finetuning", arXiv:2310.05914).

Math
----
Forward, for embeddings x of shape (B, T, d) and a noise scale alpha >= 0:

    y[b, t, :] = x[b, t, :] + u[b, t, :] * alpha / sqrt(L[b, t] * d),    u ~ U(-1, 1) i.i.d.

where L is the length of the sequence the token belongs to:
- no attention_mask, no position_ids: L = T for every token (Hugging Face semantics:
  `dims = embeds.size(1) * embeds.size(2)`, `mag_norm = alpha / sqrt(dims)`);
- attention_mask (B, T), nonzero = real token: L[b, :] = sum(attention_mask[b]) and padded tokens get no
  noise at all. Hugging Face's hook uses the padded length T for every row and also noises the padding,
  so a short sequence in a long padded batch gets less noise than the paper intends (its magnitude
  depends on what else is in the batch); here it depends only on the sequence itself;
- position_ids (B, T) for packed rows: a document starts where the position does not continue the
  previous one (normally where it restarts at 0, and at t = 0); L is that document's number of real
  tokens (all its tokens, or those with a nonzero mask when attention_mask is given too).
With training=False, or alpha == 0, y = x (the same tensor object is returned).

Backward: the noise is additive and independent of x, so dL/dx = dL/dy (identity). The autograd
Function saves nothing, in particular no noise tensor.

The noise is drawn and added in fp32 and rounded once to x's dtype (Hugging Face draws it in x's dtype,
so a bf16 noise value is already rounded before the bf16 add rounds again).

Random numbers
--------------
The Triton kernel draws its noise with Philox4x32-10 (Triton's `tl.randint4x`: one call of 10 rounds gives four
32-bit words; Salmon et al., SC 2011, "Parallel random numbers: as easy as 1, 2, 3") from a 62-bit seed. The seed is
one `torch.randint` draw from `generator` (or from the default generator of embeds' device when None), kept on the
device and loaded by the kernel, so a CUDA generator costs no host sync (and CUDA-graph capture treats it like any
other torch RNG op). A CPU generator with CUDA embeds copies its 8-byte seed host->device (non_blocking: no wait for
the GPU queue, but a pageable copy may block the host briefly); keep the generator on the embeddings' device in the
hot path. Under torch.compile pass generator=None (dynamo cannot trace a torch.Generator argument; the seed then
comes from the global RNG, which compiled code handles).

The noise at (row, col) is a function of (seed, row, col, d) only, never of the block sizes or the grid. Row r's
columns are cut into groups of P consecutive columns, P = 8 for bf16/fp16 and 4 for fp32; group g is Philox counter
r * ceil(d / P) + g (the key is the seed), and its four words w = 0..3 give the group's P values:
- fp32: column 4g + w takes the top 24 bits k of word w: u = k * 2^-23 - 1, the 2^24 equally spaced values of
  [-1, 1), the same grid as the reference's 2 * torch.rand - 1 (torch's fp32 uniforms are 24-bit);
- bf16/fp16: column 8g + 2w + h takes 16-bit half h of word w (h = 0 the low half): u = k * 2^-15 - 1, 2^16 values.
  Sixteen bits change the rounded result's distribution by a bound, not a guess: the grid value is u floored to a
  step of 2^-15, rounding is monotone, so for any x the distributions of round(x + mag * u16) and of
  round(x + mag * u) with a continuous u differ by at most one grid cell's probability, 2^-16, in P(y <= t) for
  every t (Kolmogorov distance <= 2^-16) and in the probability of any single rounded value. Against the output
  dtype: the step mag * 2^-15 is under 1/128 of a bf16 ulp (1/16 of an fp16 ulp) wherever |x + noise| >= mag.
Both grids start at -1 like torch's (E[u] = -2^-16 and -2^-24 instead of 0, as E[2 * torch.rand - 1] = -2^-24).
So one Philox call serves eight bf16/fp16 elements (four fp32 ones), loaded and stored as one contiguous 16-byte
access per thread. Distinct (row, group) pairs are distinct counters, so no call is reused; the words of a call and
their halves are separate Philox outputs (Salmon et al. report Philox4x32-10 passing TestU01's BigCrush on its 32-bit
outputs; tests/kernels/test_neftune.py checks halves and words for correlation and their joint histogram). Ten rounds
are Triton's default and what Random123, cuRAND and torch use: 7 already pass BigCrush, and Salmon et al. chose 10 as
the default for a safety margin, so the kernel keeps 10 (7 would cut its bf16 count below from 15.0 to 12.5
instructions per element).

What it costs (SASS instructions per element, compiled for sm_90 on a CPU by `python -m bench.sm90 --only neftune
--sass`: instructions of one program / 32 elements per thread; a count, not a GPU time), at 8 x 4096 x 4096:

    dtype             before (df5b252, as the H200 ran it)   now
    bf16              28.9                                   15.0
    bf16 with a mask  29.2                                   15.2
    fp16              28.4                                   14.5
    fp32              27.9                                   21.8
    bf16, int64       28.9 (always int64)                    15.2   (17 x 8192 x 16384: past 2^31 elements)

Before, every element paid a quarter of a Philox call (four 32-bit words per call, one per element) plus a sign fold
and an int-to-float conversion of its word, two multiplies, an FMA and an add, int64 counters and addresses, and the
program a shared-memory layout change (8 KB, 7 barriers) before each of its four stores. Now: an eighth of a call in
bf16/fp16 (Philox: ~7.5 per element, ~6 instructions per round per call), a one-instruction bit placement per half,
a subtract and one FMA (x + u * mag); int32 counters and offsets unless the tensor needs 64 bits (`WIDE`: the same
counters, so the same noise); no shared memory. Bytes are unchanged.

The reference `neftune_noise_ref` draws with `torch.rand`: same semantics and distribution, different
random numbers from the kernel's.

Bytes moved per element (s = element size): read x (s) + write y (s) = 2s. Plus, with a mask or
position ids, a (B*T,) fp32 row-scale vector (4/d bytes per element up to d = 4096) computed beforehand by a few
small PyTorch ops over (B, T); without them the scale is a kernel argument. Hugging Face's hook
`x + torch.zeros_like(x).uniform_(-mag, mag)` moves 5s per element (zeros: write s; uniform_: write s;
add: read 2s, write s) in three launches.

Launch strategy
---------------
2-D grid over (row blocks, column blocks): each program takes BLOCK_R rows x BLOCK_C columns (BLOCK_C = P x a power
of two >= ceil(d / P), capped at 4096; a tile of 8192 elements, 8 warps, 32 elements per thread), so for d <= 4096
one program covers whole rows (d = 4096: BLOCK_R = 2). Rows, counters and offsets are int32 when every value the
grid computes stays below 2^31, else int64 (`WIDE`), so tensors past 2^31 elements work. Eager calls the launcher
directly; under torch.compile it goes through the
`torch.ops.kernelwright.neftune_fwd` custom op, so fullgraph tracing takes it whole (one opaque call that
launches the kernel). Not a `torch.library.triton_op`: declaring one imports torch._inductor, about 3 s of every
`import kernels` on a CPU, for an op whose launch is all the compiled graph would see of it anyway.

Test: `python -m pytest tests/kernels/test_neftune.py -q` (CPU: Triton interpreter and reference).
Bench: `python bench/bench_neftune.py` on a GPU (`--quick` on a CPU only checks that it runs).
"""

from __future__ import annotations

import math
import numbers

import torch

from ._dispatch import HAS_TRITON, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _neftune_fwd_kernel(
        X_ptr,  # (N, d) embeddings (fp32/bf16/fp16), unit column stride, row stride stride_x
        OUT_ptr,  # (N, d) output, same dtype as X, row stride stride_out
        ROW_SCALE_ptr,  # (N,) fp32 per-row alpha / sqrt(L * d), 0 on padding; read only if HAS_ROW_SCALE
        SEED_ptr,  # (1,) int64 Philox seed drawn from the torch generator
        scale,  # fp32 magnitude of every row when not HAS_ROW_SCALE
        n_rows,
        n_cols,
        n_groups,  # Philox calls per row: ceil(n_cols / 8) with HALVES, ceil(n_cols / 4) without
        stride_x,
        stride_out,
        bits_256,  # 0x43800000, the bits of 256.0f (see below)
        HAS_ROW_SCALE: tl.constexpr,
        HALVES: tl.constexpr,  # eight 16-bit uniforms per Philox call (bf16/fp16), else four 24-bit ones (fp32)
        WIDE: tl.constexpr,  # int64 rows, counters and offsets (past 2^31); int32 otherwise, same values
        BLOCK_R: tl.constexpr,
        BLOCK_G: tl.constexpr,  # Philox calls per row per program: BLOCK_G * (8 or 4) columns
    ):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
        groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)  # (BLOCK_G,)
        if WIDE:
            rows = rows.to(tl.int64)
        # One Philox call per (row, group of columns): a function of (seed, row, col, d), not of the blocks.
        counter = rows[:, None] * n_groups + groups[None, :]  # (BLOCK_R, BLOCK_G)
        r0, r1, r2, r3 = tl.randint4x(tl.load(SEED_ptr), counter)  # (BLOCK_R, BLOCK_G) uint32 each
        # [..., i, k] = word 2i + k: flattened, word w of group g sits at 4g + w (all in one thread's registers)
        words = tl.join(tl.join(r0, r2), tl.join(r1, r3))  # (BLOCK_R, BLOCK_G, 2, 2)
        if HALVES:
            # Each 16-bit half h as the float 256 + h * 2^-15 (exponent of 256, h in the low mantissa bits), so
            # u = that - 257 = h * 2^-15 - 1 exactly. The low half's mask and or take one LOP3 when 256.0f's bits
            # come in a register (bits_256); with a literal ptxas emits two (494 against 479 SASS instructions).
            lo = (words & 0xFFFF) | bits_256
            hi = (words >> 16) | 0x43800000  # one LEA.HI
            f = tl.join(lo, hi).to(tl.float32, bitcast=True)  # (BLOCK_R, BLOCK_G, 2, 2, 2): column 8g + 2w + h
            u = tl.reshape(f, (BLOCK_R, BLOCK_G * 8)) - 257.0  # (BLOCK_R, BLOCK_C)
            BLOCK_C: tl.constexpr = BLOCK_G * 8
        else:
            # The word's top 24 bits r: u = r * 2^-23 - 1 exactly (r converts to fp32 without rounding).
            r24 = tl.reshape(words >> 8, (BLOCK_R, BLOCK_G * 4)).to(tl.float32)  # column 4g + w
            u = tl.fma(r24, 1.1920928955078125e-07, -1.0)  # (BLOCK_R, BLOCK_C)
            BLOCK_C: tl.constexpr = BLOCK_G * 4
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # (BLOCK_C,)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        if HAS_ROW_SCALE:
            mag = tl.load(ROW_SCALE_ptr + rows, mask=row_ok, other=0.0)[:, None]  # (BLOCK_R, 1)
        else:
            mag = scale
        # fp32 right after the load: the interpreter's bf16 arithmetic is wrong and the GPU wants fp32 anyway
        x = tl.load(X_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.fma(u, mag, x)  # x + u * mag rounded once in fp32; |u * mag| <= mag
        tl.store(OUT_ptr + rows[:, None] * stride_out + cols[None, :], y.to(OUT_ptr.dtype.element_ty), mask=mask)


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TILE = 8192  # elements per program (BLOCK_R rows x BLOCK_C columns): 32 per thread at 8 warps
_MAX_COLS = 4096  # columns per program at most


def neftune_fwd(
    x: torch.Tensor,
    seed: torch.Tensor,
    scale: float,
    row_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    wide: bool | None = None,
) -> torch.Tensor:
    """Launch the kernel: x + U(-1, 1) * magnitude, magnitude = row_scale[row] if given else scale.

    x: (..., d) fp32/bf16/fp16; seed: int64 tensor with one element on x's device; row_scale: (prod(...),)
    fp32 on x's device; out: optional contiguous buffer of x's shape and dtype; wide: int64 counters and offsets
    (default: when 32 bits would not hold them; forcing it on changes no value). Returns y of x's shape.
    """
    if not HAS_TRITON:
        raise RuntimeError("neftune_fwd needs triton (pip install triton); neftune_noise_ref runs without it")
    d = x.shape[-1]
    x2 = x.reshape(-1, d)  # (N, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n_rows = x2.shape[0]
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"neftune_fwd: out must be a contiguous {x.dtype} tensor of shape {tuple(x.shape)}")
    if x.numel() == 0:
        return out
    out2 = out.view(n_rows, d)  # (N, d)
    if seed.numel() != 1 or seed.dtype != torch.int64:
        raise ValueError("neftune_fwd: seed must be an int64 tensor with one element")
    has_row_scale = row_scale is not None
    if has_row_scale:
        if row_scale.shape != (n_rows,) or row_scale.dtype != torch.float32:
            raise ValueError(f"neftune_fwd: row_scale must be a float32 tensor of shape ({n_rows},)")
        row_scale = row_scale.contiguous()
    # Blocks depend on d and the dtype only; 64-bit arithmetic on the tensor's extent.
    halves = x.element_size() == 2
    per = 8 if halves else 4  # noise values per Philox call
    n_groups = triton.cdiv(int(d), per)
    block_c = min(triton.next_power_of_2(n_groups) * per, _MAX_COLS)
    block_r = _TILE // block_c
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(n_groups * per, block_c))
    if wide is None:
        # every counter and offset the grid computes, masked lanes included, below 2^31
        reach = grid[0] * block_r * max(x2.stride(0), out2.stride(0), grid[1] * block_c)
        wide = reach >= 2**31
    torch.library.wrap_triton(_neftune_fwd_kernel)[grid](
        x2,
        out2,
        row_scale if has_row_scale else x2,  # never read without HAS_ROW_SCALE; any pointer will do
        seed,
        float(scale),
        n_rows,
        d,
        n_groups,
        x2.stride(0),
        out2.stride(0),
        0x43800000,  # bits_256
        HAS_ROW_SCALE=has_row_scale,
        HALVES=halves,
        WIDE=bool(wide),
        BLOCK_R=block_r,
        BLOCK_G=block_c // per,
        num_warps=8,
    )
    return out


# One op namespace for the project: csrc/ops.cpp defines `kernelwright` with TORCH_LIBRARY, and this Python fragment
# joins it (checked: loading the C++ library after this registration keeps both ops).
@torch.library.custom_op("kernelwright::neftune_fwd", mutates_args=())
def _neftune_fwd_op(x: torch.Tensor, seed: torch.Tensor, scale: float, row_scale: torch.Tensor | None) -> torch.Tensor:
    return neftune_fwd(x, seed, scale, row_scale)


@_neftune_fwd_op.register_fake
def _(x, seed, scale, row_scale):
    # Explicit rather than traced from the body: under the Triton interpreter (CPU tests) wrap_triton runs
    # the kernel even on fake tensors, so only an explicit fake lets torch.library.opcheck run there.
    return torch.empty_like(x, memory_format=torch.contiguous_format)


class NEFTuneFunction(torch.autograd.Function):
    """y = x + noise with an identity backward; nothing is saved for backward."""

    @staticmethod
    def forward(ctx, embeds, seed, scale, row_scale):
        if torch.compiler.is_compiling():
            return torch.ops.kernelwright.neftune_fwd(embeds, seed, scale, row_scale)
        # Eager skips the custom-op dispatcher: it is pure host overhead here.
        return neftune_fwd(embeds, seed, scale, row_scale)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, None, None, None


def _check_args(embeds, alpha, attention_mask, generator, position_ids, training, name):
    if not isinstance(embeds, torch.Tensor) or embeds.dim() != 3 or embeds.dtype not in _DTYPES:
        got = (
            f"shape {tuple(embeds.shape)} {embeds.dtype}" if isinstance(embeds, torch.Tensor) else type(embeds).__name__
        )
        raise ValueError(f"{name}: embeds must be a (batch, seq, hidden) float32/bfloat16/float16 tensor, got {got}")
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not math.isfinite(alpha) or alpha < 0:
        raise ValueError(f"{name}: alpha must be a finite number >= 0 (0 disables the noise), got {alpha!r}")
    bt = tuple(embeds.shape[:2])
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != bt:
            got = (
                tuple(attention_mask.shape)
                if isinstance(attention_mask, torch.Tensor)
                else type(attention_mask).__name__
            )
            raise ValueError(f"{name}: attention_mask must be a (batch, seq) = {bt} tensor, got {got}")
        if attention_mask.device != embeds.device:
            raise ValueError(f"{name}: attention_mask is on {attention_mask.device}, embeds on {embeds.device}")
    if position_ids is not None:
        ok = isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 and position_ids.shape[1] == bt[1]
        if not ok or position_ids.shape[0] not in (1, bt[0]) or position_ids.dtype.is_floating_point:
            got = (
                f"{tuple(position_ids.shape)} {position_ids.dtype}"
                if isinstance(position_ids, torch.Tensor)
                else type(position_ids).__name__
            )
            raise ValueError(f"{name}: position_ids must be an integer (batch or 1, seq) = {bt} tensor, got {got}")
        if position_ids.device != embeds.device:
            raise ValueError(f"{name}: position_ids is on {position_ids.device}, embeds on {embeds.device}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"{name}: generator must be a torch.Generator or None, got {type(generator).__name__}")
    if not isinstance(training, bool):
        raise ValueError(f"{name}: training must be True or False, got {training!r}")


def _row_scale(shape, alpha: float, attention_mask, position_ids) -> torch.Tensor | None:
    """Per-token alpha / sqrt(L * d), 0 on padding, as a (B*T,) fp32 tensor; None when L = T for all.

    Only device ops over (B, T): no host sync, traceable by torch.compile.
    """
    if attention_mask is None and position_ids is None:
        return None
    B, T, d = shape
    device = attention_mask.device if attention_mask is not None else position_ids.device
    real = attention_mask != 0 if attention_mask is not None else None  # (B, T) bool
    weight = real.float() if real is not None else torch.ones((B, T), device=device)  # (B, T)
    if position_ids is None:
        length = weight.sum(dim=1, keepdim=True).expand(B, T)  # (B, T)
    else:
        pos = position_ids.expand(B, T)  # (B, T)
        first = torch.ones((B, 1), dtype=torch.bool, device=device)  # (B, 1)
        starts = torch.cat([first, pos[:, 1:] != pos[:, :-1] + 1], dim=1)  # (B, T)
        # Global document id per token, < B*T: per-row running count of starts, offset by the row.
        doc = torch.cumsum(starts, dim=1) - 1 + torch.arange(B, device=device)[:, None] * T  # (B, T) int64
        counts = torch.zeros(B * T, device=device).scatter_add(0, doc.reshape(-1), weight.reshape(-1))  # (B*T,)
        length = counts[doc]  # (B, T)
    scale = alpha * torch.rsqrt(length.clamp_min(1.0) * d)  # (B, T); padding's clamp only avoids inf
    if real is not None:
        scale = torch.where(real, scale, torch.zeros_like(scale))
    return scale.reshape(-1)  # (B*T,)


def _draw_seed(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    # Drawn where the generator lives: no host sync for a generator on the embeddings' device.
    where = generator.device if generator is not None else device
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=where, generator=generator)  # (1,)
    return seed.to(device, non_blocking=True)


def neftune_noise(embeds, alpha, attention_mask=None, generator=None, position_ids=None, training=True):
    """embeds + U(-1, 1) * alpha / sqrt(L * d) in training, embeds unchanged otherwise (see module docstring).

    embeds: (B, T, d) fp32/bf16/fp16; alpha: number >= 0; attention_mask: (B, T), nonzero = real token;
    generator: torch.Generator or None (the device's default generator); position_ids: (B, T) or (1, T)
    integer positions restarting for each packed document; training: False disables the noise.
    Output dtype = embeds dtype; the gradient w.r.t. embeds is the identity.
    """
    _check_args(embeds, alpha, attention_mask, generator, position_ids, training, "neftune_noise")
    if not training or alpha == 0 or embeds.numel() == 0:
        return embeds
    if not use_triton(embeds, attention_mask, position_ids):
        return neftune_noise_ref(embeds, alpha, attention_mask, generator, position_ids, training)
    B, T, d = embeds.shape
    seed = _draw_seed(generator, embeds.device)  # (1,) int64
    row_scale = _row_scale(embeds.shape, float(alpha), attention_mask, position_ids)  # (B*T,) or None
    return NEFTuneFunction.apply(embeds, seed, float(alpha) / math.sqrt(T * d), row_scale)


def neftune_noise_ref(embeds, alpha, attention_mask=None, generator=None, position_ids=None, training=True):
    """Plain-PyTorch NEFTune with the same semantics as `neftune_noise`, noise from `torch.rand` (fp32)."""
    _check_args(embeds, alpha, attention_mask, generator, position_ids, training, "neftune_noise_ref")
    if not training or alpha == 0 or embeds.numel() == 0:
        return embeds
    B, T, d = embeds.shape
    row_scale = _row_scale(embeds.shape, float(alpha), attention_mask, position_ids)  # (B*T,) or None
    mag = float(alpha) / math.sqrt(T * d) if row_scale is None else row_scale.view(B, T, 1)
    where = generator.device if generator is not None else embeds.device
    u = torch.rand(embeds.shape, generator=generator, device=where).to(embeds.device)  # (B, T, d) fp32 in [0, 1)
    return (embeds.float() + (2.0 * u - 1.0) * mag).to(embeds.dtype)
