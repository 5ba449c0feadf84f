"""Benchmark RMSNorm and the fused add + RMSNorm: ours (Triton) vs torch eager (the reference), torch.compile of the
reference, liger-kernel (LigerRMSNormFunction; LigerFusedAddRMSNormFunction with --op fused_add_rms_norm).

Modes: forward (y from x), backward (dx and dweight from a saved forward), full (forward + backward).
--op fused_add_rms_norm: (normed, h) = (rms_norm(x + residual), x + residual); its backward takes gradients at both
outputs and gives dx = dresidual and dweight.
Bytes are the ideal traffic (s = element size of x, w = element size of weight):
    forward  M N s (read x) + M N s (write y) + N w
    backward 3 M N s (read x and dy, write dx) + 2 N w
    full     the sum (the forward's y is never read back)
so GB/s is comparable across providers and its fraction of copy bandwidth is how close each gets to
memory speed. Peak extra memory is measured for the full step.

Byte model of our rows: `traffic_model(mode, m, n, s, w)` -> (read, write) bytes of our launches (per launch:
`traffic_parts`), exact (every
O(N + M) term: the weight, read once per program; rstd; the backward's fp32 (programs, N) dweight partials,
written by the kernel and read back by torch's sum; the column-loop path's second read and its row-dot
launch), checked against bench/traffic.py's count by tests/bench/test_byte_models.py; `min_traffic` the least
the op moves; `byte_model` both per element of x. Per element (s = element size of x):
    forward   ours 1s read + 1s write; above max_block (16384) 2s + 1s (x read twice)   min 1s + 1s
    backward  ours 2s + 1s (x, dy; dx); above 16384 4s + 1s (the row-dot pass reads x and dy too)
              min the same as ours in one block (rstd saved, not recomputed)
    full      ours 3s + 2s (6s + 2s above 16384, where both loop)                     min 2s + 2s (one kernel could
              keep x on chip for the backward)
The weight is issued once per program: from hidden 4096 up a program is one row (BLOCK_M = 1), so the forward and
the row-dot pass issue one weight element per element of x (bf16: 4 B read per element, not 2); those re-reads
are of 8-32 KB that stay in L1/L2, so `byte_model` (the GB/s columns) counts the weight once per launch
(`weight_once=True`), and `traffic_model`'s default is the issued count.
The model printed before this meter ignored the >8192 (two-pass) backward and the dweight partials (2 * programs
* N * 4 bytes: written by the kernel, read by the sum). With 264 programs (two per H100 SM), 4096 tokens, bf16,
our backward moves 1.084x the old model's 3s per element at hidden 4096 (the partials, 0.52 B per element) and
1.75x at hidden 16384 (x and dy read twice, and the partials): the GB/s printed there was 8% and 75% low. Every
dtype now keeps rows up to 16384 wide in one block (bf16 and fp16 at 1.084x: 6.50 B per element at 4096 x 12288 and
x 16384, liger's one block with 132 partial rows 6.26, 1.04x; fp32 12.50 B, liger 12.26, 1.02x, counting the weight
once: fp32 issues it every row, 16.50 B issued against liger's 12.39); above 16384, 1.75x.

fused_add_rms_norm, per element (s = element size of x, residual and h; `residual_size` in the functions below when
the residual's (and so h's) differs, as under autocast):
    forward   ours 2s read (x, residual) + 2s write (h, normed); above max_block 3s + 2s (h read back)   min 2s + 2s
    backward  ours 3s + 1s (d_normed, d_h_out, h; d_h); above 16384 (8192 for fp32 h with dx in a second dtype)
              5s + 1s (the row-dot pass reads h and d_normed)
              min 3s + 1s; a second dtype of x adds its write (1 element of x's size) to both
    full      ours 5s + 3s                                                                  min the same (forward and
              backward minima: h is an output, and nothing stays on chip between the two)

GPU: hidden 2048/3584/4096/8192/16384 (Llama-3.2-1B/Qwen2.5-7B/Llama-3-8B/Llama-3-70B/Llama-3-405B) x 4K/16K
tokens, bf16.
CPU (--quick): one tiny shape through the Triton interpreter; rows say perf_figure=False (not performance).

    python bench/bench_rms_norm.py                    # GPU sweep, appends to bench/results/rms_norm.jsonl
    python bench/bench_rms_norm.py --quick            # CPU smoke run
    python bench/bench_rms_norm.py --op fused_add_rms_norm   # the fused add + RMSNorm, same shapes (or both ops)
    python bench/bench_rms_norm.py --host --against REV      # CPU host work of a lone call, now and at git REV

--host (no GPU needed): what a lone call costs the host (`host`, bench/host.py): the torch calls, aten ops and Triton
launches of each op's forward and backward at Llama-3-8B's width, and the host microseconds per call on fake CUDA with
the launches recorded, not run. CPU host time, launches not executed: not a GPU time (on a GPU, --kernel-times puts
the device time beside the wall time).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `bench` and `kernels` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if not torch.cuda.is_available():
    # Read when kernels' @triton.jit decorates, so before `kernels` is imported: CPU runs our kernels
    # through the interpreter instead of silently measuring the reference twice.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kernels  # noqa: E402
from bench import common  # noqa: E402
from kernels.rms_norm import (
    _CPU_BWD_PROGRAMS,
    bwd_launch_config,
    fused_add_rms_norm,  # noqa: E402
    fused_add_rms_norm_ref,
    launch_config,
    rms_norm,
    rms_norm_ref,
)

OPS = ("rms_norm", "fused_add_rms_norm")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("forward", "backward", "full")
PROVIDERS = ("ours", "torch", "torch_compile", "liger")
GPU_TOKENS = (4096, 16384)
GPU_HIDDEN = (2048, 3584, 4096, 8192, 16384)
CPU_SHAPES = ((8, 781),)


def _liger_fn(op: str):
    """liger-kernel's op as f(*inputs, eps, offset), or None with the reason."""
    if not torch.cuda.is_available():
        return None, "liger-kernel's RMSNorm needs libdevice, which the Triton interpreter lacks"
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception as exc:  # optional baseline
        return None, f"liger-kernel not importable ({exc.__class__.__name__}); pip install liger-kernel"
    # casting_mode "gemma" is fp32 until the final cast, the same semantics as ours.
    if op == "fused_add_rms_norm":

        def liger(x, r, w, eps, offset):
            return LigerFusedAddRMSNormFunction.apply(x, r, w, eps, offset, "gemma", False)

        return liger, None
    return (lambda x, w, eps, offset: LigerRMSNormFunction.apply(x, w, eps, offset, "gemma", False)), None


def _providers(op: str, compile_backend: str) -> dict:
    fn, ref = {
        "rms_norm": (rms_norm, rms_norm_ref),
        "fused_add_rms_norm": (fused_add_rms_norm, fused_add_rms_norm_ref),
    }[op]

    def ours(*args):
        with kernels.backend("triton"):
            return fn(*args)

    fns = {
        "ours": ours,
        "torch": ref,
        "torch_compile": torch.compile(ref, backend=compile_backend, dynamic=False),
    }
    liger, why = _liger_fn(op)
    if liger is not None:
        fns["liger"] = liger
    else:
        print(f"skipping liger: {why}", file=sys.stderr)
    return fns


def _bytes(mode: str, m: int, n: int, x_size: int, w_size: int, residual_size: int | None = None) -> int:
    """The ideal traffic every provider's GB/s column is computed from."""
    if residual_size is not None:
        return sum(min_traffic(mode, m, n, x_size, w_size, residual_size=residual_size))
    fwd = 2 * m * n * x_size + n * w_size
    bwd = 3 * m * n * x_size + 2 * n * w_size
    return {"forward": fwd, "backward": bwd, "full": fwd + bwd}[mode]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def bwd_programs(m: int, block_m: int, num_programs: int | None = None) -> int:
    """Programs of the backward launch, so rows of the dweight partial buffer (kernels/rms_norm.py's rule), for tiles
    of block_m rows (`bwd_launch_config`)."""
    if num_programs is None:
        num_programs = (
            2 * torch.cuda.get_device_properties(0).multi_processor_count if common.on_gpu() else _CPU_BWD_PROGRAMS
        )
    tiles = _cdiv(m, block_m)
    rows_per_prog = _cdiv(tiles, min(num_programs, tiles)) * block_m
    return _cdiv(m, rows_per_prog)


def traffic_parts(
    mode: str,
    m: int,
    n: int,
    s: int,
    w: int,
    *,
    max_block: int | None = None,
    num_programs: int | None = None,
    compute_dw: bool = True,
    weight_once: bool = False,
    residual_size: int | None = None,
    grad_h: bool = True,
) -> dict[str, tuple[int, int]]:
    """Exact (read, write) bytes per launch of our RMSNorm on an (m, n) x of element size s, weight of size w; with
    residual_size, of fused_add_rms_norm(x, residual) (h, normed and the gradients at both outputs in
    promote(x, residual)'s size, dresidual in the residual's, dx in x's when it differs: written by the same launch;
    grad_h=False: no gradient arrived at h, as when the sum is not used later, so d_h_out is not read).
    The backward's blocks follow `bwd_launch_config` for h's size (2: bf16 or fp16, the same blocks; 4: fp32, whose rows
    above 8192 reload the weight every row, and whose dx in two dtypes keeps the 8192 cap).

    Keys: the Triton kernels' names, and the torch ops of the dweight finish ("aten.sum" of the fp32 partials,
    "aten._to_copy" to the weight's dtype), as bench/traffic.py's `torch_ops` names and counts them.
    `traffic_model` sums them. max_block / num_programs as the launchers take them.
    Issued bytes; weight_once counts the weight once per launch instead of once per program (or row tile), which
    is what DRAM sees while the weight (N * w bytes, 8-32 KB) stays in L2: the meter's distinct weight bytes.
    """
    out: dict[str, tuple[int, int]] = {}
    mn = m * n
    add = residual_size is not None
    h = max(s, residual_size) if add else s  # the norm's input and output: h (promote(x, residual)) or x
    if mode in ("forward", "full"):
        block_m, block_n, one_block, _ = launch_config(m, n, max_block)
        programs = _cdiv(m, block_m)
        weight = (1 if weight_once else programs) * n * w
        inputs = mn * (s + residual_size) if add else mn * s  # x (and the residual) read once
        reread = 0 if one_block else mn * h  # the column loop's second pass reads x (or the h it wrote) again
        written = mn * h * (2 if add else 1) + 4 * m  # y (and h), rstd
        out["_rms_norm_fwd_kernel"] = (inputs + reread + weight, written)
    if mode in ("backward", "full"):
        two_dx = add and s != residual_size
        cfg = bwd_launch_config(m, n, {2: torch.bfloat16, 4: torch.float32}[h], max_block, add and grad_h, two_dx)
        block_m, block_n, one_block = cfg.block_m, cfg.block_n, cfg.one_block
        programs = bwd_programs(m, block_m, num_programs)
        partials = programs * n * 4 if compute_dw else 0
        # the weight once per program, or once per row tile where it is reloaded every row (fp32 above 8192)
        weight = (1 if weight_once else _cdiv(m, block_m) if cfg.w_per_row else programs) * n * w
        rows_in = mn * h * (3 if add and grad_h else 2)  # dy and x (h), and d_h_out
        if one_block:
            read = rows_in + weight + 4 * m  # weight per program, rstd
        else:
            tiles = _cdiv(m, block_m)
            out["_rms_norm_bwd_rowdot_kernel"] = (
                2 * mn * h + (1 if weight_once else tiles) * n * w + 4 * m,
                4 * m,
            )  # -> c
            col_blocks = _cdiv(n, block_n)
            read = rows_in + weight + col_blocks * 2 * 4 * m  # rstd and c per column block
        dx = mn * (residual_size + (s if s != residual_size else 0)) if add else mn * s
        out["_rms_norm_bwd_kernel"] = (read, dx + partials)
        if compute_dw:
            out["aten.sum"] = (partials, 4 * n)  # the partials summed over programs, in fp32
            if w != 4:  # .to(weight.dtype) is a no-op for fp32
                out["aten._to_copy"] = (4 * n, n * w)
    return out


def traffic_model(mode: str, m: int, n: int, s: int, w: int, **kwargs) -> tuple[int, int]:
    """(read, write) bytes of our launches (`traffic_parts` summed)."""
    parts = traffic_parts(mode, m, n, s, w, **kwargs).values()
    return sum(r for r, _ in parts), sum(wr for _, wr in parts)


def min_traffic(mode: str, m: int, n: int, s: int, w: int, residual_size: int | None = None) -> tuple[int, int]:
    """The least the op must move: `_bytes`'s ideal traffic split into reads and writes (full keeps x on chip).
    fused_add_rms_norm (residual_size given): forward reads x, residual and the weight, writes h and normed; backward
    reads d_normed, d_h_out, h and the weight, writes dresidual (and dx in x's dtype where it differs) and dweight;
    full is the two (h, an output, is read back: nothing stays on chip between forward and backward)."""
    mn = m * n
    if residual_size is not None:
        h = max(s, residual_size)
        fwd = (mn * (s + residual_size) + n * w, 2 * mn * h)
        bwd = (3 * mn * h + n * w, mn * (residual_size + (s if s != residual_size else 0)) + n * w)
        return {"forward": fwd, "backward": bwd, "full": (fwd[0] + bwd[0], fwd[1] + bwd[1])}[mode]
    fwd = (m * n * s + n * w, m * n * s)
    bwd = (2 * m * n * s + n * w, m * n * s + n * w)
    full = (2 * m * n * s + n * w, 2 * m * n * s + n * w)  # x, dy and weight read once; y, dx and dweight written
    return {"forward": fwd, "backward": bwd, "full": full}[mode]


def byte_model(mode: str, m: int, n: int, s: int, w: int, residual_size: int | None = None) -> common.ByteModel:
    """Our bytes read/written per element of x (the weight once per launch: it stays in cache) and the minimum."""
    ours = traffic_model(mode, m, n, s, w, weight_once=True, residual_size=residual_size)
    return common.ByteModel.from_totals(ours, min_traffic(mode, m, n, s, w, residual_size), m * n)


def _case(fn, mode, inputs, grads, eps, offset):
    """A zero-argument callable timing `mode` of fn(*inputs, eps, offset) (the inputs' gradients from `grads`, one per
    output); the backward reuses one saved forward graph."""
    if mode == "forward":
        return lambda: fn(*inputs, eps, offset)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    if mode == "backward":
        out = fn(*leaves, eps, offset)
        return lambda: torch.autograd.grad(out, leaves, grads, retain_graph=True)
    return lambda: torch.autograd.grad(fn(*leaves, eps, offset), leaves, grads)


def run(
    shapes,
    dtype,
    modes,
    providers,
    *,
    op="rms_norm",
    offset=0.0,
    eps=1e-6,
    compile_backend="inductor",
    cpu_reps=3,
    kernel_times=False,
):
    fns = {k: v for k, v in _providers(op, compile_backend).items() if k in providers}
    dev = common.device()
    env = common.env_info()
    rows = []
    for m, n in shapes:
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(m, n, device=dev, dtype=dtype, generator=g)
        w = (1.0 + 0.1 * torch.randn(n, device=dev, generator=g)).to(dtype)
        dy = torch.randn(m, n, device=dev, dtype=dtype, generator=g)
        if op == "fused_add_rms_norm":
            residual = torch.randn(m, n, device=dev, dtype=dtype, generator=g)
            inputs, grads = (x, residual, w), (dy, torch.randn(m, n, device=dev, dtype=dtype, generator=g))
            residual_size = x.element_size()
        else:
            inputs, grads, residual_size = (x, w), dy, None
        for mode in modes:
            timings = {}
            for name, fn in fns.items():
                step = _case(fn, mode, inputs, grads, eps, offset)
                t = common.measure(step, cpu_reps=cpu_reps)
                moved = _bytes(mode, m, n, x.element_size(), w.element_size(), residual_size)
                row = {
                    "op": op,
                    "provider": name,
                    "mode": mode,
                    "tokens": m,
                    "hidden": n,
                    "dtype": str(dtype).replace("torch.", ""),
                    "offset": offset,
                    "compile_backend": compile_backend if name == "torch_compile" else None,
                    **t,
                    "bytes": moved,
                    **common.physics(t["ms"], bytes_moved=moved),
                    "peak_extra_bytes": common.peak_extra_memory(step) if mode == "full" else None,
                    **(common.kernel_times(step) if kernel_times else {}),
                    **env,
                }
                if name == "ours":
                    row.update(
                        byte_model(mode, m, n, x.element_size(), w.element_size(), residual_size).columns(
                            m * n, t["ms"]
                        )
                    )
                timings[name] = t["ms"]
                rows.append(row)
            common.finish_case(rows[-len(fns) :], timings, f"{m}x{n} {mode:8s}")
    return rows


# ---- host work (--host): what a lone call costs the CPU, launches recorded, not run -------------------------------

HOST_SHAPES = ((8192, 4096), (2, 4096, 4096))  # Llama-3-8B's width: 8192 rows as (M, N) and as (batch, seq, hidden)


def host_case(op: str, shape=(8192, 4096), dtype=torch.bfloat16, w_dtype=torch.float32, wgrad=True, module=None):
    """(forward, backward) of a lone training call of `op` (ours; `module`'s, default kernels.rms_norm) on (fake) CUDA
    tensors: forward() -> outputs; backward(outputs) -> the gradients of x (and the residual's) and of the weight when
    wgrad, captured as the benchmark's backward mode does (torch.autograd.grad: no AccumulateGrad; bench/host.py's
    `grad`, which keeps the fake CUDA on in the backward). Make it inside bench.sm90.fake_cuda()."""
    from bench import host as host_work

    module = module or sys.modules["kernels.rms_norm"]
    x = torch.empty(shape, dtype=dtype, device="cuda", requires_grad=True)
    w = torch.empty(shape[-1], dtype=w_dtype, device="cuda", requires_grad=wgrad)
    inputs = [x, w] if wgrad else [x]
    if op == "fused_add_rms_norm":
        r = torch.empty(shape, dtype=dtype, device="cuda", requires_grad=True)
        inputs.append(r)
        grads = [torch.empty(shape, dtype=dtype, device="cuda") for _ in range(2)]

        def forward():
            return module.fused_add_rms_norm(x, r, w)

    else:
        grads = [torch.empty(shape, dtype=dtype, device="cuda")]

        def forward():
            return [module.rms_norm(x, w)]

    def backward(outputs):
        return host_work.grad(outputs, grads, inputs)

    return forward, backward


def module_at(rev: str):
    """kernels/rms_norm.py as it was at git revision `rev`, imported beside the current one (for --host --against)."""
    import importlib.util
    import subprocess
    import tempfile

    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{rev}:kernels/rms_norm.py"], cwd=root, capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="rms_norm_at_")) / "rms_norm.py"  # kept: Triton reads the kernels' source
    path.write_text(source)
    name = "kernels._rms_norm_at_" + "".join(c if c.isalnum() else "_" for c in rev)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def host(ops=OPS, shapes=HOST_SHAPES, against: str | None = None, calls: int = 400, blocks: int = 5) -> list[dict]:
    """Per lone call of each op (weight with and without grad): the torch calls, aten ops and Triton launches of its
    forward and backward (bench/host.py's `count`, exact) and the CPU host time per call with launches not executed
    (`time_call`: the least of `blocks` medians of `calls` calls each), and Triton's per-launch Python
    (`launcher_us`). With `against` (a git revision), kernels/rms_norm.py as it was there is measured too, its blocks
    interleaved with the current code's so both see the same machine load. Printed and returned."""
    from bench import host as host_work
    from bench.sm90 import fake_cuda

    versions = {"now": sys.modules["kernels.rms_norm"]}
    if against:
        versions = {against: module_at(against), **versions}
    hook = host_work.hook_cost_us()
    print(
        "CPU host time, launches not executed: fake CUDA (meta tensors that claim cuda:0), Triton launches recorded.\n"
        "Covers our Python, autograd and torch's dispatch to meta kernels, plus the fake-CUDA mode's hook on each\n"
        f"torch call ({hook:.2f} us each here); not Triton's launcher (below), CUDA's allocator or launches.\n"
        "Not a GPU time: compare versions on one machine (--against)."
    )
    rows, launches = [], {}
    for op in ops:
        for shape in shapes:
            for wgrad in (True, False):
                print(f"{op} {'x'.join(map(str, shape))} bf16, fp32 weight {'with' if wgrad else 'without'} grad")
                with fake_cuda():
                    cases, counts = {}, {}
                    for version, module in versions.items():
                        forward, backward = host_case(op, shape, wgrad=wgrad, module=module)
                        outputs, fwd = host_work.count(forward)
                        _, bwd = host_work.count(lambda: backward(outputs))  # noqa: B023 (called at once)
                        counts[version] = fwd, bwd
                        cases[version] = forward, lambda f=forward, b=backward: b(f())
                        with host_work.record() as recorded:
                            backward(forward())
                        for launch in recorded:
                            launches.setdefault((op, launch.name, version), launch)
                    times = {version: ([], []) for version in versions}
                    for _ in range(blocks):
                        for version, (forward, step) in cases.items():
                            times[version][0].append(host_work.time_call(forward, calls))
                            times[version][1].append(host_work.time_call(step, calls))
                for version, (fwd, bwd) in counts.items():
                    fwd_us, step_us = min(times[version][0]), min(times[version][1])
                    print(
                        f"  {version:>8}: forward {fwd_us:.1f} us, forward+backward {step_us:.1f} us (CPU host time)\n"
                        f"            forward:  {fwd.text()}\n            backward: {bwd.text()}"
                    )
                    rows.append(
                        {
                            "op": op,
                            "version": version,
                            "shape": list(shape),
                            "weight_grad": wgrad,
                            "forward_host_us": round(fwd_us, 2),
                            "step_host_us": round(step_us, 2),
                            "forward": vars(fwd),
                            "backward": vars(bwd),
                            "hook_us_per_torch_call": round(hook, 3),
                            "perf_figure": False,
                        }
                    )
    print(
        "Triton's JITFunction.run Python per launch before its C launcher (binder + cache key, sm_90 backend), each "
        "op's first case:"
    )
    launcher = {key: [] for key in launches}
    for _ in range(blocks):  # interleaved, as above
        for key, launch in launches.items():
            launcher[key].append(host_work.launcher_us(launch, 10 * calls))
    for (op, name, version), launch in launches.items():
        us, nones = min(launcher[op, name, version]), sum(a is None for a in launch.args)
        print(f"  {version:>8}: {op} {name} {us:.2f} us ({len(launch.args)} runtime arguments, {nones} of them None)")
        rows.append(
            {
                "op": op,
                "version": version,
                "kernel": name,
                "launcher_host_us": round(us, 2),
                "args": len(launch.args),
                "none": nones,
            }
        )
    return rows


def main(argv=None):
    ap = common.provider_parser(__doc__, DTYPES, MODES, PROVIDERS, "activation and weight dtype")
    ap.add_argument("--tokens", nargs="+", type=int, help="rows (batch x sequence); default: real-model sweep on GPU")
    ap.add_argument("--hidden", nargs="+", type=int, help="hidden sizes; default: real-model sweep on GPU")
    ap.add_argument(
        "--op",
        nargs="+",
        choices=OPS,
        default=["rms_norm"],
        help="RMSNorm and/or the fused residual add + RMSNorm (rows say which in `op`)",
    )
    ap.add_argument("--offset", type=float, default=0.0, help="0 (Llama) or 1 (Gemma)")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend for the compiled baseline")
    ap.add_argument(
        "--host",
        action="store_true",
        help="CPU host work of a lone call (torch calls, aten ops, launches; host microseconds with launches not "
        "executed), on fake CUDA: no GPU needed, not a GPU time",
    )
    ap.add_argument(
        "--against", metavar="REV", help="with --host: also measure kernels/rms_norm.py at git revision REV"
    )
    args = ap.parse_args(argv)
    if args.host:
        shapes = [(t, h) for t in args.tokens or (8192,) for h in args.hidden or (4096,)]
        return host(args.op, shapes if args.tokens or args.hidden else HOST_SHAPES, args.against)

    if args.tokens or args.hidden:
        shapes = [(t, h) for t in (args.tokens or GPU_TOKENS) for h in (args.hidden or GPU_HIDDEN)]
    elif args.quick or not common.on_gpu():
        shapes = list(CPU_SHAPES)
    else:
        shapes = [(t, h) for t in GPU_TOKENS for h in GPU_HIDDEN]
    rows = [
        row
        for op in args.op
        for row in run(
            shapes,
            DTYPES[args.dtype],
            args.modes,
            args.providers,
            op=op,
            offset=args.offset,
            compile_backend=args.compile_backend,
            cpu_reps=1 if args.quick else 5,
            kernel_times=args.kernel_times,
        )
    ]
    path = common.write_rows("rms_norm", rows)
    print(f"wrote {len(rows)} rows to {path}")
    return rows


if __name__ == "__main__":
    main()
