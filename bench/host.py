"""Host work of a lone op call, measured on a CPU: what it dispatches and how long its Python path takes.

A GPU run (bench/results/h200/README.md, "Why the misses") found short kernels launch-bound: a lone RMSNorm call's
host work (autograd, torch ops around the launch, the launch itself) outlasts its kernels. This measures that host
work without a GPU, on `bench.sm90.fake_cuda()` (meta tensors that claim cuda:0, so the launchers take their CUDA
path: the same torch calls, shapes, dtypes and grids) with every Triton launch recorded, not run:

- `count(fn)`: the torch API calls the Python code makes (methods, properties and functions a TorchFunctionMode
  sees: `.stride()`, `.shape`, `torch.empty`, ...), the aten ops dispatched (a TorchDispatchMode: what would reach
  the CUDA allocator or launch a CUDA kernel, and autograd's own ops such as AccumulateGrad's detach) and the Triton
  launches. Exact and machine-independent: tests pin them.
- `time_call(fn)`: median wall time per call, CPU host time with launches not executed. It covers the op's Python
  path, autograd's C++ engine and torch's dispatch of each op to meta kernels; it includes the fake-CUDA mode's
  Python hook on every torch call (`hook_cost_us` times it; `count` says how many) and excludes Triton's launcher
  (`launcher_us`), CUDA's allocator, the CUDA launches of torch's ops and any device time.
- `launcher_us(launch)`: the per-launch Python work of Triton's `JITFunction.run` that runs before the C launcher:
  the knobs it reads, its binder (every argument specialised: each integer checked for == 1 and divisibility by 16,
  each pointer for 16-byte alignment; done in C by `native_specialize_impl`) and the kernel cache key
  (`compute_cache_key`: a tuple of the specialisation and `str()` of the options, looked up in a dict), for an
  sm_90 backend, with small CPU tensors standing in for the pointers. Not covered: the driver's current device and
  stream queries, `launch_metadata` and the C launcher (`kernel.run`), which need a GPU.

- `grad(outputs, grads, inputs)`: torch.autograd.grad with the fake CUDA kept on in the backward. torch.autograd.grad
  and torch.autograd.backward are torch functions themselves: a TorchFunctionMode handling one runs the whole backward
  with the modes popped, on plain meta tensors (the launchers' CPU path). bench/sm90.py's fake CUDA pushes itself back
  for Tensor.backward and torch.autograd.backward, so its cases compile the backward launches a GPU makes.

None of these numbers is a GPU time: they compare host work before and after a change on the same machine.
"""

from __future__ import annotations

import collections
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd.graph import _engine_run_backward
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from triton import knobs
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

from bench.sm90 import TARGET, Launch, fake_cuda, record_launches

# What `record` keeps of each launch: the launch with its arguments as passed (tensors held), the kernel's name, nothing
_ENTRIES = {
    "launch": lambda kernel, args, kwargs: Launch(kernel, args, kwargs),
    "name": lambda kernel, args, kwargs: kernel.fn.__name__,
    "none": lambda kernel, args, kwargs: None,
}


def record(keep: str = "launch"):
    """bench.sm90's `record_launches` keeping, for each launch, per `keep`: "launch" a `Launch` (its arguments held, as
    passed), "name" the kernel's name, "none" None (a count). Holding the arguments changes what autograd does: a
    gradient the launcher wrote is then not the engine's alone, so AccumulateGrad copies it instead of stealing it."""
    return record_launches(_ENTRIES[keep])


class _AtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class _TorchCalls(TorchFunctionMode):
    """Pushed inside fake_cuda's mode: sees the code's own torch calls (not those the fake-CUDA handler makes)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


@dataclass
class Count:
    torch_calls: int  # torch API calls from Python (methods, properties, functions)
    aten_ops: dict[str, int]  # aten op -> times dispatched
    launches: list[str]  # Triton kernels launched, in order

    @property
    def n_aten(self) -> int:
        return sum(self.aten_ops.values())

    def text(self) -> str:
        ops = ", ".join(f"{k} {v}" for k, v in sorted(self.aten_ops.items())) or "none"
        return f"{self.torch_calls} torch calls, {self.n_aten} aten ops ({ops}), {len(self.launches)} Triton launches"


def count(fn: Callable[[], object]) -> tuple[object, Count]:
    """(fn(), what it dispatched). Call it inside `fake_cuda()` (the tensors fn uses must be made there too)."""
    calls, ops = _TorchCalls(), _AtenOps()
    with record("name") as launches, calls, ops:
        out = fn()
    return out, Count(calls.calls, dict(ops.ops), list(launches))


def grad(outputs, grads, inputs) -> tuple:
    """torch.autograd.grad(outputs, inputs, grads) (the gradients captured, not accumulated into .grad: what the
    benchmarks time), with the torch-function modes kept on in the backward: torch.autograd.grad is itself a torch
    function, so a mode handling it would run the whole backward with the modes popped (plain meta tensors: the
    launchers' CPU path). The engine is called as that function calls it, less its Python argument handling."""
    return _engine_run_backward(
        tuple(outputs), tuple(grads), False, False, tuple(inputs), allow_unreachable=True, accumulate_grad=False
    )


def time_call(fn: Callable[[], object], calls: int = 2000, warmup: int = 50) -> float:
    """Median microseconds per fn() (launches recorded, not run): CPU host time. Call it inside `fake_cuda()`."""
    with record("none") as launches:
        for _ in range(warmup):
            fn()
        times = []
        gc_was = gc.isenabled()
        gc.disable()
        try:
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
                launches.clear()
        finally:
            if gc_was:
                gc.enable()
    return statistics.median(times) * 1e6


def hook_cost_us(calls: int = 20000) -> float:
    """What the fake-CUDA mode adds to one torch call (`t.stride(0)` on a meta tensor, with and without the mode):
    the harness's share of `time_call`, about this times `Count.torch_calls`."""
    t = torch.empty(8, 8, device="meta")

    def per_call():
        t0 = time.perf_counter()
        for _ in range(calls):
            t.stride(0)
        return (time.perf_counter() - t0) / calls * 1e6

    bare = min(per_call() for _ in range(3))
    with fake_cuda():
        hooked = min(per_call() for _ in range(3))
    return hooked - bare


def _stand_in(v):
    # specialisation reads a tensor's dtype and data_ptr (16-byte alignment): a small CPU tensor of the dtype, offset
    # as the original is from a 512-byte aligned block (CUDA's allocator), so the same alignment is specialised
    if not isinstance(v, torch.Tensor):
        return v
    offset = v.storage_offset() * v.element_size() % 16
    return torch.empty(64 + offset, dtype=torch.uint8)[offset:].view(v.dtype)  # offset: a multiple of the size


def launcher_us(launch: Launch, calls: int = 4000) -> float:
    """Median microseconds of the Python work `JITFunction.run` does per launch before its C launcher (see the
    module docstring), on an sm_90 backend, with the kernel already compiled (a cache-key hit)."""
    kernel = launch.kernel
    if not isinstance(kernel, JITFunction):  # the interpreter's wrapper: the same function as Triton would compile it
        kernel = JITFunction(kernel.fn)
    binder = create_function_from_signature(kernel.signature, kernel.params, make_backend(TARGET))
    args = tuple(_stand_in(a) for a in launch.args)
    kwargs = {k: _stand_in(v) for k, v in launch.kwargs.items()}
    key_cache: dict = {}

    def run_prefix():  # JITFunction.run up to the kernel-cache lookup, minus the driver's device and stream queries
        kw = dict(kwargs)
        kw["debug"] = kw.get("debug", kernel.debug) or knobs.runtime.debug
        kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        kw["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
        bound_args, specialization, options = binder(*args, **kw)
        return compute_cache_key(key_cache, specialization, options)

    for _ in range(20):
        run_prefix()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        run_prefix()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6
