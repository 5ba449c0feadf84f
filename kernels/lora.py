"""LoRA projections fused per input: the q/k/v (or any) projections of one input, and a whole SwiGLU MLP, each one
autograd Function that keeps less than peft's separate modules (Unsloth's `fast_lora` idea, written here from the math).

Math. A LoRA projection (Hu et al. 2021) of an input x with frozen base weight W (out x in, optionally 4-bit codes
dequantized per use), frozen bias b, adapter A (r x in), B (out x r), scaling s and dropout p:

    forward    y  = (x W^T + b) + s ((drop(x) A^T) B^T)                 peft's order of operations, exactly
    backward   dz = s dy;  dB = dz^T xa;  dxa = dz B;  dA = dxa^T drop(x);  dx = dy W + drop'(dxa A)
               with xa = drop(x) A^T (tokens x r), drop' dropout's backward (the same mask, the same 1/(1-p))

`lora_projections(x, [q, k, v])` runs that for several projections of one x (attention's inputs);
`lora_mlp(x, gate, up, down)` runs down(swiglu(gate(x), up(x))) with all three adapted (SwiGLU by `kernels.swiglu`).

What is kept for backward, against peft's modules (per projection, n = tokens):
- peft keeps the dropped copy drop(x) (n x in, for dA) and dropout's mask (n x in: a bool on CUDA, a tensor of x's
  dtype on the CPU), per projection, so q, k and v keep three of each of the same x; down_proj keeps them of the
  (n x intermediate) SwiGLU output. Under autocast over fp32 weights F.linear keeps the low-precision cast of every
  frozen base weight (one per layer and projection: a bf16 copy of the model) for its input gradient.
- here: x once per group, the thin xa = drop(x) A^T (n x r) per projection, and the random generator's state before
  each dropout (a few kB). Backward restores that state and draws the same mask again (as activation checkpointing
  replays dropout), recasts or dequantizes each base weight again, and, in the MLP, recomputes swiglu(gate, up)
  (gate and up are kept, as SwiGLU's backward needs them).
With dropout 0 and no autocast peft keeps little more than this (x is the same tensor for every projection); the
difference is the dropped copies and masks (for Llama-3.1-8B, 5 bytes per element of the three q/k/v inputs, the
o_proj input, two MLP inputs and the 14336-wide down_proj input in bf16 on CUDA: bench/roofline/lora_stacks.py).

Exactness (tests/kernels/test_lora.py, tests/trainer/model/test_fused_lora.py): every matmul is the one autograd's
mm backward runs on the same operands (dB = dz^T xa, dA = dxa^T drop(x) as mm_mat2_backward forms them for a
contiguous weight), dropout is PyTorch's own on the same generator state, and the input gradient's contributions are
summed in the order autograd's engine sums peft's (the last projection first, its adapter before its base): in fp32
values and gradients equal peft's bit for bit, with dropout too. Under autocast the casts are peft's and autocast's
(`lora_dtype`, `base_returns_input_dtype` below), so low precision is bit for bit as well where the matmuls are.

Dtypes (what the caller states, to reproduce peft's layers): the matmuls run in the autocast dtype when autocast is on
for x's device, else in x's dtype; `lora_dtype`: the dtype the adapter's input is cast to before dropout (peft casts
to lora_A's dtype; its bitsandbytes layer under autocast does not cast: None);
`LoRAProjection.base_returns_input_dtype`: the base output is cast to the input's dtype before the add (bitsandbytes'
4-bit layers return their input's dtype).

No Triton kernel of its own: the work is matmuls (cuBLAS), dropout (PyTorch's), SwiGLU (`kernels.swiglu`) and, for a
4-bit base, the caller's dequantize (`kernels.dequantize_4bit` in trainer/model/quant.py). `lora_projections_ref` and
`lora_mlp_ref` are the same math as plain autograd (peft's layers written out), imported by tests and the benchmark.

Test:  python -m pytest tests/kernels/test_lora.py -q
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .swiglu import swiglu


@dataclass(frozen=True)
class LoRAProjection:
    """One projection: the frozen base `weight` (out, in) (or packed 4-bit codes that `dequantize` turns into it),
    its frozen `bias`, the adapter `lora_A` (r, in) and `lora_B` (out, r) with its `scaling` (lora_alpha / r), or no
    adapter (None: the base alone, a layer peft did not target that shares the input with ones it did).
    `base_returns_input_dtype`: the base output is cast to the input's dtype before the add, as bitsandbytes' 4-bit
    layers return it (else it stays in the matmul dtype, as F.linear's)."""

    weight: torch.Tensor
    lora_A: torch.Tensor | None
    lora_B: torch.Tensor | None
    scaling: float = 1.0
    bias: torch.Tensor | None = None
    dequantize: Callable[[torch.Tensor], torch.Tensor] | None = None
    base_returns_input_dtype: bool = False

    def base_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The base weight in `dtype`: dequantized again (a 4-bit base) or cast again at each use, never kept."""
        weight = self.weight if self.dequantize is None else self.dequantize(self.weight)
        return weight.to(dtype)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def _rng_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


@contextlib.contextmanager
def _replayed_rng(device: torch.device, state: torch.Tensor):
    """The default generator of `device` set to `state` for the block, and given back as it was after it."""
    devices = [] if device.type == "cpu" else [device]
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        if device.type == "cpu":
            torch.set_rng_state(state)
        else:
            torch.get_device_module(device.type).set_rng_state(state, device)
        yield


# ---- one group of projections of one input, without autograd -------------------------------------------------
class _Group:
    """Forward and backward of the projections `projs` of one input (no autograd): what both Functions share.
    `lora_dtype`, `dropout`: as in the module docstring; `dtype`: the matmul dtype."""

    def __init__(self, projs: Sequence[LoRAProjection], dropout: float, lora_dtype, dtype: torch.dtype):
        self.projs, self.dropout, self.lora_dtype, self.dtype = list(projs), dropout, lora_dtype, dtype
        self.rng_states: list[torch.Tensor] = []

    def _lora_input(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's input before dropout: x cast to lora_dtype as peft casts it; x itself where no dropout
        follows and that cast and the matmul's cast back are exact (a bf16 x through fp32 adapters under autocast:
        bf16 -> fp32 -> bf16, and the gradient's fp32 round trip), so neither direction moves the copies."""
        lossless = torch.promote_types(x.dtype, self.lora_dtype or x.dtype) == self.lora_dtype
        if self.lora_dtype is None or (not self.dropout and x.dtype == self.dtype and lossless):
            return x
        return x.to(self.lora_dtype)

    def forward(self, x: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The outputs and each projection's xa = drop(x) A^T (kept for dB), in peft's order of operations."""
        ys, xas = [], []
        x_lora = self._lora_input(x)
        for proj in self.projs:
            bias = None if proj.bias is None else proj.bias.to(self.dtype)
            y = F.linear(x.to(self.dtype), proj.base_weight(self.dtype), bias)
            if proj.base_returns_input_dtype:
                y = y.to(x.dtype)
            if proj.lora_A is None:
                ys.append(y)
                xas.append(None)
                continue
            if self.dropout:
                self.rng_states.append(_rng_state(x.device))
                dropped = F.dropout(x_lora, self.dropout, training=True)
            else:
                dropped = x_lora
            xa = F.linear(dropped.to(self.dtype), proj.lora_A.to(self.dtype))  # (..., r)
            ys.append(y + F.linear(xa, proj.lora_B.to(self.dtype)) * proj.scaling)
            xas.append(xa)
        return ys, xas

    def backward(self, x: torch.Tensor, xas, dys, needs_dx: bool, needs_adapter: bool):
        """dx and each projection's (dA, dB) (None when not needed), from the outputs' gradients `dys`."""
        dtype, x_lora = self.dtype, self._lora_input(x)
        dx, grads = None, [None] * len(self.projs)
        draws = [j for j, proj in enumerate(self.projs) if proj.lora_A is not None]  # whose dropout drew
        for i in reversed(range(len(self.projs))):  # autograd's engine runs the last projection's nodes first
            proj, dy = self.projs[i], dys[i].to(dtype)
            dy2d = dy.reshape(-1, dy.shape[-1])  # (n, out)
            if proj.lora_A is None:
                if needs_dx:
                    d_base = dy2d.mm(proj.base_weight(dtype)).view(x.shape).to(x.dtype)
                    dx = d_base if dx is None else dx + d_base
                continue
            dz2d = dy2d * proj.scaling
            lora_A, lora_B = proj.lora_A.to(dtype), proj.lora_B.to(dtype)
            xa2d = xas[i].reshape(-1, xas[i].shape[-1])  # (n, r)
            dxa2d = dz2d.mm(lora_B)  # (n, r)
            with contextlib.ExitStack() as stack:
                if self.dropout:
                    stack.enter_context(_replayed_rng(x.device, self.rng_states[draws.index(i)]))
                    stack.enter_context(torch.enable_grad())
                    leaf = x_lora.detach().requires_grad_()
                    dropped = F.dropout(leaf, self.dropout, training=True)  # the forward's mask, drawn again
                else:
                    dropped = x_lora
                if needs_adapter:
                    dropped_dt = dropped.detach().to(dtype)
                    dA = dxa2d.t().mm(dropped_dt.reshape(-1, dropped_dt.shape[-1]))  # (r, in)
                    dB = dz2d.t().mm(xa2d)  # (out, r)
                    grads[i] = (dA.to(proj.lora_A.dtype), dB.to(proj.lora_B.dtype))
                    del dropped_dt
                if not needs_dx:
                    continue
                d_dropped = dxa2d.mm(lora_A).view(x.shape[:-1] + (-1,)).to(dropped.dtype)  # (..., in)
                if self.dropout:
                    (d_dropped,) = torch.autograd.grad(dropped, leaf, d_dropped)
            d_lora = d_dropped.to(x.dtype)
            dx = d_lora if dx is None else dx + d_lora
            d_base = dy2d.mm(proj.base_weight(dtype)).view(x.shape).to(x.dtype)
            dx = dx + d_base
        return dx, grads


def _flat(projs: Sequence[LoRAProjection]) -> list[torch.Tensor]:
    """The adapter weights autograd differentiates, in order (A, B per adapted projection)."""
    return [t for p in projs if p.lora_A is not None for t in (p.lora_A, p.lora_B)]


def _flat_grads(projs: Sequence[LoRAProjection], grads) -> list[torch.Tensor | None]:
    """(dA, dB) per adapted projection, in `_flat`'s order (None where not asked for)."""
    return [g for p, pair in zip(projs, grads) if p.lora_A is not None for g in (pair or (None, None))]


class LoRAProjectionsFunction(torch.autograd.Function):
    """The projections of one input (see the module docstring); inputs: x, the _Group, then A and B per projection."""

    @staticmethod
    def forward(ctx, x, group: _Group, *adapters):
        ys, xas = group.forward(x)
        ctx.group = group
        ctx.save_for_backward(x, *xas)
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):
        x, *xas = ctx.saved_tensors
        group = ctx.group
        with torch.autocast(x.device.type, enabled=False):
            dx, grads = group.backward(x, xas, dys, ctx.needs_input_grad[0], any(ctx.needs_input_grad[2:]))
        return dx, None, *_flat_grads(group.projs, grads)


class LoRAMLPFunction(torch.autograd.Function):
    """down(swiglu(gate(x), up(x))) with all three adapted; inputs: x, the gate/up _Group, the down _Group, then A and
    B of gate, up and down. Keeps x, gate, up and the three xa; swiglu(gate, up) is recomputed in backward."""

    @staticmethod
    def forward(ctx, x, gate_up: _Group, down: _Group, *adapters):
        (gate, up), xas = gate_up.forward(x)
        act = swiglu(gate, up)
        (out,), (xa_down,) = down.forward(act)
        ctx.groups = gate_up, down
        ctx.save_for_backward(x, gate, up, *xas, xa_down)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, gate, up, xa_gate, xa_up, xa_down = ctx.saved_tensors
        gate_up, down = ctx.groups
        needs_adapter = any(ctx.needs_input_grad[3:])
        with torch.enable_grad():
            gate_leaf, up_leaf = gate.detach().requires_grad_(), up.detach().requires_grad_()
            act = swiglu(gate_leaf, up_leaf)  # the forward's act again
        with torch.autocast(x.device.type, enabled=False):
            d_act, down_grads = down.backward(act.detach(), [xa_down], [dout], True, needs_adapter)
            d_gate, d_up = torch.autograd.grad(act, (gate_leaf, up_leaf), d_act)
            del act, d_act
            dx, grads = gate_up.backward(x, [xa_gate, xa_up], [d_gate, d_up], ctx.needs_input_grad[0], needs_adapter)
        return dx, None, None, *_flat_grads(gate_up.projs, grads), *_flat_grads(down.projs, down_grads)


def _check(width: int | None, projs: Sequence[LoRAProjection], dropout: float) -> None:
    """Frozen bases, adapters that fit an input of `width` (None: not known here) and a dropout probability."""
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"lora: dropout must be in [0, 1), got {dropout}")
    for p in projs:
        if p.weight.requires_grad or (p.bias is not None and p.bias.requires_grad):
            raise ValueError("lora: the base weight and bias must be frozen (requires_grad=False)")
        if p.lora_A is None:
            continue
        if (width is not None and p.lora_A.shape[1] != width) or p.lora_B.shape[1] != p.lora_A.shape[0]:
            raise ValueError(
                f"lora: adapter shapes A {tuple(p.lora_A.shape)}, B {tuple(p.lora_B.shape)} do not fit an input "
                f"of width {width}"
            )


def lora_projections(
    x: torch.Tensor, projections: Sequence[LoRAProjection], dropout: float = 0.0, lora_dtype=None
) -> tuple[torch.Tensor, ...]:
    """(x W_i^T + b_i) + s_i (drop(x) A_i^T) B_i^T for each projection, one autograd Function (module docstring)."""
    _check(x.shape[-1], projections, dropout)
    group = _Group(projections, dropout, lora_dtype, _compute_dtype(x))
    return LoRAProjectionsFunction.apply(x, group, *_flat(projections))


def lora_mlp(
    x: torch.Tensor,
    gate: LoRAProjection,
    up: LoRAProjection,
    down: LoRAProjection,
    dropout: float = 0.0,
    lora_dtype=None,
) -> torch.Tensor:
    """down(swiglu(gate(x), up(x))) with each projection adapted, one autograd Function (module docstring)."""
    _check(x.shape[-1], (gate, up), dropout)
    _check(None, (down,), dropout)
    dtype = _compute_dtype(x)
    gate_up = _Group((gate, up), dropout, lora_dtype, dtype)
    down_group = _Group((down,), dropout, lora_dtype, dtype)
    return LoRAMLPFunction.apply(x, gate_up, down_group, *_flat((gate, up, down)))


# ---- references: peft's layers written out as plain autograd ---------------------------------------------------
def _projection_ref(x, proj: LoRAProjection, dropout: float, lora_dtype, training: bool) -> torch.Tensor:
    dtype = _compute_dtype(x)
    bias = None if proj.bias is None else proj.bias.to(dtype)
    y = F.linear(x.to(dtype), proj.base_weight(dtype), bias)
    if proj.base_returns_input_dtype:
        y = y.to(x.dtype)
    if proj.lora_A is None:
        return y
    x_lora = x if lora_dtype is None else x.to(lora_dtype)
    dropped = F.dropout(x_lora, dropout, training=training and dropout > 0)
    xa = F.linear(dropped.to(dtype), proj.lora_A.to(dtype))
    return y + F.linear(xa, proj.lora_B.to(dtype)) * proj.scaling


def lora_projections_ref(x, projections, dropout: float = 0.0, lora_dtype=None) -> tuple[torch.Tensor, ...]:
    """`lora_projections` as plain autograd: each projection as peft's Linear computes it, one after another."""
    return tuple(_projection_ref(x, p, dropout, lora_dtype, True) for p in projections)


def lora_mlp_ref(x, gate, up, down, dropout: float = 0.0, lora_dtype=None) -> torch.Tensor:
    """`lora_mlp` as plain autograd (peft's layers around `kernels.swiglu`)."""
    g, u = lora_projections_ref(x, (gate, up), dropout, lora_dtype)
    return _projection_ref(swiglu(g, u), down, dropout, lora_dtype, True)
