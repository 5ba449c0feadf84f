"""The trace of one modelled step: the ops recorded through it (bytes, FLOPs, launches; an op's time on a Device)
and the live tensor bytes (the peak, and where what is live at it was allocated). Every aten op on meta tensors is
recorded by a TorchDispatchMode (`_Recorder`) and categorised by the module or autograd node it runs for;
`ModelledOp` runs a cost model (bench/roofline/op_models.py) in place of an op that cannot run on meta tensors.
bench/roofline/__init__.py's docstring says how."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

CATEGORIES = (
    "matmuls",
    "attention",
    "norms",
    "rope",
    "mlp_activation",
    "residual_adds",
    "loss",
    "optimizer",
    "other_elementwise",
)
BF16 = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    bandwidth: float  # bytes/s, a measured device-to-device copy
    peak_flops: float  # FLOP/s, a measured bf16 dense matmul
    launch_s: float  # seconds per kernel launch (eager, no CUDA graphs)


DEVICES = {
    "h100": Device("H100 SXM", 3.0e12, 790e12, 4e-6),
    "h200": Device("H200", 4.3e12, 790e12, 4e-6),
}


@dataclasses.dataclass
class Op:
    name: str
    category: str
    phase: str
    bytes: float
    flops: float
    launches: int

    def seconds(self, dev: Device) -> float:
        return max(self.bytes / dev.bandwidth, self.flops / dev.peak_flops) + self.launches * dev.launch_s


def nbytes(t: torch.Tensor | None) -> int:
    """Distinct bytes a tensor spans (an expanded, stride-0 dimension counts once)."""
    if t is None or t.numel() == 0:
        return 0
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    return min(span, t.numel()) * t.element_size()


# ---------------------------------------------------------------------------------------------------------
# The trace: recorded ops and live memory
# ---------------------------------------------------------------------------------------------------------
class Trace:
    """Ops recorded through one step, and the live tensor bytes (peak) through it."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.phase = "forward"
        self.live = 0
        self.peak = 0
        self.suppress = 0  # > 0 inside a modelled op: its internal aten ops are not recorded
        self._storages: dict[int, weakref.ref] = {}
        self._labels: dict[int, tuple[str, int]] = {}  # storage key -> (where it was allocated, bytes)
        self.module_stack: list[str] = []
        self.attention_windows: list[int | None] = []  # sliding windows of the attention modules running (recording)
        self.modelled: list[str] = []  # the modelled ops running (their names), innermost last
        self.at_peak: dict[str, int] = {}  # live bytes by where they were allocated, at the (first) peak
        self.peak_phase = ""
        self.phase_peaks: dict[str, int] = {}  # the peak within each phase

    @contextlib.contextmanager
    def inside(self, module: str):
        """The ops recorded meanwhile count as run inside `module` (a name `category` reads, e.g. EAGER_ATTENTION)."""
        self.module_stack.append(module)
        try:
            yield
        finally:
            self.module_stack.pop()

    def where(self) -> str:
        """Where a storage allocated now comes from: the phase, then the modelled op running, else (forward) the
        innermost module or (backward) the autograd node."""
        if self.phase in ("setup", "optimizer"):
            return self.phase
        if self.modelled:
            return f"{self.phase}:{self.modelled[-1]}"
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            return f"backward:{node.name() if node is not None else '-'}"
        return f"forward:{self.module_stack[-1] if self.module_stack else '-'}"

    def track(self, t: torch.Tensor) -> None:
        """Count t's storage as live until it dies (once per storage)."""
        # is_meta, not .device: under fake CUDA a meta tensor's .device says cuda:0
        if not isinstance(t, torch.Tensor) or not t.is_meta:
            return
        s = t.untyped_storage()
        key = id(s)
        ref = self._storages.get(key)
        if ref is not None and ref() is s:
            return
        size = s.nbytes()
        self._storages[key] = weakref.ref(s)
        self._labels[key] = (self.where(), size)
        self.live += size
        self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), self.live)
        if self.live > self.peak:
            self.peak = self.live
            self.at_peak = {}
            for label, n in self._labels.values():
                self.at_peak[label] = self.at_peak.get(label, 0) + n
            self.peak_phase = self._labels[key][0]
        weakref.finalize(s, self._free, key, size)

    def elsewhere(self, t: torch.Tensor) -> None:
        """t's storage is not on the device (FSDP2 CPU offload's parameters): known, counted as 0 bytes, so that a view
        of it made in the step (a weight's transpose) does not count it there."""
        s = t.untyped_storage()
        key = id(s)
        if key not in self._storages:
            self._storages[key] = weakref.ref(s)
            self._labels[key] = ("host", 0)
            weakref.finalize(s, self._free, key, 0)

    def _free(self, key: int, size: int) -> None:
        self._storages.pop(key, None)
        self._labels.pop(key, None)
        self.live -= size

    def add(self, name: str, category: str, bytes_: float, flops: float = 0.0, launches: int = 1) -> None:
        category = "optimizer" if self.phase == "optimizer" else category
        self.ops.append(Op(name, category, self.phase, float(bytes_), float(flops), int(launches)))

    @contextlib.contextmanager
    def quiet(self, name: str = "-"):
        """Inside the modelled op `name`: its aten ops are not recorded (its allocations are, as its)."""
        self.suppress += 1
        self.modelled.append(name)
        try:
            yield
        finally:
            self.suppress -= 1
            self.modelled.pop()


_TRACE: Trace | None = None  # the trace being recorded (modelled ops write into it)


# ---------------------------------------------------------------------------------------------------------
# Categories
# ---------------------------------------------------------------------------------------------------------
MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addmv", "mv", "_grouped_mm"}
ROPE_OPS = {"mul", "add", "sub", "neg", "cat", "slice", "slice_backward", "index", "select", "split", "chunk"}
# the models' top level, where the loss runs: ours, transformers' Llama and Gemma 3, the transformers path's wrapper
_TOP_LEVEL = {"CausalLM", "LlamaForCausalLM", "Gemma3ForCausalLM", "TransformersModel"}


# transformers' explicit attention, named while it runs (stacks._named_eager), and our sinks' rescale after flex
# attention (recording._flex_as_flash): every op inside counts as attention
EAGER_ATTENTION = "eager_attention_forward"


def category(module: str | None, op: str) -> str:
    """The table category of op (an aten op or autograd node name, e.g. "mul") run inside module (a class name)."""
    if module == EAGER_ATTENTION:  # every op of an explicit attention, its matmuls too (as flash attention's are)
        return "attention"
    if op in MATMUL_OPS:
        return "matmuls"
    m = module or ""
    if "RMSNorm" in m:
        return "norms"
    if "Rotary" in m:
        return "rope"
    if "MLP" in m:
        # a cast there is autocast's weight cast that kernels.swiglu_linear makes for down_proj (as F.linear would)
        return "other_elementwise" if op in ("_to_copy", "to_copy") else "mlp_activation"  # aten op, its node
    if "Attention" in m:
        return "rope" if op in ROPE_OPS else "other_elementwise"
    if "DecoderLayer" in m:
        return "residual_adds" if op in ("add", "add_") else "other_elementwise"
    if m in _TOP_LEVEL:
        # our CausalLM's one add outside the loss: the last MLP output added to the stream before the final norm
        # (trainer/model/causal_lm.py's add_rms_norm, unfused off our kernels); HF's last add runs in its last decoder
        # layer
        return "residual_adds" if op in ("add", "add_") else "loss"
    return "other_elementwise"


def _node_op(node) -> str:
    """'MulBackward0' -> 'mul', 'AddmmBackward0' -> 'addmm'."""
    name = type(node).__name__ if not hasattr(node, "name") else node.name()
    base = name.split("Backward")[0]
    return "".join("_" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(base))


def _tag_graph(module_name: str | None, outputs) -> None:
    """Tag the autograd nodes one torch function call created with their category (from the module running it and
    the node's op), so that their backward ops land in the same category. Called after every call, so the walk back
    from its outputs stops at the nodes of earlier calls (already tagged)."""
    stack = [t.grad_fn for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or "roofline" in node.metadata:
            continue
        node.metadata["roofline"] = category(module_name, _node_op(node))
        stack.extend(n for n, _ in node.next_functions)


# ---------------------------------------------------------------------------------------------------------
# aten ops: FLOPs (FlopCounterMode's formulas), bytes (inputs read + outputs written), launches
# ---------------------------------------------------------------------------------------------------------
_NO_TRAFFIC = {
    "empty",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "empty_like",
    "detach",
    "lift_fresh",
    "_local_scalar_dense",
    "resize_",
    "set_",
    "alias",
    "_unsafe_view",
    "view",
    "_reshape_alias",
}
_WRITE_ONLY_SELF = {"copy_", "fill_", "zero_", "normal_", "uniform_", "random_"}
# Ops that read only the rows they index: bytes read = their output (or the indexed values) + the index.
_INDEXED = {"embedding", "index_select", "gather"}
_MTA_MAX_TENSORS = {1: 110, 2: 64, 3: 48, 4: 36, 5: 30}  # torch's multi_tensor_apply limits per launch, by depth
_MTA_CHUNK, _MTA_BLOCKS = 65536, 320


def aten_flops(func, args, kwargs, out) -> int:
    if func._overloadpacket is torch.ops.aten._grouped_mm:  # torch's flop counter has none: transformers 5's experts
        a, b = args[0], args[1]
        if a.dim() == 2 and b.dim() == 2:  # the groups split the reduction (a weight gradient): (m, K) x (K, n)
            return 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return 2 * out.numel() * a.shape[-1]  # each output element one K-long dot
    fn = flop_registry.get(func._overloadpacket)
    return int(fn(*args, **kwargs, out_val=out)) if fn is not None else 0


def aten_bytes(func, args, kwargs, out) -> tuple[int, int]:
    """(bytes read, bytes written) of one aten op."""
    name = func._overloadpacket.__name__
    schema = func._schema
    if name in _NO_TRAFFIC or any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
        return 0, 0  # a view or an allocation
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    written_args, skip_read = [], set()
    for i, a in enumerate(schema.arguments):
        value = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
        if a.alias_info is not None and a.alias_info.is_write and value is not None:
            tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
            written_args += tensors
            if a.kwarg_only or (a.name == "self" and name in _WRITE_ONLY_SELF):
                skip_read.update(id(t) for t in tensors)  # out= and overwritten arguments are not read
    ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and id(t) not in skip_read]
    write = sum(nbytes(t) for t in (outs or written_args))
    if name in _INDEXED:
        index = args[1] if name == "embedding" else args[2]
        return write + nbytes(index), write
    if name == "nll_loss_forward":  # reads one value per row and the targets
        return nbytes(args[1]) + args[1].numel() * args[0].element_size(), write
    if name == "nll_loss_backward":  # self is read for its shape only
        return nbytes(args[0]) + nbytes(args[2]), write
    if name in ("_fused_adamw_", "_fused_adam_") and kwargs.get("grad_scale") is None:
        # the fused kernel stores the gradients back only when it unscales them (grad_scale)
        write -= sum(nbytes(t) for t in args[1])
    if name in ("index_copy_", "index_add_", "index_put_"):
        src = args[-1] if name != "index_put_" else args[2]
        return nbytes(src) * 2, nbytes(src)
    return sum(nbytes(t) for t in ins), write


def aten_launches_for(tensors: int, depth: int, chunks: int) -> int:
    """Launches of one torch multi-tensor op over `tensors` tensors in `depth` lists, `chunks` 65536-element chunks."""
    return max(1, math.ceil(tensors / _MTA_MAX_TENSORS.get(depth, 30)), math.ceil(chunks / _MTA_BLOCKS))


def aten_launches(func, args, kwargs) -> int:
    name = func._overloadpacket.__name__
    if not (name.startswith("_foreach") or name.startswith("_fused")):
        return 1
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    chunks = sum(math.ceil(t.numel() / _MTA_CHUNK) for t in lists[0])
    return aten_launches_for(len(lists[0]), len(lists), chunks)


class _Recorder(TorchDispatchMode):
    """Records every aten op on meta (device) tensors into the trace, and tracks the storages it allocates."""

    def __init__(self, trace: Trace):
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tr = self.trace
        for t in tree_leaves(out):
            tr.track(t)
        if tr.suppress:
            return out
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        if not any(t.is_meta for t in tensors):
            return out  # host-side (the labels on the CPU): not GPU work
        read, write = aten_bytes(func, args, kwargs, out)
        flops = aten_flops(func, args, kwargs, out)
        if read + write == 0 and flops == 0:
            return out
        name = func._overloadpacket.__name__
        if tr.phase == "backward":
            node = torch._C._current_autograd_node()
            cat = (
                "matmuls"
                if name in MATMUL_OPS
                else (node.metadata.get("roofline", "other_elementwise") if node is not None else "other_elementwise")
            )
        else:
            cat = category(tr.module_stack[-1] if tr.module_stack else None, name)
        tr.add(name, cat, read + write, flops, aten_launches(func, args, kwargs))
        return out


# ---------------------------------------------------------------------------------------------------------
# Modelled ops (what cannot run on meta tensors)
# ---------------------------------------------------------------------------------------------------------
class ModelledOp(torch.autograd.Function):
    """Runs a cost model in place of an op: model.forward(ctx, *args) -> outputs (meta tensors of the right shapes,
    saved tensors via ctx), model.backward(ctx, *grads) -> input gradients; both record their costs."""

    @staticmethod
    def forward(ctx, model, *args):
        ctx.model = model
        with _TRACE.quiet(model.name):
            return model.forward(ctx, *args)

    @staticmethod
    def backward(ctx, *grads):
        with _TRACE.quiet(ctx.model.name):
            return (None, *ctx.model.backward(ctx, *grads))


def apply_model(model, *args):
    """Run `model` as a ModelledOp; its autograd node is tagged with the model's category, so the gradient sums
    autograd makes with what its backward returns are counted there (as an aten op's are with its node's)."""
    out = ModelledOp.apply(model, *args)
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            t.grad_fn.metadata.setdefault("roofline", model.category)
    return out


def _rec(name, cat, bytes_, flops=0.0, launches=1):
    _TRACE.add(name, cat, bytes_, flops, launches)


def _like(t, dtype=None, shape=None):
    return torch.empty(t.shape if shape is None else shape, dtype=dtype or t.dtype, device=t.device)
