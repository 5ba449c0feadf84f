"""Benchmark SwiGLU's gating silu(gate) * up: ours (Triton) vs torch eager (as HF's LlamaMLP), torch.compile, liger.

`--act gelu_tanh`: GeGLU's gelu_tanh(gate) * up instead (Gemma's MLP; ours `kernels.geglu`, the same kernels and
bytes with the activation switched; eager F.gelu(gate, approximate="tanh") * up as transformers' GemmaMLP; liger's
LigerGELUMulFunction); rows say act.

Modes: forward (out from gate and up), backward (dgate and dup from a saved forward), full (forward + backward).
Bytes are the ideal traffic (s = element size; n = tokens x intermediate):
    forward  3 n s (read gate and up, write out)
    backward 5 n s (read dout, gate and up, write dgate and dup)
    full     8 n s
Byte model of our rows, per element (read + write; `traffic_parts`, equal to bench/traffic.py's meter in
tests/bench/test_byte_models.py):
    forward   ours 2s + 1s              min the same
    backward  ours 3s + 2s              min the same (silu recomputed from gate, never saved)
    full      ours 5s + 3s              min the same (out is needed by down_proj, gate and up by the backward)
    backward, act written too (kernels.swiglu_linear's backward: `traffic_parts(..., store_act=True)`)
              ours 3s + 3s              in place of a second forward pass (2s + 1s) before the 3s + 2s backward
The eager baseline is F.silu(gate) * up in the activation dtype, what transformers' LlamaMLP runs: 2 passes
forward (silu writes a temporary) and more backward. Peak extra memory is measured for the full step.

GPU: Llama-3-8B's MLP, 8192 tokens x intermediate 14336, bf16 (and --tokens/--inter for others).
CPU (--quick): one tiny shape through the Triton interpreter; rows say perf_figure=False (not performance).

    python bench/bench_swiglu.py                    # GPU, appends to bench/results/swiglu.jsonl
    python bench/bench_swiglu.py --quick            # CPU smoke run
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make `bench` and `kernels` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if not torch.cuda.is_available():
    # Read when kernels' @triton.jit decorates, so before `kernels` is imported (see bench_rms_norm.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kernels  # noqa: E402
from bench import common  # noqa: E402
from kernels.geglu import geglu  # noqa: E402
from kernels.swiglu import swiglu  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("forward", "backward", "full")
PROVIDERS = ("ours", "torch", "torch_compile", "liger")
GPU_TOKENS = (8192,)
GPU_INTER = (14336,)  # Llama-3-8B
CPU_SHAPES = ((8, 781),)
ACTS = ("silu", "gelu_tanh")


def _eager(gate, up):
    return F.silu(gate) * up


def _eager_gelu(gate, up):
    return F.gelu(gate, approximate="tanh") * up


def _liger_fn(act: str = "silu"):
    """liger-kernel's SwiGLU (GeGLU) gating as f(gate, up), or None with the reason."""
    if not torch.cuda.is_available():
        return None, "liger-kernel's SwiGLU uses libdevice, which the Triton interpreter lacks"
    try:
        if act == "silu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction as function
        else:
            from liger_kernel.ops.geglu import LigerGELUMulFunction as function
    except Exception as exc:  # optional baseline
        return None, f"liger-kernel not importable ({exc.__class__.__name__}); pip install liger-kernel"
    return function.apply, None


def _providers(compile_backend: str, act: str = "silu") -> dict:
    op, eager = (swiglu, _eager) if act == "silu" else (geglu, _eager_gelu)

    def ours(gate, up):
        with kernels.backend("triton"):
            return op(gate, up)

    fns = {
        "ours": ours,
        "torch": eager,
        "torch_compile": torch.compile(eager, backend=compile_backend, dynamic=False),
    }
    liger, why = _liger_fn(act)
    if liger is not None:
        fns["liger"] = liger
    else:
        print(f"skipping liger: {why}", file=sys.stderr)
    return fns


def _bytes(mode: str, n: int, s: int) -> int:
    return {"forward": 3, "backward": 5, "full": 8}[mode] * n * s


def traffic_parts(mode: str, n: int, s: int, store_act: bool = False) -> dict[str, tuple[int, int]]:
    """(read, write) bytes of our kernels for n elements of s bytes, per kernel (tests/bench/test_byte_models.py
    holds them equal to the traffic meter). store_act: the backward also writes act (`swiglu_bwd_act`)."""
    parts = {}
    if mode in ("forward", "full"):
        parts["_swiglu_fwd_kernel"] = (2 * n * s, n * s)  # gate, up; out
    if mode in ("backward", "full"):
        parts["_swiglu_bwd_kernel"] = (3 * n * s, (3 if store_act else 2) * n * s)  # dout, gate, up; dgate, dup(, act)
    return parts


def byte_model(mode: str, s: int) -> common.ByteModel:
    """Our bytes read/written per element and the minimum (module docstring): ours is the minimum."""
    read = sum(r for r, _ in traffic_parts(mode, 1, s).values())
    write = sum(w for _, w in traffic_parts(mode, 1, s).values())
    return common.ByteModel(read, write, read, write)


def _case(fn, mode, gate, up, dout):
    """A zero-argument callable timing `mode` of fn; the backward reuses one saved forward graph.

    liger writes its gradients into gate and up in place: each provider gets its own copies."""
    if mode == "forward":
        return lambda: fn(gate, up)
    g, u = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    if mode == "backward":
        out = fn(g, u)
        return lambda: torch.autograd.grad(out, [g, u], dout, retain_graph=True)
    return lambda: torch.autograd.grad(fn(g, u), [g, u], dout)


def run(shapes, dtype, modes, providers, *, compile_backend="inductor", cpu_reps=3, kernel_times=False, act="silu"):
    fns = {k: v for k, v in _providers(compile_backend, act).items() if k in providers}
    dev = common.device()
    env = common.env_info()
    rows = []
    for m, n in shapes:
        g = torch.Generator(device=dev).manual_seed(0)
        gate = (2 * torch.randn(m, n, device=dev, generator=g)).to(dtype)
        up = torch.randn(m, n, device=dev, dtype=dtype, generator=g)
        dout = torch.randn(m, n, device=dev, dtype=dtype, generator=g)
        for mode in modes:
            timings = {}
            for name, fn in fns.items():
                step = _case(fn, mode, gate, up, dout)
                t = common.measure(step, cpu_reps=cpu_reps)
                moved = _bytes(mode, m * n, gate.element_size())
                row = {
                    "op": "swiglu" if act == "silu" else "geglu",
                    "act": act,
                    "provider": name,
                    "mode": mode,
                    "tokens": m,
                    "hidden": n,
                    "dtype": str(dtype).replace("torch.", ""),
                    "compile_backend": compile_backend if name == "torch_compile" else None,
                    **t,
                    "bytes": moved,
                    **common.physics(t["ms"], bytes_moved=moved),
                    "peak_extra_bytes": common.peak_extra_memory(step) if mode == "full" else None,
                    **(common.kernel_times(step) if kernel_times else {}),
                    **env,
                }
                if name == "ours":
                    row.update(byte_model(mode, gate.element_size()).columns(m * n, t["ms"]))
                timings[name] = t["ms"]
                rows.append(row)
            common.finish_case(rows[-len(fns) :], timings, f"{m}x{n} {mode:8s}")
    return rows


def main(argv=None):
    ap = common.provider_parser(__doc__, DTYPES, MODES, PROVIDERS, "activation dtype")
    ap.add_argument("--tokens", nargs="+", type=int, help="rows (batch x sequence); default 8192 on GPU")
    ap.add_argument("--inter", nargs="+", type=int, help="intermediate sizes; default 14336 (Llama-3-8B) on GPU")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend for the compiled baseline")
    ap.add_argument("--act", choices=ACTS, default="silu", help="the gate's activation: SwiGLU (silu) or GeGLU")
    args = ap.parse_args(argv)

    if args.tokens or args.inter:
        shapes = [(t, i) for t in (args.tokens or GPU_TOKENS) for i in (args.inter or GPU_INTER)]
    elif args.quick or not common.on_gpu():
        shapes = list(CPU_SHAPES)
    else:
        shapes = [(t, i) for t in GPU_TOKENS for i in GPU_INTER]
    rows = run(
        shapes,
        DTYPES[args.dtype],
        args.modes,
        args.providers,
        compile_backend=args.compile_backend,
        cpu_reps=1 if args.quick else 5,
        kernel_times=args.kernel_times,
        act=args.act,
    )
    path = common.write_rows("swiglu", rows)
    print(f"wrote {len(rows)} rows to {path}")
    return rows


if __name__ == "__main__":
    main()
