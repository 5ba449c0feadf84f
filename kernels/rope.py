"""RoPE: rotate q and k by their positions' angles (Hugging Face's rotate-half convention), q and k in one launch.

Math (one head row x of width D, halves x1 = x[:D/2], x2 = x[D/2:]; c1, c2, s1, s2 the halves of that
(batch, position)'s cos and sin rows; all arithmetic in fp32, one rounding: the final cast to x's dtype)
    forward   o1 = x1 c1 - x2 s1        o2 = x2 c2 + x1 s2
              which is transformers' `apply_rotary_pos_emb`: x * cos + rotate_half(x) * sin, rotate_half(x) =
              cat(-x2, x1). The rotary module gives cos = cat(cos f, cos f) (c1 = c2, s1 = s2), but nothing
              here assumes it: both halves are read, so any (cos, sin) rows give transformers' result.
    backward  (the transpose of that linear map, applied to the output gradient g)
              dx1 = g1 c1 + g2 s2       dx2 = g2 c2 - g1 s1
              i.e. the forward with (s1, s2) -> (-s2, -s1): one kernel, BACKWARD a constexpr.
    cos and sin take no gradient: the rotary module computes them from integer positions and fixed frequencies,
    so nothing upstream of them trains. `rope` refuses cos/sin that require grad rather than returning a
    silently missing gradient.

Shapes (those of transformers' apply_rotary_pos_emb with unsqueeze_dim=1): q (B, Hq, T, D), k (B, Hkv, T, D), any
head counts (GQA: Hq a multiple of Hkv or not, the rotation does not care), any T, any even D; cos and sin
(Bc, T, D) with Bc = B or 1 (one row of angles shared by the whole batch), in any float dtype (the model's are fp32).

Layout. Every input may have any strides (no `.contiguous()` copy: a copy would double the bytes). Our model holds
q and k as (B, T, H, D) views of the q_proj/k_proj outputs and passes their (B, H, T, D) transposes. Every output
(q_rot, k_rot, and in the backward dq, dk) is written as (B, T, H, D)-contiguous memory and returned as its
(B, H, T, D) view, because that is the memory every consumer reads without a copy: flash-attn (ours and
transformers') takes (tokens, H, D) rows, so `reshape(B * T, H, D)` is free; SDPA takes the (B, H, T, D) view of
it, with a unit last stride; our KV cache writes (B, T, Hkv, D) slices; and in the backward, dq in that memory
is exactly the (B*T, H*D) gradient q_proj's matmul wants. It is also the layout q_proj already produces, so a
(b, t) row of all heads is one contiguous run of H*D elements read and written once.

Bytes moved (s = element size of q and k, c = element size of cos/sin; per launch, forward and backward alike):
    read q, k once and write q_rot, k_rot once: 2 (Hq + Hkv) B T D s
    cos and sin once per (cos row, position):   2 Bc T D c     (not once per head: a program loads its positions'
                                                               cos/sin rows once and rotates every head with them)
That is the minimum DRAM traffic. On the interpreter (the launcher's CPU choice below) it is also what the kernel
issues: bench/traffic.py counts it exactly (issued = distinct, forward and backward:
tests/kernels/test_rope.py::test_measured_bytes_are_the_minimum). On CUDA a batch-shared cos/sin row is issued once
per batch, by programs that run side by side, so the repeats are L2 hits and DRAM still sees it once (modelled so by
bench/bench_rope.py and the roofline; a GPU's counters have not checked it). At Llama-3-8B's heads (Hq 32, Hkv 8,
D 128) with bf16 q/k and fp32 cos/sin, cos and sin are 2 * 4 / (2 * 40 * 2) = 5% of the bytes with per-row angles
(Bc = B: packed rows) and 5% / B with the model's default (1, T, D); liger-kernel reads only their first halves
(it assumes c1 = c2), which would save half of that at the cost of transformers' general semantics.

Launch strategy
    A 1-D grid of (position block, batch group) programs, the batch groups of one position block adjacent. A program
    owns BLOCK_T positions: it loads their cos/sin rows (BLOCK_T, D/2) x 4 halves in fp32 once, then for each batch
    of its group rotates q's heads in tiles of (BLOCK_T, BLOCK_HQ, D/2) and k's in tiles of (BLOCK_T, BLOCK_HK, D/2).
    ONE_TILE (every head of q in one tile and of k in another: Llama-3-8B's 32 and 8 heads of 128): all four loads
    (q's and k's halves) are issued before any store, so a program's 10 KB are in flight at once; the compiler may
    not hoist a load above a store to memory it cannot prove distinct, so the order is written out. Otherwise a
    loop over head tiles, one tile's loads then its stores. EVEN (ONE_TILE with the tiles holding exactly the heads
    and D/2 columns and T a whole number of position blocks): no masks, so no predicates and no zero-filled
    registers. On CUDA a batch group is one batch (liger-kernel's tiling: one program per (batch, position) row);
    on the interpreter (~37 us a program) a program loops over a batch that shares cos/sin (Bc = 1, or a stride-0
    batch dimension), reading those rows once.
    Tile sizes: BLOCK_D = next_pow2(D/2), BLOCK_HQ up to next_pow2(Hq) and BLOCK_T filling `_TILE_ELEMS` elements
    per half-tile. D/2 is compiled in (one compile per head_dim: the second half's offset becomes an immediate, and
    masked columns keep wide loads). Offsets are int64 (B T H D passes 2^31 at long contexts). Registers and spills
    of every configuration at the benchmark shapes: `python -m bench.sm90 --only rope` (sm_90, compiled on a CPU).
    Why this tiling (issue 47: the H200 timed the previous kernel at 0.192 ms forward and 0.198 ms backward on the
    device against liger's 0.169 and 0.168, 4 x 8192 at Llama-3-8B's heads, bf16). Compiled for sm_90 here, bf16,
    forward (the backward within two registers):
        kernel                                   registers  programs/SM  issued together  SASS per program
        before: per-position program, q's loads       96          5      8 KB, then 2 KB   472 (a 4-batch loop)
                then stores, then k's; 4 batches
        now: (position, batch) program, ONE_TILE,     70          7      10 KB             352
                EVEN, D/2 compiled in
        liger-kernel 0.8.5 _triton_rope               54          9      10 KB             264
    The SASS of each program covers 40 elements a thread (32 of q, 8 of k): 8.8 instructions an element now, 6.6 for
    liger (which compiles the head counts and head_dim in and reads half of cos/sin); a 4.8 TB/s stream of 4-byte
    elements would be issue-bound only past about 28 (132 SMs x 4 schedulers x 1.98 GHz x 32 lanes / 1.2e12 elements
    a second). Neither is; what separated them was how many bytes a program had in flight and how many programs an SM
    held. Not yet timed on a GPU: bench/bench_rope.py
    --kernel-times is the check (docs/gpu_runbook.md).

Test:  python -m pytest tests/kernels/test_rope.py -q   (CPU: Triton interpreter; GPU tests auto-run on CUDA)
Bench: python bench/bench_rope.py                      (GPU: Llama-3-8B heads; --quick for a CPU smoke run)
"""

from __future__ import annotations

import torch

from ._dispatch import HAS_TRITON, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Elements of one half-tile (BLOCK_T x BLOCK_H x BLOCK_D): x1 and x2 are live together, so a program holds twice
# this many fp32 values, plus the four cos/sin halves broadcast over heads. At Llama-3-8B's heads 2048 holds one
# position's 32 q heads (and its 8 k heads beside them): ptxas (sm_90, bf16, `python -m bench.sm90 --only rope`) gives
# 70-72 registers at 4 warps with every head in one tile and no masks (7 programs per SM, 10 KB of q and k read per
# program, all of it in flight at once); 1024 would split q's heads over two tiles and serialise them.
_TILE_ELEMS = 2048


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def launch_config(T: int, Hq: int, Hkv: int, D: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_T, BLOCK_HQ, BLOCK_HK, BLOCK_D, num_warps) for q (B, Hq, T, D) and k (B, Hkv, T, D)."""
    block_d = _next_pow2(D // 2)
    heads_cap = max(1, _TILE_ELEMS // block_d)
    block_hq = min(_next_pow2(Hq), heads_cap)
    block_hk = min(_next_pow2(Hkv), heads_cap)
    block_t = max(1, min(_next_pow2(T), _TILE_ELEMS // (block_hq * block_d)))
    # 16 fp32 values per thread per live half-tile at 2048 elements and 4 warps; smaller tiles keep 4 warps so
    # the loads stay wide.
    num_warps = min(8, max(4, _next_pow2(block_t * block_hq * block_d // 512)))
    return block_t, block_hq, block_hk, block_d, num_warps


def tile_flags(T: int, Hq: int, Hkv: int, D: int) -> tuple[bool, bool]:
    """(ONE_TILE, EVEN): every head of q fits one tile and every head of k another (a program loads both before it
    stores either); and, beyond that, the tiles hold exactly the heads and D / 2 columns and T is a whole number of
    position blocks, so no load or store needs a mask."""
    block_t, block_hq, block_hk, block_d, _ = launch_config(T, Hq, Hkv, D)
    one_tile = block_hq >= Hq and block_hk >= Hkv
    return one_tile, one_tile and (block_hq, block_hk, block_d) == (Hq, Hkv, D // 2) and T % block_t == 0


if HAS_TRITON:

    @triton.jit
    def _heads(x_ptr, h0, H, s_h, t_off, d_off, td_mask, BLOCK_H: tl.constexpr):
        """Pointers to the first-half columns of heads h0 .. h0 + BLOCK_H at the program's positions, (BLOCK_T,
        BLOCK_H, BLOCK_D), and their mask (unused when EVEN: the tile lies inside the tensor)."""
        h = (h0 + tl.arange(0, BLOCK_H))[None, :, None]  # (1, BLOCK_H, 1)
        mask = td_mask & (h < H)
        return x_ptr + h.to(tl.int64) * s_h + t_off + d_off, mask

    @triton.jit
    def _load_f32(ptrs, mask, EVEN: tl.constexpr):
        if EVEN:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=mask, other=0.0)
        return x.to(tl.float32)

    @triton.jit
    def _store_rotated(ptrs, mask, half, x1, x2, c1, c2, s1, s2, EVEN: tl.constexpr):
        """o1 = x1 c1 - x2 s1 at ptrs, o2 = x2 c2 + x1 s2 at ptrs + half (sin already negated and swapped for the
        backward), each rounded once to the output's dtype."""
        o1 = (x1 * c1 - x2 * s1).to(ptrs.dtype.element_ty)
        o2 = (x2 * c2 + x1 * s2).to(ptrs.dtype.element_ty)
        if EVEN:
            tl.store(ptrs, o1)
            tl.store(ptrs + half, o2)
        else:
            tl.store(ptrs, o1, mask=mask)
            tl.store(ptrs + half, o2, mask=mask)

    @triton.jit
    def _rope_heads(
        x_ptr,
        o_ptr,
        H,
        s_xh,
        s_xt,
        s_xd,
        s_oh,
        s_ot,
        s_od,
        HALF,
        t64,
        d,
        td_mask,
        c1,
        c2,
        s1,
        s2,
        BLOCK_H: tl.constexpr,
        EVEN: tl.constexpr,
    ):
        """Rotate this batch's H heads in tiles of BLOCK_H, one tile's loads and stores at a time."""
        for h0 in tl.range(0, H, BLOCK_H):
            xp, mask = _heads(x_ptr, h0, H, s_xh, t64 * s_xt, d * s_xd, td_mask, BLOCK_H)
            x1, x2 = _load_f32(xp, mask, EVEN), _load_f32(xp + HALF * s_xd, mask, EVEN)
            op, _ = _heads(o_ptr, h0, H, s_oh, t64 * s_ot, d * s_od, td_mask, BLOCK_H)
            _store_rotated(op, mask, HALF * s_od, x1, x2, c1, c2, s1, s2, EVEN)

    @triton.jit
    def _rope_kernel(
        q_ptr,  # (B, Hq, T, D) input (forward: q; backward: dq_rot), any strides
        k_ptr,  # (B, Hkv, T, D) input (forward: k; backward: dk_rot), any strides
        cos_ptr,  # (Bc, T, D) any float dtype, any strides; batch stride 0 when shared by the batch
        sin_ptr,  # (Bc, T, D) likewise
        qo_ptr,  # (B, Hq, T, D) output in q's dtype (the launcher's is (B, T, Hq, D) memory)
        ko_ptr,  # (B, Hkv, T, D) output in k's dtype
        T,
        HQ,
        HKV,
        HALF: tl.constexpr,  # D / 2
        GROUPS,  # batch groups: B / B_PER_PROG
        B_PER_PROG,  # batches per program (they share cos/sin: B when cos/sin are batch-shared, else 1)
        s_qb,
        s_qh,
        s_qt,
        s_qd,
        s_kb,
        s_kh,
        s_kt,
        s_kd,
        s_cb,
        s_ct,
        s_cd,
        s_sb,
        s_st,
        s_sd,
        s_qob,
        s_qoh,
        s_qot,
        s_qod,
        s_kob,
        s_koh,
        s_kot,
        s_kod,
        BLOCK_T: tl.constexpr,
        BLOCK_HQ: tl.constexpr,
        BLOCK_HK: tl.constexpr,
        BLOCK_D: tl.constexpr,
        ONE_TILE: tl.constexpr,  # every head of q in one tile and every head of k in another
        EVEN: tl.constexpr,  # ONE_TILE, and the tiles hold exactly the heads, D / 2 and whole position blocks: no masks
        BACKWARD: tl.constexpr,
    ):
        # Program p takes batch group p % GROUPS of position block p // GROUPS: the batch groups of one position block
        # run side by side, so batch-shared cos/sin rows are read from DRAM once and from L2 by the other groups.
        pid = tl.program_id(0)
        t = (pid // GROUPS) * BLOCK_T + tl.arange(0, BLOCK_T)
        b0 = (pid % GROUPS).to(tl.int64) * B_PER_PROG
        t64 = t.to(tl.int64)[:, None, None]  # (BLOCK_T, 1, 1)
        d = tl.arange(0, BLOCK_D)[None, None, :]  # (1, 1, BLOCK_D)
        td_mask = (t[:, None, None] < T) & (d < HALF)  # (BLOCK_T, 1, BLOCK_D); unused when EVEN
        # The positions' cos/sin rows, loaded once and kept for every head of every batch of this program.
        cos_rows = cos_ptr + b0 * s_cb + t64 * s_ct + d * s_cd
        sin_rows = sin_ptr + b0 * s_sb + t64 * s_st + d * s_sd
        c1 = _load_f32(cos_rows, td_mask, EVEN)  # (BLOCK_T, 1, BLOCK_D)
        c2 = _load_f32(cos_rows + HALF * s_cd, td_mask, EVEN)
        s1 = _load_f32(sin_rows, td_mask, EVEN)
        s2 = _load_f32(sin_rows + HALF * s_sd, td_mask, EVEN)
        if BACKWARD:  # the transpose: (s1, s2) -> (-s2, -s1)
            s1, s2 = -s2, -s1
        for i in tl.range(0, B_PER_PROG):
            b = b0 + i
            q_in, q_out = q_ptr + b * s_qb, qo_ptr + b * s_qob
            k_in, k_out = k_ptr + b * s_kb, ko_ptr + b * s_kob
            if ONE_TILE:
                # Every load before any store: the compiler may not move a load past a store to memory it cannot
                # prove distinct, so only in this order are q's and k's reads in flight together.
                qp, q_mask = _heads(q_in, 0, HQ, s_qh, t64 * s_qt, d * s_qd, td_mask, BLOCK_HQ)
                kp, k_mask = _heads(k_in, 0, HKV, s_kh, t64 * s_kt, d * s_kd, td_mask, BLOCK_HK)
                q1, q2 = _load_f32(qp, q_mask, EVEN), _load_f32(qp + HALF * s_qd, q_mask, EVEN)
                k1, k2 = _load_f32(kp, k_mask, EVEN), _load_f32(kp + HALF * s_kd, k_mask, EVEN)
                qop, _ = _heads(q_out, 0, HQ, s_qoh, t64 * s_qot, d * s_qod, td_mask, BLOCK_HQ)
                kop, _ = _heads(k_out, 0, HKV, s_koh, t64 * s_kot, d * s_kod, td_mask, BLOCK_HK)
                _store_rotated(qop, q_mask, HALF * s_qod, q1, q2, c1, c2, s1, s2, EVEN)
                _store_rotated(kop, k_mask, HALF * s_kod, k1, k2, c1, c2, s1, s2, EVEN)
            else:
                _rope_heads(
                    q_in,
                    q_out,
                    HQ,
                    s_qh,
                    s_qt,
                    s_qd,
                    s_qoh,
                    s_qot,
                    s_qod,
                    HALF,
                    t64,
                    d,
                    td_mask,
                    c1,
                    c2,
                    s1,
                    s2,
                    BLOCK_HQ,
                    EVEN,
                )
                _rope_heads(
                    k_in,
                    k_out,
                    HKV,
                    s_kh,
                    s_kt,
                    s_kd,
                    s_koh,
                    s_kot,
                    s_kod,
                    HALF,
                    t64,
                    d,
                    td_mask,
                    c1,
                    c2,
                    s1,
                    s2,
                    BLOCK_HK,
                    EVEN,
                )


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("kernels.rope: the Triton path needs triton (pip install triton)")


def _bthd_like(x: torch.Tensor) -> torch.Tensor:
    """An uninitialised (B, H, T, D) tensor in (B, T, H, D)-contiguous memory (the module docstring's layout)."""
    B, H, T, D = x.shape
    return torch.empty((B, T, H, D), dtype=x.dtype, device=x.device).transpose(1, 2)  # (B, H, T, D)


def _batch_stride(t: torch.Tensor) -> int:
    return 0 if t.shape[0] == 1 else t.stride(0)


def rope_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    backward: bool = False,
    batches_per_program: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch rotating q (B, Hq, T, D) and k (B, Hkv, T, D) by cos/sin (Bc, T, D); backward=True applies the
    transpose (q, k are then the output gradients). Returns two new (B, H, T, D) views of (B, T, H, D) memory.
    No autograd. `batches_per_program` overrides the batch grouping (1, or B with batch-shared cos/sin)."""
    _require_triton()
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    q_out, k_out = _bthd_like(q), _bthd_like(k)  # (B, Hq, T, D), (B, Hkv, T, D)
    if B == 0 or T == 0:
        return q_out, k_out
    block_t, block_hq, block_hk, block_d, num_warps = launch_config(T, Hq, Hkv, D)
    t_blocks = triton.cdiv(T, block_t)
    cos_sb, sin_sb = _batch_stride(cos), _batch_stride(sin)
    shared = cos_sb == 0 and sin_sb == 0
    if batches_per_program is None:
        # On CUDA one (position block, batch) per program, the batches of a position block side by side (their
        # shared cos/sin rows come from L2); on the interpreter (~37 us a program) one program loops over a batch
        # that shares cos/sin.
        batches_per_program = B if shared and not q.is_cuda else 1
    if batches_per_program not in (1, B) or (batches_per_program > 1 and not shared):
        raise ValueError(f"batches_per_program={batches_per_program} must be 1, or B={B} with batch-shared cos/sin")
    groups = B // batches_per_program
    one_tile, even = tile_flags(T, Hq, Hkv, D)
    _rope_kernel[(t_blocks * groups,)](
        q,
        k,
        cos,
        sin,
        q_out,
        k_out,
        T,
        Hq,
        Hkv,
        D // 2,
        groups,
        batches_per_program,
        *q.stride(),
        *k.stride(),
        cos_sb,
        *cos.stride()[1:],
        sin_sb,
        *sin.stride()[1:],
        *q_out.stride(),
        *k_out.stride(),
        BLOCK_T=block_t,
        BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk,
        BLOCK_D=block_d,
        ONE_TILE=one_tile,
        EVEN=even,
        BACKWARD=backward,
        num_warps=num_warps,
    )
    return q_out, k_out


class RoPEFunction(torch.autograd.Function):
    """Autograd over the launcher: gradients for q and k; cos and sin take none (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        q_rot, k_rot = rope_launch(q, k, cos, sin)
        ctx.save_for_backward(cos, sin)
        return q_rot, k_rot

    @staticmethod
    def backward(ctx, dq_rot, dk_rot):
        cos, sin = ctx.saved_tensors
        dq, dk = rope_launch(dq_rot, dk_rot, cos, sin, backward=True)
        return (dq if ctx.needs_input_grad[0] else None), (dk if ctx.needs_input_grad[1] else None), None, None


def _check_args(q, k, cos, sin) -> None:
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dtype not in _DTYPES:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"rope: {name} must be a float32, bfloat16 or float16 tensor, got {got}")
        if t.dim() != 4:
            raise ValueError(f"rope: {name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"rope: {name} must be a floating-point tensor, got {got}")
    B, _, T, D = q.shape
    if q.dtype != k.dtype:
        raise TypeError(f"rope: q and k must share a dtype, got {q.dtype} and {k.dtype}")
    if k.shape[0] != B or k.shape[2:] != (T, D):
        raise ValueError(f"rope: k {tuple(k.shape)} must match q {tuple(q.shape)} in batch, seq and head_dim")
    if D % 2:
        raise ValueError(f"rope: head_dim must be even (rotate-half pairs i and i + D/2), got {D}")
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[0] not in (1, B) or cos.shape[1:] != (T, D):
        raise ValueError(
            f"rope: cos and sin must both be (batch {B} or 1, seq {T}, head_dim {D}), got "
            f"{tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if len({q.device, k.device, cos.device, sin.device}) != 1:
        raise ValueError(
            f"rope: q, k, cos and sin must share a device, got {q.device}, {k.device}, {cos.device}, {sin.device}"
        )
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError(
            "rope: cos and sin take no gradient (they come from positions and fixed frequencies); pass them detached"
        )


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_rot, k_rot): transformers' apply_rotary_pos_emb(q, k, cos, sin) with fp32 math and one rounding.

    q (B, Hq, T, D), k (B, Hkv, T, D) with any strides; cos, sin (B or 1, T, D). On the Triton path the outputs are
    (B, H, T, D) views of (B, T, H, D)-contiguous memory (module docstring). CUDA tensors run the Triton kernel, CPU
    tensors the reference (see `kernels._dispatch`). Gradients flow to q and k; cos and sin take none."""
    _check_args(q, k, cos, sin)
    if not use_triton(q, k, cos, sin):
        return rope_ref(q, k, cos, sin)
    return RoPEFunction.apply(q, k, cos, sin)


def rope_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch RoPE: fp32 math (fp64 for fp64 inputs), one cast back; autograd-differentiable."""
    compute = torch.promote_types(q.dtype, torch.float32)
    c, s = cos[:, None].to(compute), sin[:, None].to(compute)  # (Bc, 1, T, D)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xc = x.to(compute)  # (B, H, T, D)
        x1, x2 = xc.chunk(2, dim=-1)
        return (xc * c + torch.cat((-x2, x1), dim=-1) * s).to(x.dtype)

    return rotate(q), rotate(k)
