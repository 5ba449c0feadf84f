"""A traffic meter: the global-memory bytes a Triton kernel reads and writes, counted under the interpreter.

Under TRITON_INTERPRET=1 every global-memory access of a kernel goes through a few methods of the
interpreter's builder (triton 3.9, `triton/runtime/interpreter.py`): `create_masked_load` and
`create_masked_store` (plain `tl.load`/`tl.store`, and tensor-descriptor loads and stores, which
materialise their pointers and call these two), `create_atomic_rmw` and `create_atomic_cas`. `measure()`
wraps them for the duration of a `with` block and records, per kernel launch and per tensor argument:

    issued     the active (mask-true) lanes times the element size of the pointer: what the kernel asks for,
               counted again every time the same element is loaded or stored
    distinct   the bytes of distinct addresses touched (each (address, element size) pair once per launch)

An atomic (rmw or cas) reads and writes its element: it counts in both `read` and `write`, and in `atomic`.
Real DRAM traffic of the same launch on a GPU lies between distinct (every repeat hits in cache) and issued
(none does); neither counts the launch's own parameter block or the cache-line rounding of masked tails.

Attribution: each access is charged to the tensor argument of the launch whose memory range contains its
address (the narrowest range when views overlap; arguments with the same range share one entry named
"a=b"). Addresses outside every argument (e.g. pointers a kernel loads from a table, as AdamW's does) are
charged to the tensors passed in `measure(named={...})`, else to "?".

Torch operators between the launches (matmuls, sums, copies) do not run through the interpreter. With
`measure(torch_ops=True)` a TorchDispatchMode records each one as a launch named "aten.<op>" whose bytes are
modelled, not measured (ops that move nothing, e.g. views, are not recorded): every tensor operand read once and
every output written once (what a single-pass kernel moves; a matmul's re-reads of its operands are not
counted), with these exceptions: view ops and empty allocations move nothing; an `out=` argument and the
destination of copy_/fill_/zero_ are written, not read; gather and index_select read only the elements they
select; ones_like/zeros_like/full_like read nothing; index_copy_ writes only the copied rows. Their distinct
bytes equal their issued bytes, and `Traffic.distinct_read`/`distinct_write` cover the Triton launches only.

    with traffic.measure() as t:
        fn()
    t.read_bytes, t.write_bytes, t.distinct_read, t.distinct_write, t.launches, t.by_tensor(), t.summary()

The flag must be set before the kernels' `@triton.jit` decorates (tests/conftest.py does it); `measure`
refuses to run without it, since compiled kernels would silently count nothing.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

UNKNOWN = "?"  # the tensor name of addresses outside every known tensor


@dataclass
class TensorTraffic:
    """Bytes of one tensor in one launch (or summed over launches by `Traffic.by_tensor`)."""

    name: str
    read: int = 0  # issued bytes read (atomics included)
    write: int = 0  # issued bytes written (atomics included)
    distinct_read: int = 0  # bytes of distinct (address, size) pairs read
    distinct_write: int = 0
    atomic: int = 0  # issued bytes of atomic lanes (also counted in read and write)

    def add(self, other: TensorTraffic) -> None:
        for key in ("read", "write", "distinct_read", "distinct_write", "atomic"):
            setattr(self, key, getattr(self, key) + getattr(other, key))


@dataclass
class Launch:
    """One kernel launch: its name, program count, and traffic per tensor argument."""

    kernel: str
    programs: int = 0
    tensors: dict[str, TensorTraffic] = field(default_factory=dict)
    # unique (address, size) pairs per kind, kept to union distinct bytes across launches
    _touched: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def _sum(self, key: str) -> int:
        return sum(getattr(t, key) for t in self.tensors.values())

    @property
    def read(self) -> int:
        return self._sum("read")

    @property
    def write(self) -> int:
        return self._sum("write")

    @property
    def distinct_read(self) -> int:
        return self._sum("distinct_read")

    @property
    def distinct_write(self) -> int:
        return self._sum("distinct_write")


def _pairs_bytes(pairs: np.ndarray) -> int:
    """Bytes of unique (address, size) rows."""
    return int(pairs[:, 1].sum()) if pairs.size else 0


def _unique_pairs(chunks: list[np.ndarray]) -> np.ndarray:
    if not chunks:
        return np.zeros((0, 2), dtype=np.uint64)
    return np.unique(np.concatenate(chunks), axis=0)


class Traffic:
    """What `measure` saw: the launches in order, and totals over them."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []

    @property
    def read_bytes(self) -> int:
        return sum(launch.read for launch in self.launches)

    @property
    def write_bytes(self) -> int:
        return sum(launch.write for launch in self.launches)

    def _distinct(self, kind: str) -> int:
        return _pairs_bytes(
            _unique_pairs([launch._touched[kind] for launch in self.launches if kind in launch._touched])
        )

    @property
    def distinct_read(self) -> int:
        """Bytes of distinct addresses read by all launches together (a re-read in a later launch counts once)."""
        return self._distinct("read")

    @property
    def distinct_write(self) -> int:
        return self._distinct("write")

    def by_kernel(self) -> dict[str, Launch]:
        """Launches of the same kernel merged: programs and per-tensor bytes summed (distinct per launch, summed)."""
        out: dict[str, Launch] = {}
        for launch in self.launches:
            merged = out.setdefault(launch.kernel, Launch(launch.kernel))
            merged.programs += launch.programs
            for name, tt in launch.tensors.items():
                merged.tensors.setdefault(name, TensorTraffic(name)).add(tt)
        return out

    def by_tensor(self) -> dict[str, TensorTraffic]:
        """Per tensor-argument name over all launches (distinct bytes per launch, summed)."""
        out: dict[str, TensorTraffic] = {}
        for launch in self.launches:
            for name, tt in launch.tensors.items():
                out.setdefault(name, TensorTraffic(name)).add(tt)
        return out

    def summary(self) -> str:
        """A readable table: one block per launch, one line per tensor, then the totals."""
        lines = []
        for i, launch in enumerate(self.launches):
            lines.append(
                f"launch {i} {launch.kernel}: {launch.programs} programs, read {launch.read} B "
                f"(distinct {launch.distinct_read}), write {launch.write} B (distinct {launch.distinct_write})"
            )
            for tt in sorted(launch.tensors.values(), key=lambda t: t.name):
                atomic = f", atomic {tt.atomic}" if tt.atomic else ""
                lines.append(
                    f"    {tt.name:<28} read {tt.read:>10} (distinct {tt.distinct_read:>10})  "
                    f"write {tt.write:>10} (distinct {tt.distinct_write:>10}){atomic}"
                )
        lines.append(
            f"total: {len(self.launches)} launches, read {self.read_bytes} B (distinct {self.distinct_read}), "
            f"write {self.write_bytes} B (distinct {self.distinct_write})"
        )
        return "\n".join(lines)


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) bytes of the memory a tensor view spans."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


class _Recorder:
    """The state of one `measure`: the launch in progress and its raw accesses."""

    def __init__(self, named: dict[str, torch.Tensor]) -> None:
        self.traffic = Traffic()
        self.named = named
        self.launch: Launch | None = None
        self.ranges: list[tuple[int, int, str]] = []
        self.accesses: list[tuple[str, np.ndarray, int, bool]] = []  # (kind, addresses, size, atomic)

    def begin(self, kernel: str, tensors: dict[str, torch.Tensor]) -> None:
        self.launch = Launch(kernel)
        self.accesses = []
        by_range: dict[tuple[int, int], list[str]] = defaultdict(list)
        for name, t in tensors.items():
            by_range[_extent(t)].append(name)
        ranges = [(lo, hi, "=".join(names)) for (lo, hi), names in by_range.items() if hi > lo]
        # the launch's own arguments first (narrowest range first), then the caller's named tensors
        extra = [(lo, hi, name) for name, t in self.named.items() for lo, hi in [_extent(t)] if hi > lo]
        self.ranges = sorted(ranges, key=lambda r: r[1] - r[0]) + sorted(extra, key=lambda r: r[1] - r[0])

    def access(self, kind: str, ptrs, mask, atomic: bool = False) -> None:
        if self.launch is None:
            return
        elt = ptrs.get_element_ty()
        size = max(1, elt.primitive_bitwidth // 8)
        addrs = np.asarray(ptrs.data, dtype=np.uint64).reshape(-1)
        if mask is not None:
            active = np.broadcast_to(np.asarray(mask.data, dtype=bool), np.shape(ptrs.data)).reshape(-1)
            addrs = addrs[active]
        if addrs.size:
            self.accesses.append((kind, addrs, size, atomic))

    def program(self) -> None:
        if self.launch is not None:
            self.launch.programs += 1

    def end(self) -> None:
        launch = self.launch
        self.launch = None
        if launch is None:
            return
        touched: dict[str, list[np.ndarray]] = defaultdict(list)
        per_tensor: dict[tuple[str, str], list[np.ndarray]] = defaultdict(list)
        for kind, addrs, size, atomic in self.accesses:
            kinds = ("read", "write") if atomic else (kind,)
            owner = np.full(addrs.shape, -1, dtype=np.int64)
            for i, (lo, hi, _) in enumerate(self.ranges):
                inside = (owner < 0) & (addrs >= lo) & (addrs < hi)
                owner[inside] = i
            for i in np.unique(owner):
                name = UNKNOWN if i < 0 else self.ranges[i][2]
                sel = addrs[owner == i]
                tt = launch.tensors.setdefault(name, TensorTraffic(name))
                pairs = np.stack([sel, np.full(sel.shape, size, dtype=np.uint64)], axis=1)
                for k in kinds:
                    setattr(tt, k, getattr(tt, k) + sel.size * size)
                    per_tensor[(name, k)].append(pairs)
                    touched[k].append(pairs)
                if atomic:
                    tt.atomic += sel.size * size
        for (name, k), chunks in per_tensor.items():
            setattr(launch.tensors[name], f"distinct_{k}", _pairs_bytes(_unique_pairs(chunks)))
        launch._touched = {k: _unique_pairs(chunks) for k, chunks in touched.items()}
        self.accesses = []
        self.traffic.launches.append(launch)


_active: _Recorder | None = None

# write-only destinations (their old contents are not read), and ops that move nothing
_OVERWRITE = {"copy_", "fill_", "zero_", "uniform_", "normal_", "random_"}
_NO_TRAFFIC = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "detach",
    "lift_fresh",
    "_local_scalar_dense",
    "set_",
    "resize_",
}


_ROWS_READ = {"gather", "index_select"}  # read as many elements of self as they write
_NOTHING_READ = {"ones_like", "zeros_like", "full_like"}  # self gives only the shape


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


class _TorchOps(TorchDispatchMode):
    """Records every torch operator as a launch with modelled bytes (module docstring)."""

    def __init__(self, rec: _Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        name = schema.name.split("::")[-1]
        is_view = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        if is_view or name in _NO_TRAFFIC:
            return out
        launch = Launch(f"aten.{name}")
        values = dict(zip((a.name for a in schema.arguments), args))
        values.update(kwargs)
        written_args = []
        for arg in schema.arguments:
            tensors = _tensors(values.get(arg.name))
            if not tensors:
                continue
            tt = launch.tensors.setdefault(arg.name, TensorTraffic(arg.name))
            nbytes = sum(_nbytes(t) for t in tensors)
            if arg.alias_info is not None and arg.alias_info.is_write:
                written_args += tensors
                if name == "index_copy_":
                    tt.write += _nbytes(values.get("source"))
                    continue
                tt.write += nbytes
                if schema.overload_name.endswith("out") or name in _OVERWRITE:
                    continue
            if name in _ROWS_READ and arg.name == "self":  # only the selected elements or rows are read
                nbytes = _nbytes(out)
            if name in _NOTHING_READ:
                continue
            tt.read += nbytes
        written = {id(t) for t in written_args}
        result = launch.tensors.setdefault("result", TensorTraffic("result"))
        result.write += sum(
            _nbytes(t)
            for t in _tensors(out)
            if id(t) not in written
            and not any(t.data_ptr() == w.data_ptr() and t.shape == w.shape for w in written_args)
        )
        for tt in launch.tensors.values():
            tt.distinct_read, tt.distinct_write = tt.read, tt.write
        launch.tensors = {k: v for k, v in launch.tensors.items() if v.read or v.write}
        if launch.tensors and self.rec.launch is None:  # moves bytes; not a Triton launch's own host-side copies
            self.rec.traffic.launches.append(launch)
        return out


def _tensor_args(executor, args_hst, kwargs_hst) -> dict[str, torch.Tensor]:
    """The launch's tensor arguments (host copies: the addresses the interpreter dereferences) by parameter name."""
    out = {}
    named = list(zip(executor.arg_names, args_hst)) + list(kwargs_hst.items())
    for name, arg in named:
        base = getattr(arg, "base", None)  # TensorDescriptor / TensorWrapper
        if isinstance(arg, torch.Tensor):
            out[name] = arg
        elif isinstance(base, torch.Tensor):
            out[name] = base
    return out


@contextlib.contextmanager
def measure(named: dict[str, torch.Tensor] | None = None, torch_ops: bool = False):
    """Count the global-memory traffic of every Triton launch inside the block (see the module docstring).

    `named`: tensors to charge accesses to when they fall outside every argument of the launch (kernels that
    reach memory through pointers loaded from a table). torch_ops: also record torch operators, with modelled
    bytes (module docstring). Yields a `Traffic`, complete when the block exits.
    """
    global _active
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError("traffic.measure needs TRITON_INTERPRET=1 set before the kernels are imported")
    if _active is not None:
        raise RuntimeError("traffic.measure cannot be nested")
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    executor = interp.GridExecutor
    rec = _Recorder(dict(named or {}))
    originals = {
        (builder, "create_masked_load"): builder.create_masked_load,
        (builder, "create_masked_store"): builder.create_masked_store,
        (builder, "create_atomic_rmw"): builder.create_atomic_rmw,
        (builder, "create_atomic_cas"): builder.create_atomic_cas,
        (builder, "set_grid_idx"): builder.set_grid_idx,
        (executor, "__call__"): executor.__call__,
        (executor, "_init_args_hst"): executor._init_args_hst,
    }

    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        rec.access("read", ptrs, mask)
        return originals[(builder, "create_masked_load")](self, ptrs, mask, other, cache_policy, is_volatile)

    def masked_store(self, ptrs, value, mask, cache_policy):
        rec.access("write", ptrs, mask)
        return originals[(builder, "create_masked_store")](self, ptrs, value, mask, cache_policy)

    def atomic_rmw(self, rmw_op, ptr, val, mask, sem, scope):
        rec.access("atomic", ptr, mask, atomic=True)
        return originals[(builder, "create_atomic_rmw")](self, rmw_op, ptr, val, mask, sem, scope)

    def atomic_cas(self, ptr, cmp, val, sem, scope):
        rec.access("atomic", ptr, None, atomic=True)
        return originals[(builder, "create_atomic_cas")](self, ptr, cmp, val, sem, scope)

    def set_grid_idx(self, x, y, z):
        rec.program()
        return originals[(builder, "set_grid_idx")](self, x, y, z)

    def init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = originals[(executor, "_init_args_hst")](self, args_dev, kwargs)
        rec.begin(self.fn.__name__, _tensor_args(self, args_hst, kwargs_hst))
        return args_hst, kwargs_hst

    def call(self, *args, **kwargs):
        try:
            return originals[(executor, "__call__")](self, *args, **kwargs)
        finally:
            rec.end()

    patches = {
        (builder, "create_masked_load"): masked_load,
        (builder, "create_masked_store"): masked_store,
        (builder, "create_atomic_rmw"): atomic_rmw,
        (builder, "create_atomic_cas"): atomic_cas,
        (builder, "set_grid_idx"): set_grid_idx,
        (executor, "__call__"): call,
        (executor, "_init_args_hst"): init_args_hst,
    }
    _active = rec
    try:
        for (cls, name), fn in patches.items():
            setattr(cls, name, fn)
        with _TorchOps(rec) if torch_ops else contextlib.nullcontext():
            yield rec.traffic
    finally:
        for (cls, name), fn in originals.items():
            setattr(cls, name, fn)
        _active = None
