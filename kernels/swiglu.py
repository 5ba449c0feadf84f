"""SwiGLU's gating: out = silu(gate) * up, fused forward and backward in Triton (Llama's MLP between its projections).

Math (elementwise; g = gate, u = up; all arithmetic in fp32 whatever the storage dtype)
    forward   s     = sigmoid(g) = 1 / (1 + exp(-g))
              out   = g * s * u                              (one rounding: the final cast to gate's dtype)
    backward  dup   = dout * g * s
              dgate = dout * u * s * (1 + g * (1 - s))       (d silu / dg = s + g s (1 - s))
The backward recomputes s from the saved inputs (gate and up, which autograd holds anyway as the outputs
of the two projections) instead of saving silu(gate): no extra activation memory, one exp per element.

HF's LlamaMLP computes act_fn(gate) * up in the activation dtype (two roundings in bf16: silu, then the
product); we round once, so in bf16/fp16 we are at least as close to the exact fp32 result as HF and differ
from it by up to about one unit in the last place; in fp32 the two agree to rounding.

Bytes moved per element (s = element size): forward 3s (read gate and up, write out); backward 5s (read
dout, gate and up, write dgate and dup). Both are the minimum for these inputs and outputs: nothing is
read twice and nothing but the outputs is written.

`swiglu_linear(gate, up, weight)` = F.linear(swiglu(gate, up), weight) (Llama's down projection, no bias) keeps
no act for the weight gradient: its backward computes dact = dout @ weight first, then the backward kernel with
STORE_ACT also writes act (over dact: 3s read + 3s written), then dweight = dout^T @ act. A second forward pass to
recompute act would move 3s more (2s of them its reads of gate and up): 1.5 ms of the modelled Llama-3.2-1B step at
4 x 2048 on an H100 (bench/roofline/). Values and gradients are bit for bit F.linear(swiglu(gate, up), weight)'s.

Launch strategy: the three tensors are flattened to 1-D (contiguous; a stride-0 dout from .sum().backward()
is materialised first) and each program covers BLOCK consecutive elements with int64 offsets. On CUDA
BLOCK = 2048 over 8 warps is 8 elements per thread per tensor, one 16-byte vector access in bf16 (chosen
by that arithmetic, not yet timed on a GPU: bench/bench_swiglu.py is the place to revisit it); registers
and spills: `python -m bench.sm90 --only swiglu`. Under the interpreter (~37 us per program) one program
covers up to 65536 elements. The gradients are written into fresh tensors, never into gate or up, so the
caller's tensors stay intact (liger-kernel writes them in place).

Test:  python -m pytest tests/kernels/test_swiglu.py -q   (CPU: Triton interpreter)
Bench: python bench/bench_swiglu.py                       (GPU: Llama-3-8B's MLP; --quick for a CPU smoke run)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._dispatch import HAS_TRITON, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# See the module docstring: 8 elements per thread at 8 warps, a 16-byte bf16 vector per tensor.
_GPU_BLOCK = 2048
_GPU_WARPS = 8
# Interpreter: it pays ~37 us per program, so one program covers many elements.
_CPU_MAX_BLOCK = 65536
# The gate's activation, the kernels' ACT: SwiGLU's silu, or GeGLU's tanh GELU (kernels/geglu.py)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}

if HAS_TRITON:

    @triton.jit
    def _act(g, ACT: tl.constexpr):
        """(act(g), act'(g)) in fp32: silu, g s and s (1 + g (1 - s)) with s = sigmoid(g); or the tanh GELU,
        0.5 g (1 + tanh(z)) = g s with s = sigmoid(2 z), z = k (g + c g^3) (no 1 + tanh to cancel for g << 0), and
        s + 2 g s (1 - s) k (1 + 3 c g^2), 1 - s = sigmoid(-2 z)."""
        if ACT == 0:
            s = tl.sigmoid(g)
            a = g * s
            return a, s + a * (1.0 - s)
        else:
            g2 = g * g
            z2 = 1.5957691216057308 * (g + 0.044715 * g2 * g)  # 2 z, 2 k = 2 sqrt(2 / pi)
            s = tl.sigmoid(z2)
            a = g * s
            # 1 - s as sigmoid(-2 z): 1 - s itself cancels where s -> 1 (it doubled the error at g = 5)
            return a, s + 1.5957691216057308 * a * tl.sigmoid(-z2) * (1.0 + 3.0 * 0.044715 * g2)

    @triton.jit
    def _swiglu_fwd_kernel(
        gate_ptr,  # (n,) contiguous gate projection
        up_ptr,  # (n,) contiguous up projection
        out_ptr,  # (n,) contiguous act(gate) * up, gate's dtype
        n,  # number of elements
        BLOCK: tl.constexpr,
        ACT: tl.constexpr,  # ACTIVATIONS: 0 silu (SwiGLU), 1 tanh GELU (GeGLU)
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if ACT == 0:
            a = g * tl.sigmoid(g)
        else:  # the tanh GELU as g sigmoid(2 z), _act's very operations (STORE_ACT's act is bit for bit this out)
            g2 = g * g
            a = g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g2 * g))
        tl.store(out_ptr + offs, (a * u).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(
        dout_ptr,  # (n,) contiguous gradient of out
        gate_ptr,  # (n,) saved gate
        up_ptr,  # (n,) saved up
        dgate_ptr,  # (n,) contiguous gradient of gate (written)
        dup_ptr,  # (n,) contiguous gradient of up (written)
        act_ptr,  # (n,) contiguous act(gate) * up (written when STORE_ACT; may be dout_ptr: each lane reads first)
        n,
        BLOCK: tl.constexpr,
        STORE_ACT: tl.constexpr,  # also write the forward's output, for a weight gradient that needs it
        ACT: tl.constexpr,
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        dout = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        a, da = _act(g, ACT)
        tl.store(dup_ptr + offs, (dout * a).to(dup_ptr.dtype.element_ty), mask=mask)
        tl.store(dgate_ptr + offs, (dout * u * da).to(dgate_ptr.dtype.element_ty), mask=mask)
        if STORE_ACT:
            # act(g) * u as the forward kernel rounds it (the same products, one cast): bit for bit its out
            tl.store(act_ptr + offs, (a * u).to(act_ptr.dtype.element_ty), mask=mask)


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("kernels.swiglu: the Triton path needs triton (pip install triton)")


def launch_config(n: int, on_cuda: bool) -> tuple[int, int]:
    """(BLOCK, num_warps) for n elements (module docstring)."""
    if on_cuda:
        return _GPU_BLOCK, _GPU_WARPS
    return min(_CPU_MAX_BLOCK, triton.next_power_of_2(max(n, 1))), 4


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """Launch the forward on same-shaped gate and up (`act`: one of ACTIVATIONS). Returns out (gate's shape and
    dtype). No autograd."""
    _require_triton()
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)  # (...,)
    n = gate.numel()
    if n == 0:
        return out
    block, warps = launch_config(n, gate.is_cuda)
    _swiglu_fwd_kernel[(triton.cdiv(n, block),)](gate, up, out, n, BLOCK=block, ACT=ACTIVATIONS[act], num_warps=warps)
    return out


def _launch_bwd(dout, gate, up, store_act: bool, act: str):
    """The backward kernel over contiguous copies: (dgate, dup, dout), with act written over dout when store_act."""
    _require_triton()
    dout, gate, up = dout.contiguous(), gate.contiguous(), up.contiguous()
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)  # (...,), (...,)
    n = gate.numel()
    if n > 0:
        block, warps = launch_config(n, gate.is_cuda)
        grid = (triton.cdiv(n, block),)
        _swiglu_bwd_kernel[grid](
            dout, gate, up, dgate, dup, dout, n, BLOCK=block, STORE_ACT=store_act, ACT=ACTIVATIONS[act], num_warps=warps
        )
    return dgate, dup, dout


def swiglu_bwd(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: str = "silu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward. Returns (dgate, dup) in gate's shape and dtype, fresh tensors. No autograd."""
    dgate, dup, _ = _launch_bwd(dout, gate, up, store_act=False, act=act)
    return dgate, dup


def swiglu_bwd_act(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: str = "silu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward that also writes the forward's output: returns (dgate, dup, act), act = silu(gate) * up bit for bit
    as `swiglu_fwd` makes it, written over dout (a contiguous dout is consumed: act is that tensor). No autograd."""
    if dout.dtype != gate.dtype:
        raise ValueError(
            f"swiglu_bwd_act: dout ({dout.dtype}) must have gate's dtype ({gate.dtype}): act is written there"
        )
    return _launch_bwd(dout, gate, up, store_act=True, act=act)


class SwiGLUFunction(torch.autograd.Function):
    """Autograd over the Triton launchers; saves gate and up (the activation is recomputed in backward)."""

    @staticmethod
    def forward(ctx, gate, up, act="silu"):
        out = swiglu_fwd(gate, up, act)
        ctx.save_for_backward(gate, up)
        ctx.act = act
        return out

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dgate, dup = swiglu_bwd(dout, gate, up, ctx.act)
        return (dgate if ctx.needs_input_grad[0] else None), (dup if ctx.needs_input_grad[1] else None), None


class SwiGLULinearFunction(torch.autograd.Function):
    """F.linear(silu(gate) * up, weight), no bias (Llama's down projection over its gating). Saves gate, up and weight,
    not act = silu(gate) * up: backward computes dact = dout @ weight first, then one kernel pass reads dact, gate and
    up and writes dgate, dup and act (over dact), and the weight gradient dout^T @ act reads that act. The matmuls are
    the ones autograd's mm backward runs, on the same operands: bit for bit F.linear(swiglu(gate, up), weight)."""

    @staticmethod
    def forward(ctx, gate, up, weight, act="silu"):
        ctx.save_for_backward(gate, up, weight)
        ctx.act = act
        # the caller cast to one dtype (as autocast would); our matmul runs in it
        with torch.autocast(gate.device.type, enabled=False):
            return F.linear(swiglu_fwd(gate, up, act), weight)  # (..., H), act (..., I) dies here

    @staticmethod
    def backward(ctx, dout):
        gate, up, weight = ctx.saved_tensors
        need_gate, need_up, need_weight, _ = ctx.needs_input_grad
        dout2d = dout.reshape(-1, dout.shape[-1])  # (M, H)
        dgate = dup = dweight = None
        with torch.autocast(dout.device.type, enabled=False):
            if need_gate or need_up:
                dact = dout2d.mm(weight).view(gate.shape)  # (..., I), as mm's backward forms it
                if need_weight:
                    dgate, dup, act = swiglu_bwd_act(dact, gate, up, ctx.act)  # act written over dact
                else:
                    dgate, dup = swiglu_bwd(dact, gate, up, ctx.act)
                del dact
            elif need_weight:
                act = swiglu_fwd(gate, up, ctx.act)
            if need_weight:
                dweight = dout2d.t().mm(act.reshape(-1, act.shape[-1]))  # (H, I)
        return (dgate if need_gate else None), (dup if need_up else None), dweight, None


def _check_args(gate, up, op: str = "swiglu") -> None:
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor) or t.dtype not in _DTYPES:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{op}: {name} must be a float32, bfloat16 or float16 tensor, got {got}")
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(
            f"{op}: gate and up must share shape, dtype and device, got {tuple(gate.shape)} {gate.dtype} "
            f"{gate.device} and {tuple(up.shape)} {up.dtype} {up.device}"
        )


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, any shape, fp32 math, output in gate's dtype.

    CUDA tensors run the Triton kernels, CPU tensors the reference (see `kernels._dispatch`)."""
    _check_args(gate, up)
    if not use_triton(gate, up):
        return swiglu_ref(gate, up)
    return SwiGLUFunction.apply(gate, up)


def swiglu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(swiglu(gate, up), weight) (no bias), values and gradients bit for bit, without keeping the
    (..., intermediate) silu(gate) * up for backward (`SwiGLULinearFunction`).

    Under autocast the weight is cast to the autocast dtype, as F.linear's autocast would. Where Triton does not run
    (see `kernels._dispatch`), or gate is not in the dtype the matmul runs in, it is F.linear(swiglu(gate, up),
    weight) as written."""
    _check_args(gate, up)
    return glu_linear(gate, up, weight, "silu", swiglu)


def glu_linear(gate, up, weight, act: str, glu) -> torch.Tensor:
    """`swiglu_linear` for the activation `act` (`glu`: its public gating op, the fallback)."""
    dtype = weight.dtype
    if torch.is_autocast_enabled(gate.device.type):
        dtype = torch.get_autocast_dtype(gate.device.type)
        if weight.dtype in _DTYPES and weight.dtype != dtype:
            weight = weight.to(dtype)  # as autocast casts F.linear's operands
    if not use_triton(gate, up) or gate.dtype != dtype or weight.dtype != dtype or weight.dim() != 2:
        return F.linear(glu(gate, up), weight)
    return SwiGLULinearFunction.apply(gate, up, weight, act)


def swiglu_linear_ref(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch F.linear(swiglu_ref(gate, up), weight); autograd-differentiable."""
    return F.linear(swiglu_ref(gate, up), weight)


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch silu(gate) * up: fp32 math (fp64 for fp64 inputs), one cast back; autograd-differentiable."""
    compute = torch.promote_types(gate.dtype, torch.float32)
    return (F.silu(gate.to(compute)) * up.to(compute)).to(gate.dtype)
