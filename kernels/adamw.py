"""Fused AdamW: one multi-tensor Triton launch updates every parameter of a (param group, dtype) bucket.

Math (torch.optim.AdamW, decoupled weight decay; per element, all arithmetic in fp32; t = step after += 1)
    g      = -grad if maximize else grad
    w      = w * (1 - lr * weight_decay)                      (decay before the Adam update, as torch does)
    m      = m + (1 - beta1) * (g - m)                        (torch's lerp)
    v      = beta2 * v + (1 - beta2) * g^2
    w      = w - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
The bias corrections 1 - beta^t are computed inside the kernel in fp64 (beta^t by squaring, from the fp64
betas in the launch table) from each parameter's own device-side step tensor, so a step never reads a
device value on the host: no `.item()`, no sync. `1 - lr * weight_decay` and `1 - beta` are formed in
double on the host (lr is a Python float, changed freely by schedulers between steps) and passed as fp32,
which is what torch does with its double scalars.

State: `step` (fp32 0-d tensor on the parameter's device, as torch's fused AdamW keeps it), `exp_avg`,
`exp_avg_sq` (fp32, or bf16 with state_dtype=torch.bfloat16: read as fp32, updated in fp32, stored rounded to
nearest even), and for bf16/fp16 parameters with master_weights=True an fp32 `master_param`. Optimizer memory
per parameter: 8 bytes of moments (4 with bf16 moments), plus 4 for a master copy.

Low-precision parameters (why master weights are the default)
    A bf16 parameter has 8 significant bits: an update below half an ulp (always when |dw| < 2^-9 |w|; Adam's
    |dw| is about lr, so e.g. lr=1e-5 on weights of magnitude 0.02) is rounded away every step and training
    silently stalls.
    - master_weights=True (default): the update runs on an fp32 `master_param`; the bf16/fp16 parameter is
      its round-to-nearest copy, written by the same kernel. The trajectory equals fp32 AdamW's to fp32
      rounding, is bit-reproducible, and resumes exactly from a checkpoint. Cost: 4 bytes per parameter of
      memory and 6 more bytes of traffic per element than stochastic rounding.
    - master_weights=False (bf16 only): stochastic rounding. The fp32 result w is rounded up in magnitude
      with probability equal to its distance from the lower bf16 neighbour: add 16 random bits to the fp32
      bit pattern, clear the low 16. E[bf16(w)] = w, so tiny updates survive in expectation at no memory
      cost, but each step adds rounding noise of up to one ulp. The random bits are a counter-based hash
      (lowbias32) of (element index, tensor index, step): deterministic, identical in the kernel and the
      reference, no generator state to checkpoint. fp16 with master_weights=False is rejected: fp16's bit
      pattern is not a truncated fp32, and fp16 training wants master weights anyway.
    We default to the master copy because exactness is worth more than 4 bytes per parameter for the
    fine-tuning sizes this project targets; stochastic rounding is there when memory is what binds.
    With master weights the fp32 copy is the source of truth: load weights into the model before the first
    step (or restore the optimizer state with them), not in between.

Bytes moved per parameter element (reads + writes)
    fp32 params             p, g, m, v read (16) + p, m, v written (12)            = 28 B
    bf16/fp16, master       g (2), master, m, v (12) + master, m, v (12), p (2)    = 28 B
    bf16, stochastic round  p, g (4), m, v (8) + p (2), m, v (8)                   = 22 B
    bf16 moments: 8 B fewer in each of the rows above (m, v read and written as 2 bytes each, not 4)
    torch fused=True on fp32 params also moves 28 B; foreach=True makes about ten passes (~80 B).
    The launch tables add 84 B read per 2048-element block (its block-table entry, its tensor's table row and
    the betas, re-read by every block, and the step counter; measured with bench/traffic.py), 0.04 B per element.

Launch strategy
    Parameters with a gradient are bucketed by (param group, device, dtype); one launch per bucket, plus
    one `torch._foreach_add_` of its step counters (two launches when some of its tensors are misaligned, below).
    The launch reads two tables:
    - a tensor table, int64 (1 + T, 8): row 0 holds the fp64 bit patterns of beta1 and beta2; row 1 + t the
      addresses of param t, its grad, exp_avg, exp_avg_sq, master (0 if none) and step, then its numel.
      Addresses travel as int64 and are cast back to typed pointers in the kernel (works identically under
      TRITON_INTERPRET=1, which was checked first);
    - a block table, int32 (NB, 2): (tensor t, block index within t) for program pid; one program updates
      BLOCK contiguous elements of one tensor, so awkward sizes cost at most one partial block per tensor.
    Both are built on the host, staged through pinned memory and copied with non_blocking=True, and cached:
    the block table changes only when the parameter sizes do, the tensor table only when a pointer does
    (grads re-allocated at new addresses). Full blocks take an unmasked path; in a launch whose tensors have
    every address 16-byte aligned (checked per tensor on the host) the pointers carry a `tl.multiple_of` hint
    so the loads vectorise: the masked tail, where numel's divisibility is unknown, would not (checked in the
    PTX: v4 loads and stores on the full-block path). Alignment is decided per tensor: a bucket's misaligned
    tensors (rare: e.g. views into a flat buffer) get a second launch with ALIGNED=False, so they cannot
    turn the other tensors' loads scalar (csrc/adamw.cu keeps a per-tensor flag to the same effect). Two
    launches rather than a per-tensor flag read in one kernel: with both paths compiled in, ptxas gave the
    kernel 118 / 128 / 128 registers (fp32 / bf16 master / bf16 stochastic) instead of 76 / 86 / 96, 2
    blocks per SM instead of 3 for every bucket. BLOCK=2048 with 8 warps: see `_BLOCK`; not yet timed on a GPU.
    The dispatch point is `_step_bucket` (`adamw_impl` says which path and why): CUDA -> Triton, or the CUDA
    C++ multi-tensor op `torch.ops.kernelwright.fused_adamw_` (csrc/adamw.cu, same math) when kernels._C is
    built and KERNELS_ADAMW_IMPL=cuda, or 'auto' (the default) for the parameter dtypes it was measured faster for
    (bf16; `_CUDA_OP_FASTER_DTYPES`);
    CPU -> Triton if forced; with the backend on 'auto', fp32 buckets take torch's own fused CPU AdamW
    (`torch._fused_adamw_`, what torch.optim.AdamW(fused=True) runs: same math, one pass per tensor; the
    reference's per-parameter ops cost ~8% of a tiny-preset training step); everything else, and
    KERNELS_BACKEND=reference, takes the reference.

References: Loshchilov & Hutter, "Decoupled Weight Decay Regularization" (2019); torch.optim.AdamW;
Gupta et al., "Deep Learning with Limited Numerical Precision" (2015) for stochastic rounding.

Test:  python -m pytest tests/kernels/test_adamw.py -q   (CPU: Triton interpreter; GPU test auto-runs on CUDA)
Bench: python bench/bench_adamw.py               (GPU: Llama-3.2-1B parameter list; --quick for a CPU smoke run)
"""

from __future__ import annotations

import contextlib
import numbers
import os
import struct
import warnings

import torch

from ._dispatch import HAS_TRITON, current_backend, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Elements per program and warps: 8 elements per thread, two 16-byte loads per fp32 tensor. ptxas (sm_90a,
# compile only) gives 78 / 86 / 96 registers for fp32 / bf16 master / bf16 stochastic and no spills, so 2-3
# blocks of 256 threads fit per SM; BLOCK=4096 took 150 registers (128 and spills at 8 warps for bf16).
# Not yet timed on a GPU.
_BLOCK = 2048
_NUM_WARPS = 8
# Tensor-table row: param, grad, exp_avg, exp_avg_sq, master, step, numel, unused.
_ROW = 8
_STATE_KEYS = ("exp_avg", "exp_avg_sq", "master_param")
STATE_DTYPES = (torch.float32, torch.bfloat16)  # FusedAdamW's state_dtype: the moments' storage
# Constants of the stochastic-rounding hash (shared by kernel and reference).
_GOLDEN = 0x9E3779B9
_MASK32 = 0xFFFFFFFF


if HAS_TRITON:

    @triton.jit
    def _hash32(x):
        # lowbias32 (C. Wellons): a bijective uint32 mixer with near-ideal avalanche; ~10 integer ops per
        # element, where Philox (tl.randint) costs ~60 and would make the update compute-bound.
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        x = x ^ (x >> 16)
        return x

    @triton.jit
    def _adamw_block(
        tensor_table,  # int64 (1 + T, 8): row 0 fp64 betas, row 1 + t tensor t's addresses and numel
        row,  # pointer to tensor t's row in tensor_table
        t,  # index of the tensor in this launch (seeds the stochastic rounding)
        start,  # first element of this program's block
        numel,
        lr,
        one_minus_beta1,
        beta2,
        one_minus_beta2,
        eps,
        decay,
        P_DTYPE: tl.constexpr,
        S_DTYPE: tl.constexpr,  # the moments' dtype: fp32, or bf16 (rounded to nearest even when stored)
        HAS_MASTER: tl.constexpr,
        STOCHASTIC: tl.constexpr,
        MAXIMIZE: tl.constexpr,
        ALIGNED: tl.constexpr,
        EVEN: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        offs = start + tl.arange(0, BLOCK)
        p_ptr = tl.load(row + 0).to(tl.pointer_type(P_DTYPE))  # param (written; read only without master)
        g_ptr = tl.load(row + 1).to(tl.pointer_type(P_DTYPE))  # grad (read)
        m_ptr = tl.load(row + 2).to(tl.pointer_type(S_DTYPE))  # exp_avg (read, written)
        v_ptr = tl.load(row + 3).to(tl.pointer_type(S_DTYPE))  # exp_avg_sq (read, written)
        w_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))  # fp32 master (read, written) if HAS_MASTER
        s_ptr = tl.load(row + 5).to(tl.pointer_type(tl.float32))  # step, already incremented (read)
        if ALIGNED:
            p_ptr = tl.multiple_of(p_ptr, 16)
            g_ptr = tl.multiple_of(g_ptr, 16)
            m_ptr = tl.multiple_of(m_ptr, 16)
            v_ptr = tl.multiple_of(v_ptr, 16)
            w_ptr = tl.multiple_of(w_ptr, 16)

        # Full blocks load and store unmasked (vectorisable); the one tail block per tensor is masked.
        # (Helpers are inlined by hand: each @jit call costs ~5 ms of re-patching in the interpreter.)
        if EVEN:
            mask = None
            other = None
        else:
            mask = offs < numel
            other = 0.0
        # Issue the streaming loads before the scalar bias-correction loop so their latency overlaps it;
        # upcast right after each load (bf16 arithmetic is wrong in the interpreter).
        g = tl.load(g_ptr + offs, mask=mask, other=other).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=other).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=other).to(tl.float32)
        if HAS_MASTER:
            w = tl.load(w_ptr + offs, mask=mask, other=other)
        else:
            w = tl.load(p_ptr + offs, mask=mask, other=other).to(tl.float32)

        # beta^n by squaring in fp64 (log2(n) multiplies, no libdevice pow), both betas in one loop.
        n = tl.load(s_ptr).to(tl.int32)
        base1 = tl.load(tensor_table + 0).to(tl.float64, bitcast=True)
        base2 = tl.load(tensor_table + 1).to(tl.float64, bitcast=True)
        pow1 = tl.full((), 1.0, tl.float64)
        pow2 = tl.full((), 1.0, tl.float64)
        k = n
        while k > 0:
            odd = (k & 1) == 1
            pow1 = tl.where(odd, pow1 * base1, pow1)
            pow2 = tl.where(odd, pow2 * base2, pow2)
            base1 = base1 * base1
            base2 = base2 * base2
            k = k >> 1
        bias_correction1 = 1.0 - pow1
        bias_correction2 = 1.0 - pow2
        step_size = (lr / bias_correction1).to(tl.float32)
        bias_correction2_sqrt = tl.sqrt_rn(bias_correction2.to(tl.float32))

        if MAXIMIZE:
            g = -g
        # torch's operation order (lerp, addcmul, addcdiv) with IEEE sqrt and division (CUDA's defaults are
        # approximate): the kernel is bandwidth-bound, so exactness is free; what remains is FMA contraction,
        # about one fp32 ulp per step against torch.
        w = w * decay
        m = m + one_minus_beta1 * (g - m)
        v = v * beta2 + one_minus_beta2 * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
        w = w + tl.div_rn(-step_size * m, denom)

        if S_DTYPE == tl.bfloat16:
            # Round to nearest even by the bit pattern (the interpreter's fp32 -> bf16 cast truncates; a GPU's
            # rounds): add 0x7FFF plus the kept mantissa's lowest bit, clear the low 16 bits. The cast after is
            # then exact everywhere. uint32 so that +-inf stay inf; NaN passes through.
            m_bits = m.to(tl.uint32, bitcast=True)
            m_bits = (m_bits + 0x7FFF + ((m_bits >> 16) & 1)) & 0xFFFF0000
            m = tl.where(m != m, m, m_bits.to(tl.float32, bitcast=True))
            v_bits = v.to(tl.uint32, bitcast=True)
            v_bits = (v_bits + 0x7FFF + ((v_bits >> 16) & 1)) & 0xFFFF0000
            v = tl.where(v != v, v, v_bits.to(tl.float32, bitcast=True))
        tl.store(m_ptr + offs, m.to(S_DTYPE), mask=mask)
        tl.store(v_ptr + offs, v.to(S_DTYPE), mask=mask)
        if HAS_MASTER:
            tl.store(w_ptr + offs, w, mask=mask)
            tl.store(p_ptr + offs, w.to(P_DTYPE), mask=mask)
        elif STOCHASTIC:
            seed = _hash32(n.to(tl.uint32) ^ _hash32(t.to(tl.uint32) + 0x9E3779B9))
            noise = _hash32(offs.to(tl.uint32) ^ seed) & 0xFFFF
            # Adding 16 random bits below the bf16 mantissa then truncating rounds |w| up with probability
            # (distance to the lower neighbour) / ulp. uint32 so that +-inf stay inf; NaN passes through.
            bits = (w.to(tl.uint32, bitcast=True) + noise) & 0xFFFF0000
            rounded = tl.where(w != w, w, bits.to(tl.float32, bitcast=True))
            tl.store(p_ptr + offs, rounded.to(P_DTYPE), mask=mask)  # exact: the low 16 bits are zero
        else:
            tl.store(p_ptr + offs, w.to(P_DTYPE), mask=mask)

    @triton.jit
    def _adamw_kernel(
        tensor_table,  # int64 (1 + T, 8): row 0 fp64 bits of beta1, beta2; row 1 + t: param, grad, exp_avg,
        #                exp_avg_sq, master (0 if none), step addresses, numel, unused
        block_table,  # int32 (NB, 2): (tensor t, block index within t) of program pid
        lr,
        one_minus_beta1,
        beta2,
        one_minus_beta2,
        eps,
        decay,  # 1 - lr * weight_decay, formed in double on the host
        P_DTYPE: tl.constexpr,
        S_DTYPE: tl.constexpr,
        HAS_MASTER: tl.constexpr,
        STOCHASTIC: tl.constexpr,
        MAXIMIZE: tl.constexpr,
        ALIGNED: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        t = tl.load(block_table + 2 * pid)
        start = tl.load(block_table + 2 * pid + 1).to(tl.int64) * BLOCK
        row = tensor_table + 8 * (t.to(tl.int64) + 1)  # _ROW int64 slots per tensor, after the betas row
        numel = tl.load(row + 6)
        if start + BLOCK <= numel:
            _adamw_block(
                tensor_table,
                row,
                t,
                start,
                numel,
                lr,
                one_minus_beta1,
                beta2,
                one_minus_beta2,
                eps,
                decay,
                P_DTYPE,
                S_DTYPE,
                HAS_MASTER,
                STOCHASTIC,
                MAXIMIZE,
                ALIGNED,
                True,
                BLOCK,
            )
        else:
            _adamw_block(
                tensor_table,
                row,
                t,
                start,
                numel,
                lr,
                one_minus_beta1,
                beta2,
                one_minus_beta2,
                eps,
                decay,
                P_DTYPE,
                S_DTYPE,
                HAS_MASTER,
                STOCHASTIC,
                MAXIMIZE,
                ALIGNED,
                False,
                BLOCK,
            )

    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# ---------------------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------------------


def _f64_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device without a host sync: pinned staging + non_blocking copy on CUDA."""
    if device.type == "cuda":
        # The caching host allocator keeps the pinned buffer alive until the copy has run.
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class _LaunchTables:
    """Device-side tables of one bucket, rebuilt only when what they describe changes."""

    def __init__(self) -> None:
        self.block_key: tuple | None = None
        self.blocks: list[tuple[bool, torch.Tensor]] = []
        self.tensor_key: tuple | None = None
        self.tensors: torch.Tensor | None = None

    def block_tables(
        self, numels: list[int], aligned: list[bool], device: torch.device
    ) -> list[tuple[bool, torch.Tensor]]:
        """(ALIGNED, block table) per launch: the aligned tensors' blocks, then the misaligned ones' (if any)."""
        key = (device, tuple(numels), tuple(aligned))
        if key != self.block_key:
            self.blocks = []
            for flag in (True, False):
                members = [t for t, a in enumerate(aligned) if a == flag]
                counts = [(numels[t] + _BLOCK - 1) // _BLOCK for t in members]
                if sum(counts) == 0:
                    continue
                counts_t = torch.tensor(counts, dtype=torch.int64)  # (T',)
                tensor = torch.repeat_interleave(torch.tensor(members, dtype=torch.int64), counts_t)  # (NB,)
                first = torch.repeat_interleave(
                    torch.cumsum(counts_t, 0) - counts_t, counts_t
                )  # (NB,) its tensor's first
                block = torch.arange(tensor.numel()) - first  # (NB,) block index within its tensor
                table = torch.stack([tensor, block], dim=1).to(torch.int32)  # (NB, 2)
                self.blocks.append((flag, _to_device(table.reshape(-1), device)))  # (NB * 2,)
            self.block_key = key
        return self.blocks

    def tensor_table(self, rows: list[int], device: torch.device, check) -> torch.Tensor:
        """The table for these rows; check() runs first whenever they differ from the cached ones."""
        key = (device, tuple(rows))
        if key != self.tensor_key:
            check()  # before caching: a row that failed its check must never be launched from the cache
            self.tensors = _to_device(torch.tensor(rows, dtype=torch.int64), device)  # ((1 + T) * 8,)
            self.tensor_key = key
        return self.tensors


def _check_bucket(params, grads, exp_avgs, exp_avg_sqs, steps, masters, stochastic_rounding) -> None:
    n = len(params)
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "steps": steps}
    if masters is not None:
        lists["masters"] = masters
    for name, lst in lists.items():
        if len(lst) != n:
            raise ValueError(f"fused_adamw_step: {name} has {len(lst)} tensors, params has {n}")
    dtype, device = params[0].dtype, params[0].device
    if dtype not in _DTYPES:
        raise ValueError(f"fused_adamw_step: params dtype {dtype} is not one of {', '.join(map(str, _DTYPES))}")
    state_dtype = exp_avgs[0].dtype if exp_avgs else torch.float32
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"fused_adamw_step: moments dtype {state_dtype} is not one of float32, bfloat16")
    if dtype == torch.float32 and (masters is not None or stochastic_rounding):
        raise ValueError("fused_adamw_step: float32 params take neither masters nor stochastic_rounding")
    if dtype != torch.float32 and masters is None and not (stochastic_rounding and dtype == torch.bfloat16):
        raise ValueError(
            f"fused_adamw_step: {dtype} params need masters (fp32 copies) or, for bfloat16, stochastic_rounding=True"
        )
    for i in range(n):
        p = params[i]
        if p.dtype != dtype or p.device != device or not p.is_contiguous():
            raise ValueError(f"fused_adamw_step: params[{i}] must be contiguous {dtype} on {device}")
        if grads[i].dtype != dtype or grads[i].shape != p.shape or not grads[i].is_contiguous():
            raise ValueError(
                f"fused_adamw_step: grads[{i}] must be a contiguous {dtype} tensor of shape {tuple(p.shape)}"
            )
        for name in ("exp_avgs", "exp_avg_sqs") + (("masters",) if masters is not None else ()):
            s = lists[name][i]
            want = torch.float32 if name == "masters" else state_dtype
            if s.dtype != want or s.numel() != p.numel() or s.device != device or not s.is_contiguous():
                raise ValueError(f"fused_adamw_step: {name}[{i}] must be a contiguous {want} tensor like params[{i}]")
        s = steps[i]
        if s.dtype != torch.float32 or s.numel() != 1 or s.device != device:
            raise ValueError(f"fused_adamw_step: steps[{i}] must be a one-element float32 tensor on {device}")


def fused_adamw_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    masters: list[torch.Tensor] | None = None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool = False,
    stochastic_rounding: bool = False,
    tables: _LaunchTables | None = None,
) -> None:
    """One AdamW step, in place, over same-dtype, same-device tensors: one foreach add + one Triton launch (a
    second one for the misaligned tensors, if any).

    steps are incremented first (like torch's functional adamw). With masters the update runs on them and
    params receive the rounded copy; with stochastic_rounding (bf16 only) params are rounded stochastically.
    """
    if not HAS_TRITON:
        raise RuntimeError("kernels.adamw: the fused AdamW kernel needs triton (pip install triton)")
    if not params:
        return
    tables = tables if tables is not None else _LaunchTables()
    device = params[0].device
    dtype = params[0].dtype
    rows = [_f64_bits(beta1), _f64_bits(beta2), 0, 0, 0, 0, 0, 0]
    for i, p in enumerate(params):
        w = masters[i].data_ptr() if masters is not None else 0
        rows += (
            p.data_ptr(),
            grads[i].data_ptr(),
            exp_avgs[i].data_ptr(),
            exp_avg_sqs[i].data_ptr(),
            w,
            steps[i].data_ptr(),
            p.numel(),
            0,
        )
    # New pointers or sizes are checked once, before the kernel dereferences them.
    tensor_table = tables.tensor_table(
        rows, device, lambda: _check_bucket(params, grads, exp_avgs, exp_avg_sqs, steps, masters, stochastic_rounding)
    )
    torch._foreach_add_(steps, 1.0)
    # Per tensor: its param, grad, exp_avg, exp_avg_sq and master (0 when absent) 16-byte aligned.
    aligned = [all(rows[_ROW * (1 + i) + k] % 16 == 0 for k in range(5)) for i in range(len(params))]
    for all_aligned, block_table in tables.block_tables([p.numel() for p in params], aligned, device):
        _adamw_kernel[(block_table.numel() // 2,)](
            tensor_table,
            block_table,
            float(lr),
            1.0 - beta1,
            float(beta2),
            1.0 - beta2,
            float(eps),
            1.0 - lr * weight_decay,
            P_DTYPE=_TL_DTYPES[dtype],
            S_DTYPE=_TL_DTYPES[exp_avgs[0].dtype],
            HAS_MASTER=masters is not None,
            STOCHASTIC=bool(stochastic_rounding) and masters is None,
            MAXIMIZE=bool(maximize),
            ALIGNED=all_aligned,
            BLOCK=_BLOCK,
            num_warps=_NUM_WARPS,
        )


# ---------------------------------------------------------------------------------------------------------
# Optimizer
# ---------------------------------------------------------------------------------------------------------


def _check_hyper(where: str, lr, betas, eps, weight_decay) -> None:
    if isinstance(lr, torch.Tensor) or not isinstance(lr, numbers.Real) or not lr >= 0.0:
        raise ValueError(f"{where}: lr={lr!r} must be a Python float >= 0 (tensor lr is not supported)")
    if (
        not isinstance(betas, (tuple, list))
        or len(betas) != 2
        or not all(isinstance(b, numbers.Real) and not isinstance(b, torch.Tensor) and 0.0 <= b < 1.0 for b in betas)
    ):
        raise ValueError(f"{where}: betas={betas!r} must be two floats in [0, 1)")
    if not isinstance(eps, numbers.Real) or not eps >= 0.0:
        raise ValueError(f"{where}: eps={eps!r} must be a float >= 0")
    if not isinstance(weight_decay, numbers.Real) or not weight_decay >= 0.0:
        raise ValueError(f"{where}: weight_decay={weight_decay!r} must be a float >= 0")


def _check_state_dtype(where: str, state_dtype) -> None:
    if state_dtype not in STATE_DTYPES:
        allowed = "torch.float32, torch.bfloat16"
        raise ValueError(f"{where}: state_dtype={state_dtype!r} is not supported (allowed: {allowed})")


class FusedAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW with one fused multi-tensor update per (param group, dtype).

    Same meaning as torch.optim.AdamW (decoupled weight decay applied before the Adam update, bias
    correction, param groups, schedulers, state_dict keys `step`/`exp_avg`/`exp_avg_sq`, closures, params
    without grads skipped). Parameters may be float32, bfloat16 or float16.
    master_weights (default True, per group): bf16/fp16 parameters are updated through an fp32 copy kept in
    state["master_param"]; False rounds bf16 parameters stochastically instead (see the module docstring).
    state_dtype (default torch.float32, per group): the moments' storage. torch.bfloat16 halves it (8 -> 4 bytes
    per parameter, torchtitan's bf16 optimizer states): each step reads them as fp32, updates the parameter with
    the fp32 values, and stores them rounded to nearest even (deterministic, so a resumed run is bit-exact). The
    second moment then carries 8 significant bits: sqrt(v) within 0.4%, Adam's step size within that. The
    master copy and the step counter stay fp32. On CUDA these buckets run the Triton kernel (the CUDA op keeps
    fp32 moments), on a CPU the reference.
    amsgrad is not supported; sparse gradients are rejected.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        maximize: bool = False,
        master_weights: bool = True,
        state_dtype: torch.dtype = torch.float32,
        amsgrad: bool = False,
    ):
        if amsgrad:
            raise ValueError("FusedAdamW: amsgrad=True is not supported (allowed: False)")
        _check_hyper("FusedAdamW", lr, betas, eps, weight_decay)
        _check_state_dtype("FusedAdamW", state_dtype)
        self._tables: dict[tuple, _LaunchTables] = {}
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            maximize=bool(maximize),
            master_weights=bool(master_weights),
            state_dtype=state_dtype,
        )
        super().__init__(params, defaults)

    def __setstate__(self, state):
        super().__setstate__(state)
        self._tables = {}
        for group in self.param_groups:
            group.setdefault("maximize", False)
            group.setdefault("master_weights", True)
            group.setdefault("state_dtype", torch.float32)

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        if isinstance(params, set):  # as torch: the order must match across runs for state_dict to map
            raise TypeError("FusedAdamW: params must be an ordered collection (list, tuple, generator), not a set")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        param_group = dict(param_group, params=params)
        where = f"FusedAdamW param group {len(self.param_groups)}"
        _check_hyper(
            where,
            param_group.get("lr", self.defaults["lr"]),
            param_group.get("betas", self.defaults["betas"]),
            param_group.get("eps", self.defaults["eps"]),
            param_group.get("weight_decay", self.defaults["weight_decay"]),
        )
        if param_group.get("amsgrad", False):
            raise ValueError(f"{where}: amsgrad=True is not supported (allowed: False)")
        _check_state_dtype(where, param_group.get("state_dtype", self.defaults["state_dtype"]))
        master = param_group.get("master_weights", self.defaults["master_weights"])
        seen: set[int] = set()
        for i, p in enumerate(x[1] if isinstance(x, tuple) else x for x in params):
            if isinstance(p, torch.Tensor):
                self._check_param(p, master, f"{where}, parameter {i}")
                if id(p) in seen:  # one launch would update it twice, concurrently
                    raise ValueError(f"{where}, parameter {i}: appears twice in the group")
                seen.add(id(p))
        super().add_param_group(param_group)

    @staticmethod
    def _check_param(p: torch.Tensor, master_weights: bool, where: str) -> None:
        if p.dtype not in _DTYPES:
            raise ValueError(f"{where}: dtype {p.dtype} is not supported (allowed: {', '.join(map(str, _DTYPES))})")
        if not p.is_contiguous():
            raise ValueError(f"{where}: parameters must be contiguous (the update treats each one as flat memory)")
        if p.dtype == torch.float16 and not master_weights:
            raise ValueError(
                f"{where}: float16 parameters need master_weights=True (stochastic rounding is bfloat16-only)"
            )

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts every non-step state tensor to its parameter's dtype, which would round fp32 moments
        # of bf16 parameters to bf16 (or widen bf16 moments of fp32 ones); restore them from the source in the
        # group's state_dtype (the master copy in fp32) afterwards.
        keys = ("master_weights", "state_dtype")
        current = [{key: g.get(key, self.defaults[key]) for key in keys} for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, saved, mine in zip(self.param_groups, state_dict["param_groups"], current):
            for key, value in mine.items():
                if key not in saved:  # e.g. torch.optim.AdamW's state: keep this optimizer's choice
                    group[key] = value
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        owners = [(p, g["state_dtype"]) for g in self.param_groups for p in g["params"]]
        for saved_id, (p, state_dtype) in zip(saved_ids, owners):
            saved = state_dict["state"].get(saved_id)
            if not saved:
                continue
            state = self.state[p]
            for key in _STATE_KEYS:
                if key in saved:
                    state[key] = saved[key].to(
                        device=p.device,
                        dtype=torch.float32 if key == "master_param" else state_dtype,
                        memory_format=torch.contiguous_format,
                        copy=True,
                    )
            if "step" in saved:
                step = torch.as_tensor(saved["step"])  # a tensor, or a number in old checkpoints
                state["step"] = step.to(device=p.device, dtype=torch.float32, copy=True).reshape(())
        self._tables = {}

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW update of every parameter that has a gradient; returns closure()'s loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            where = f"FusedAdamW param group {gi}"
            _check_hyper(where, group["lr"], group["betas"], group["eps"], group["weight_decay"])
            if group.get("amsgrad", False):
                raise ValueError(f"{where}: amsgrad=True is not supported (allowed: False)")
            master_weights = group.get("master_weights", True)
            buckets: dict[tuple, tuple[list, ...]] = {}
            for i, p in enumerate(group["params"]):
                grad = p.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError("FusedAdamW does not support sparse gradients (use torch.optim.SparseAdam)")
                self._check_param(p, master_weights, f"{where}, parameter {i}")
                use_master = master_weights and p.dtype != torch.float32
                state = self._state_for(p, use_master, group["state_dtype"])
                # Sharded (FSDP2 DTensor) parameters: the update is elementwise, so each rank updates its own
                # shard; the parameter, its grad and its state are laid out alike, and their local tensors
                # are plain memory the launch tables can point at. The state stays a DTensor, so a DCP
                # checkpoint stores it sharded.
                p, grad = _local(p), _local(grad)
                if not grad.is_contiguous():
                    grad = grad.contiguous()
                bucket = buckets.setdefault((p.device, p.dtype), ([], [], [], [], [], []))
                for lst, x in zip(
                    bucket, (p, grad, _local(state["exp_avg"]), _local(state["exp_avg_sq"]), state["step"])
                ):
                    lst.append(x)
                if use_master:
                    bucket[5].append(_local(state["master_param"]))
            beta1, beta2 = group["betas"]
            for (device, dtype), (ps, gs, ms, vs, ss, ws) in buckets.items():
                _step_bucket(
                    ps,
                    gs,
                    ms,
                    vs,
                    ss,
                    ws or None,
                    lr=float(group["lr"]),
                    beta1=float(beta1),
                    beta2=float(beta2),
                    eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]),
                    maximize=bool(group["maximize"]),
                    stochastic_rounding=dtype == torch.bfloat16 and not ws,
                    tables=self._tables.setdefault((gi, device, dtype), _LaunchTables()),
                )
        return loss

    def _state_for(self, p: torch.Tensor, use_master: bool, state_dtype: torch.dtype) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            # zeros_like: a DTensor parameter gets DTensor moments with its sharding.
            state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=state_dtype, memory_format=torch.contiguous_format)
        for key in ("exp_avg", "exp_avg_sq"):
            if state[key].dtype != state_dtype:  # the group's state_dtype was changed: convert once
                state[key] = state[key].to(state_dtype)
        if use_master and "master_param" not in state:
            state["master_param"] = p.detach().to(torch.float32, copy=True)
        elif not use_master and "master_param" in state:
            del state["master_param"]  # stochastic rounding / fp32: the parameter itself is the truth
        return state


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view of its memory), or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


# Which CUDA implementation runs the update: KERNELS_ADAMW_IMPL=auto (default) | triton | cuda, read once at import.
# 'cuda' is the CUDA C++ op torch.ops.kernelwright.fused_adamw_ (csrc/adamw.cu, built into kernels._C by setup.py).
# 'auto' picks it only for the parameter dtypes a committed GPU measurement showed it faster than the Triton kernel
# for: `_CUDA_OP_FASTER_DTYPES`.
_ADAMW_IMPLS = ("auto", "triton", "cuda")
_ADAMW_IMPL = os.environ.get("KERNELS_ADAMW_IMPL", "auto").strip().lower() or "auto"
if _ADAMW_IMPL not in _ADAMW_IMPLS:
    raise ValueError(f"KERNELS_ADAMW_IMPL={_ADAMW_IMPL!r} is not one of {', '.join(_ADAMW_IMPLS)}")
# One H200 run (triton 3.6.0, git 875a621; bench/bench_adamw.py --model llama-3.2-1b, ms per step over
# Llama-3.2-1B's parameters; rows in bench/results/h200/kernels.md), Triton vs the CUDA op: fp32 parameters 8.436
# vs 8.742 (the op 0.97x, slower); bf16 with fp32 masters 9.687 vs 8.788 (1.10x); bf16 with stochastic rounding
# 8.438 vs 7.282 (1.16x); torch AdamW(fused=True) on fp32 9.869. So bf16 takes the op and fp32 keeps Triton; fp16
# was not measured and keeps Triton.
_CUDA_OP_FASTER_DTYPES = frozenset({torch.bfloat16})


@contextlib.contextmanager
def forced_impl(name: str):
    """Steps taken inside run as if KERNELS_ADAMW_IMPL=name (one of auto, triton, cuda); for benchmarks and tests
    that compare the CUDA op with the Triton kernel in one process."""
    global _ADAMW_IMPL
    if name not in _ADAMW_IMPLS:
        raise ValueError(f"forced_impl: {name!r} is not one of {', '.join(_ADAMW_IMPLS)}")
    previous = _ADAMW_IMPL
    _ADAMW_IMPL = name
    try:
        yield
    finally:
        _ADAMW_IMPL = previous


_warned: set[str] = set()


_MISSING = "unknown"  # cuda_op_unavailable()'s answer, looked up once per process


def cuda_op_unavailable() -> str | None:
    """Why torch.ops.kernelwright.fused_adamw_ cannot be called here, or None when it can (cached)."""
    global _MISSING
    if _MISSING == "unknown":
        try:
            import kernels._C  # noqa: F401  (loading the library registers the ops)
        except ImportError as exc:
            _MISSING = (
                f"the CUDA extension kernels._C is not built ({exc}); build it where nvcc and a CUDA "
                "PyTorch exist: pip install --no-build-isolation ."
            )
        else:
            _MISSING = (
                None
                if hasattr(torch.ops.kernelwright, "fused_adamw_")
                else ("kernels._C is loaded but does not register kernelwright::fused_adamw_ (a stale build?)")
            )
    return _MISSING


_HAS_TORCH_FUSED = hasattr(torch, "_fused_adamw_")


def adamw_impl(param: torch.Tensor, state_dtype: torch.dtype = torch.float32) -> tuple[str, str]:
    """(implementation, why) for a bucket whose first parameter is `param` and whose moments are `state_dtype`:
    'cuda', 'triton', 'torch_cpu' or 'reference'."""
    if not param.is_cuda:
        if use_triton(param):
            return "triton", f"parameters on {param.device.type}: the CUDA op needs CUDA tensors"
        if (
            param.device.type == "cpu"
            and param.dtype == torch.float32
            and state_dtype == torch.float32
            and current_backend() == "auto"
            and _HAS_TORCH_FUSED
        ):
            # Not a kernel of ours: on a CPU, torch's own fused AdamW (the one torch.optim.AdamW(fused=True) and
            # Hugging Face's adamw_torch_fused run) does the same math in one pass over each tensor, where the
            # reference's ~12 tensor ops per parameter cost ~8% of a step of the tiny preset (bench_train). fp32
            # parameters only: other dtypes keep an fp32 master copy or round stochastically (the reference).
            return "torch_cpu", "parameters on cpu: torch's fused CPU AdamW (KERNELS_BACKEND=reference for ours)"
        return "reference", f"parameters on {param.device.type}: the CUDA op needs CUDA tensors"
    if _ADAMW_IMPL == "triton":
        return ("triton" if use_triton(param) else "reference"), "KERNELS_ADAMW_IMPL=triton"
    if state_dtype != torch.float32:
        return ("triton" if use_triton(param) else "reference"), f"{state_dtype} moments: the CUDA op keeps fp32 ones"
    missing = cuda_op_unavailable()
    if _ADAMW_IMPL == "cuda":
        if missing is None:
            return "cuda", "KERNELS_ADAMW_IMPL=cuda"
        if missing not in _warned:
            _warned.add(missing)
            warnings.warn(
                f"kernels.adamw: KERNELS_ADAMW_IMPL=cuda but {missing}; using the Triton kernel", stacklevel=3
            )
        return ("triton" if use_triton(param) else "reference"), f"KERNELS_ADAMW_IMPL=cuda but {missing}"
    if missing is None and param.dtype in _CUDA_OP_FASTER_DTYPES:
        return "cuda", f"KERNELS_ADAMW_IMPL=auto and the CUDA op was measured faster for {param.dtype} parameters"
    why = missing or f"no committed GPU measurement shows the CUDA op faster than Triton for {param.dtype} parameters"
    return ("triton" if use_triton(param) else "reference"), f"KERNELS_ADAMW_IMPL=auto keeps Triton: {why}"


def _step_bucket(params, grads, exp_avgs, exp_avg_sqs, steps, masters, *, tables, **hyper) -> None:
    """The dispatch point for one bucket: the CUDA C++ op or Triton on CUDA (`adamw_impl`), the reference on CPU
    unless Triton is forced."""
    impl, _ = adamw_impl(params[0], exp_avgs[0].dtype)
    if impl == "cuda":
        torch.ops.kernelwright.fused_adamw_(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            masters or [],
            steps,
            hyper["lr"],
            hyper["beta1"],
            hyper["beta2"],
            hyper["eps"],
            hyper["weight_decay"],
            hyper["maximize"],
            hyper["stochastic_rounding"],
        )
    elif impl == "triton":
        fused_adamw_step(params, grads, exp_avgs, exp_avg_sqs, steps, masters, tables=tables, **hyper)
    elif impl == "torch_cpu":  # exactly torch.optim.AdamW(fused=True), which wants grads in the parameters' dtype
        grads = [g if g.dtype == torch.float32 else g.float() for g in grads]
        torch._foreach_add_(steps, 1)
        torch._fused_adamw_(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            lr=hyper["lr"],
            beta1=hyper["beta1"],
            beta2=hyper["beta2"],
            weight_decay=hyper["weight_decay"],
            eps=hyper["eps"],
            amsgrad=False,
            maximize=hyper["maximize"],
            grad_scale=None,
            found_inf=None,
        )
    else:
        _adamw_bucket_ref(params, grads, exp_avgs, exp_avg_sqs, steps, masters, **hyper)


# ---------------------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------------------


def adamw_step_ref(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool = False,
) -> None:
    """Plain-PyTorch AdamW step, in place, mirroring torch.optim.AdamW's single-tensor path op for op.

    steps are incremented first. Math in fp32 (params of another dtype are updated through an fp32 copy and
    cast back with round-to-nearest); bf16 exp_avgs/exp_avg_sqs likewise (the update reads their fp32 values and
    stores them rounded to nearest even, after the parameter's update used the unrounded ones).
    Bias corrections are fp64 tensor ops on the step tensors, so no device value is read on the host.
    """
    decay = 1.0 - lr * weight_decay
    for p, g, m_state, v_state, s in zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True):
        s += 1
        g = g.to(torch.float32)
        m = m_state if m_state.dtype == torch.float32 else m_state.float()
        v = v_state if v_state.dtype == torch.float32 else v_state.float()
        if maximize:
            g = -g
        w = p if p.dtype == torch.float32 else p.float()
        w.mul_(decay)
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        t = s.to(torch.float64)
        bias_correction1 = 1.0 - torch.pow(beta1, t)
        bias_correction2_sqrt = (1.0 - torch.pow(beta2, t)).sqrt().to(torch.float32)
        neg_step_size = (-lr / bias_correction1).to(torch.float32)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        w.addcdiv_(m * neg_step_size, denom)  # = w - step_size * m / denom, torch's (value * m) / denom order
        if w is not p:
            p.copy_(w)
        if m is not m_state:
            m_state.copy_(m)
            v_state.copy_(v)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), without overflowing int64 (split c into 16-bit halves)."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _hash32_ref(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _stochastic_round_bf16_ref(w: torch.Tensor, step: torch.Tensor, t: int) -> torch.Tensor:
    """bf16 stochastic rounding of fp32 w with the kernel's random bits (same hash, same seeds)."""
    n = step.to(torch.int64).reshape(1) & _MASK32
    seed = _hash32_ref(n ^ _hash32_ref(torch.full_like(n, (t + _GOLDEN) & _MASK32)))  # (1,)
    offs = torch.arange(w.numel(), device=w.device, dtype=torch.int64) & _MASK32  # (N,)
    noise = _hash32_ref(offs ^ seed) & 0xFFFF  # (N,)
    bits = (w.reshape(-1).view(torch.int32).to(torch.int64) & _MASK32) + noise
    bits = bits & 0xFFFF0000
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    rounded = bits.view(torch.float32).reshape(w.shape)
    return torch.where(torch.isnan(w), w, rounded).to(torch.bfloat16)


def _adamw_bucket_ref(params, grads, exp_avgs, exp_avg_sqs, steps, masters, *, stochastic_rounding=False, **hyper):
    """The optimizer's reference path for one bucket: master copies and stochastic rounding around adamw_step_ref."""
    if masters is not None:
        adamw_step_ref(masters, grads, exp_avgs, exp_avg_sqs, steps, **hyper)
        for p, w in zip(params, masters):
            p.copy_(w)
    elif stochastic_rounding:
        ws = [p.float() for p in params]
        adamw_step_ref(ws, grads, exp_avgs, exp_avg_sqs, steps, **hyper)
        for t, (p, w, s) in enumerate(zip(params, ws, steps)):
            p.copy_(_stochastic_round_bf16_ref(w, s, t))
    else:
        adamw_step_ref(params, grads, exp_avgs, exp_avg_sqs, steps, **hyper)
