"""What recording a step switches on (`recording`): fake CUDA (bench.sm90), every Function of MODELS running its
model (`modelled_ops`; any other Triton launch raises), the module stack, bf16 autocast emulated for meta tensors
(`_AutocastEmulation`, `autocast_bf16`) and the aten recorder."""

from __future__ import annotations

import contextlib
import importlib
import warnings

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from bench.roofline import tracing
from bench.roofline.op_models import FlashAttentionModel, _adamw_model, _function_classes, _modelled_apply
from bench.roofline.tracing import BF16, EAGER_ATTENTION, Trace, _Recorder, _tag_graph, apply_model
from bench.sm90 import fake_cuda


@contextlib.contextmanager
def modelled_ops():
    """Every Function of MODELS runs its model; FusedAdamW's launcher too; any other Triton launch raises."""
    classes = _function_classes()
    saved_run, saved_interpreted = JITFunction.run, InterpretedFunction.run
    adamw_module = importlib.import_module("kernels.adamw")
    saved_adamw = adamw_module.fused_adamw_step

    def refuse(kernel, *args, **kwargs):
        raise RuntimeError(f"bench.roofline: unmodelled Triton launch {kernel.fn.__name__}: give its op a cost model")

    attention = importlib.import_module("trainer.model.attention")
    saved_attend = attention.AttentionPlan.attend

    def attend(plan, q, k, v, window, sinks=None):
        return (_flex_as_flash if plan.backend == "flex" else saved_attend)(plan, q, k, v, window, sinks)

    try:
        for name, cls in classes.items():
            cls.apply = _modelled_apply(name)
        JITFunction.run = InterpretedFunction.run = refuse  # compiled or interpreted (TRITON_INTERPRET=1)
        adamw_module.fused_adamw_step = _adamw_model
        attention.AttentionPlan.attend = attend
        yield
    finally:
        for cls in classes.values():
            if "apply" in cls.__dict__:
                del cls.apply
        JITFunction.run, InterpretedFunction.run = saved_run, saved_interpreted
        adamw_module.fused_adamw_step = saved_adamw
        attention.AttentionPlan.attend = saved_attend


def _flex_as_flash(plan, q, k, v, window, sinks=None):
    """Our attention's flex path (trainer/model/attention.py: what CUDA runs for sliding windows and attention sinks,
    a higher-order op the recorder cannot run) as the flash-attention model with the layer's window (flex's block
    mask skips the blocks outside it, as flash attention's local window does), and with sinks the rescale by
    sigmoid(lse - sink) as ours computes it from flex's log-sum-exp."""
    from trainer.model.attention import _effective

    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
    out = apply_model(FlashAttentionModel(causal=True, window=_effective(window, plan.seq_len)), qt, kt, vt)
    if sinks is not None:  # attention's own work (not RoPE's, as ops in an Attention module would count)
        with tracing._TRACE.inside(EAGER_ATTENTION):
            lse = torch.empty(out.shape[:-1], dtype=torch.float32, device=out.device)
            out = out * torch.sigmoid(lse - sinks.to(lse.dtype)[:, None])[..., None].to(out.dtype)
    return out.transpose(1, 2)


class _AutocastEmulation(TorchFunctionMode):
    """bf16 autocast for meta tensors (module docstring): fp32 operands of the lower-precision ops are cast with
    .to() where autocast("cuda") is on; SDPA becomes the flash-attention model. Also tags the autograd nodes each
    call creates with their category (`_tag_graph`)."""

    _LOW = {
        F.linear,
        torch.matmul,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.mm,
        torch.Tensor.mm,
        torch.addmm,
        torch.bmm,
        torch.Tensor.bmm,
        torch._grouped_mm,  # transformers 5's grouped_mm experts: autocast casts its operands as a matmul's
        F.scaled_dot_product_attention,
    }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self._call(func, args, kwargs)
        if tracing._TRACE is not None and torch.is_grad_enabled():
            _tag_graph(tracing._TRACE.module_stack[-1] if tracing._TRACE.module_stack else None, out)
        return out

    def _call(self, func, args, kwargs):
        if func not in self._LOW:
            return func(*args, **kwargs)
        if torch.is_autocast_enabled("cuda"):

            def cast(t):
                return t.to(BF16) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t

            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in kwargs.items()}
        if func is F.scaled_dot_product_attention:
            # Both models pass is_causal=True (or a causal mask) at these inputs: no padding, one document per row; a
            # sliding layer's mask (transformers' `sliding_window` on the attention module running) as flash
            # attention's local window.
            windows = tracing._TRACE.attention_windows if tracing._TRACE is not None else []
            window = windows[-1] if windows else None
            return apply_model(FlashAttentionModel(causal=True, window=window), *args[:3])
        return func(*args, **kwargs)


@contextlib.contextmanager
def autocast_bf16():
    """autocast("cuda", bf16) as a flag (torch.autocast refuses "cuda" without a CUDA build)."""
    enabled, dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", BF16)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", dtype)


@contextlib.contextmanager
def module_tracking(trace: Trace):
    """The trace's module stack: the class names of the modules running, innermost last; and the sliding windows of
    the attention modules running that name one (transformers' `sliding_window` attribute: an int, or None on a
    global layer)."""

    def pre(module, args):
        trace.module_stack.append(type(module).__name__)
        if "sliding_window" in vars(module):
            trace.attention_windows.append(module.sliding_window)

    def post(module, args, output):
        trace.module_stack.pop()
        if "sliding_window" in vars(module):
            trace.attention_windows.pop()

    h1 = torch.nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = torch.nn.modules.module.register_module_forward_hook(post)
    try:
        yield
    finally:
        h1.remove()
        h2.remove()


@contextlib.contextmanager
def recording(trace: Trace):
    """Record into `trace`: aten ops, modelled ops, modules, emulated autocast's casts; fake CUDA throughout."""
    tracing._TRACE = trace
    try:
        with (
            fake_cuda(),
            modelled_ops(),
            module_tracking(trace),
            _AutocastEmulation(),
            _Recorder(trace),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")  # torch.autocast("cuda", enabled=False) warns without CUDA
            yield trace
    finally:
        tracing._TRACE = None
