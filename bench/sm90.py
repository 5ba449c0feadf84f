"""Compile every Triton kernel configuration our launchers choose at the benchmark shapes for sm_90 (H100),
on a machine without a GPU, and report registers, spills and shared memory per kernel.

How (no GPU, no CUDA build of torch needed):
1. `fake_cuda()`: the launchers run on meta tensors that claim to live on cuda:0 (a TorchFunctionMode answers
   `.is_cuda` / `.device` for meta tensors, turns `device="cuda"` into meta and makes `pin_memory` a no-op;
   `torch.cuda.get_device_properties` reports an H100's 132 SMs). Shapes, strides and dtypes are real, data
   is absent, so an 8192 x 128256 problem costs nothing. The public functionals run forward and backward
   through autograd, so what is recorded is exactly what a training step launches.
2. `record_launches()`: `JITFunction.run` is replaced by a recorder: each launch keeps its kernel, arguments
   and options (num_warps, num_stages) and launches nothing. Tensor arguments become stand-ins whose address
   is their storage offset in bytes (a fresh CUDA allocation is 512-byte aligned, so the alignment Triton
   specialises on is the one the GPU would see).
3. `compile_sm90()`: the launch is specialised the way `JITFunction.run` does it (Triton's own binder, for a
   GPUTarget("cuda", 90, 32) backend), compiled with `triton.compile`, and the bundled ptxas's `-v` log is
   parsed (`n_regs`/`n_spills` of a CompiledKernel are only filled in when a GPU driver loads the binary).
   `always_compile` and a fresh cache directory per run: nothing is reused between runs.

4. `sass_opcodes()` (with `--sass`): the cubin disassembled by the bundled cuobjdump, SASS instructions counted by
   opcode (with modifiers: IMAD.HI.U32, LDG.E.128, ...). A static count per program; for a kernel without loops
   (an elementwise tile) it is what each thread issues, so divided by the elements per thread it is an instruction
   count per element: a model of an arithmetic-bound kernel's cost compiled on a CPU, not a GPU measurement.

Needs TRITON_INTERPRET unset (interpreted kernels cannot be compiled); the test runs this in a subprocess.

    python -m bench.sm90                 # table: kernel, constexprs, warps, stages, registers, spills, shared
    python -m bench.sm90 --only rms_norm --json
    python -m bench.sm90 --only neftune --sass   # + SASS instructions and the most frequent opcodes per kernel
Exit status 1 when any kernel spills.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import io
import json
import re
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable
from pathlib import Path

import torch
from torch._library.triton import set_wrap_triton_enabled
from torch.autograd.graph import _engine_run_backward
from torch.overrides import TorchFunctionMode

if __package__ in (None, ""):  # run as a script: make `kernels` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

import kernels  # noqa: E402
from kernels.adamw import FusedAdamW  # noqa: E402
from kernels.dequantize_4bit import NestedAbsmax  # noqa: E402
from kernels.moe import ExpertLoRA  # noqa: E402
from kernels.rms_norm import clear_launch_plans  # noqa: E402
from kernels.rope import rope_launch  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
H100_SMS = 132  # H100 SXM; the launchers size persistent grids from it
_META = torch.device("meta")
_CUDA = torch.device("cuda", 0)
# Triton compiles pointers 16-byte aligned when their address is; CUDA's caching allocator hands out
# 512-byte aligned blocks, so a view's address modulo 16 is its storage offset in bytes modulo 16.
_BLOCK_BASE = 1 << 20


class _FakeCuda(TorchFunctionMode):
    """Meta tensors that say they are on cuda:0 (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        if owner is torch._C.TensorBase.is_cuda:
            return args[0].is_meta or func(*args)
        if owner is torch._C.TensorBase.device:
            where = func(*args)
            return _CUDA if where.type == "meta" else where
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.device:  # the constructor takes "cuda" as it is (bitsandbytes builds cuda:0 at import)
            return func(*args, **kwargs)
        args = tuple(_to_meta(a) for a in args)
        kwargs = {k: _to_meta(v) for k, v in kwargs.items()}
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            # The mode is popped while its handler runs, but the launchers that backward reaches must see cuda too:
            # push it back and call the engine directly (every public entry point would come back here).
            if func is torch.Tensor.backward:
                tensors, grads = (args[0],), (args[1] if len(args) > 1 else kwargs["gradient"],)
            else:  # the function form: tensors and their gradients
                tensors, grads = tuple(args[0]), tuple(args[1] if len(args) > 1 else kwargs["grad_tensors"])
            with self:
                return _engine_run_backward(
                    tensors, grads, False, False, (), allow_unreachable=True, accumulate_grad=True
                )
        return func(*args, **kwargs)


def _to_meta(v):
    if isinstance(v, str) and v.startswith("cuda") or isinstance(v, torch.device) and v.type == "cuda":
        return _META
    return v


@contextlib.contextmanager
def fake_cuda():
    """Launchers see an H100: meta tensors report cuda:0 and the device has H100_SMS multiprocessors, compute capability
    9.0 (transformers' grouped_mm experts ask)."""
    saved = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(
        multi_processor_count=H100_SMS, major=9, minor=0
    )
    clear_launch_plans()  # kernels/rms_norm.py caches launch plans made from the SM count: not the machine's here
    try:
        # On meta tensors torch.library.wrap_triton's higher-order op takes its meta kernel, which launches
        # nothing; on a GPU in eager it runs kernel[grid](...) with the same arguments, which this makes it do.
        with _FakeCuda(), set_wrap_triton_enabled(False):
            yield
    finally:
        torch.cuda.get_device_properties = saved
        clear_launch_plans()  # and those made here do not outlive it


@dataclasses.dataclass(frozen=True)
class _Pointer:
    """A tensor argument as Triton's specialisation sees it: a dtype and an address."""

    dtype: torch.dtype
    address: int

    def data_ptr(self) -> int:
        return self.address


@dataclasses.dataclass
class Launch:
    kernel: JITFunction
    args: tuple
    kwargs: dict

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


def _argument(v):
    if isinstance(v, torch.Tensor):
        return _Pointer(v.dtype, _BLOCK_BASE + v.storage_offset() * v.element_size())
    return v


def _pointer_launch(kernel, args, kwargs) -> Launch:
    return Launch(kernel, tuple(_argument(a) for a in args), {k: _argument(v) for k, v in kwargs.items()})


@contextlib.contextmanager
def record_launches(entry: Callable = _pointer_launch):
    """Yields a list that receives entry(kernel, args, kwargs) for every Triton launch made inside, instead of
    launching it (compiled `JITFunction`s and, under TRITON_INTERPRET=1, `InterpretedFunction`s alike). The default
    entry is a `Launch` whose tensors are stand-ins (dtype and address), so no tensor is held."""
    launches: list = []
    saved = JITFunction.run, InterpretedFunction.run

    def record(kernel, *args, grid, warmup, **kwargs):
        launches.append(entry(kernel, args, kwargs))

    JITFunction.run = InterpretedFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run, InterpretedFunction.run = saved


@dataclasses.dataclass
class Compiled:
    case: str
    kernel: str
    constexprs: dict  # the constexpr arguments and the integer arguments Triton specialised to constants
    num_warps: int
    num_stages: int
    registers: int  # per thread
    spill_stores: int  # bytes per thread
    spill_loads: int  # bytes per thread
    stack_frame: int  # bytes per thread
    shared: int  # bytes per program
    ptx_fma_f32: int  # fused multiply-adds in the PTX (fma.rn.f32): 0 where a kernel must round products and sums apart
    sass: dict[str, int] | None = None  # SASS opcode -> instructions in the cubin (compile_cases(sass=True) only)

    @property
    def instructions(self) -> int:
        """SASS instructions of one program, NOPs (scheduling and alignment padding) left out."""
        if self.sass is None:
            raise ValueError("bench.sm90: compiled without sass=True")
        return sum(n for op, n in self.sass.items() if op != "NOP")


_REGISTERS = re.compile(r"Used (\d+) registers")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
# One SASS instruction of cuobjdump -sass: "/*0120*/  [@P0 | @!UP1 ] OPCODE.MODIFIERS operands ;"
_SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?\w+\s+)?([A-Z][A-Z0-9_.]*)", re.MULTILINE)


def sass_opcodes(cubin: bytes) -> collections.Counter:
    """Opcode (with modifiers) -> count over every function of a cubin, disassembled by Triton's bundled cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [triton.knobs.nvidia.cuobjdump.path, "-sass", f.name], capture_output=True, text=True, check=True
        ).stdout
    counts = collections.Counter(_SASS_LINE.findall(text))
    if not counts:
        raise RuntimeError(f"bench.sm90: no SASS instruction in cuobjdump's output:\n{text[:2000]}")
    return counts


def _specialise(launch: Launch, backend):
    """(cache key, signature, constexprs, attrs, options) of a launch, as JITFunction.run computes them."""
    kernel = launch.kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(launch.kwargs, debug=False)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    key = (kernel, str(specialization), str(options))
    return (
        key,
        *kernel._pack_args(backend, kwargs, bound_args, specialization, options)[1:],
        backend.parse_options(kwargs),
    )


def compile_sm90(case: str, launch: Launch, signature, constexprs, attrs, options, sass: bool = False) -> Compiled:
    """Compile one specialised launch for sm_90 and read ptxas's report (and, with sass, count its SASS opcodes)."""
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # knobs.nvidia.dump_ptxas_log prints ptxas -v's report
        compiled = triton.compile(
            ASTSource(launch.kernel, signature, constexprs, attrs), target=TARGET, options=options.__dict__
        )
    text = log.getvalue()
    registers = [int(n) for n in _REGISTERS.findall(text)]
    frames = [tuple(map(int, f)) for f in _FRAME.findall(text)]
    if not registers or not frames:
        raise RuntimeError(f"bench.sm90: no ptxas -v report for {launch.name}:\n{text}")
    names = [launch.kernel.params[path[0]].name for path in constexprs]
    return Compiled(
        case=case,
        kernel=launch.name,
        constexprs={n: str(v) for n, v in zip(names, constexprs.values())},
        num_warps=options.num_warps,
        num_stages=options.num_stages,
        registers=max(registers),
        stack_frame=max(f[0] for f in frames),
        spill_stores=max(f[1] for f in frames),
        spill_loads=max(f[2] for f in frames),
        shared=compiled.metadata.shared,
        ptx_fma_f32=compiled.asm["ptx"].count("fma.rn.f32"),
        sass=dict(sass_opcodes(compiled.asm["cubin"]).most_common()) if sass else None,
    )


# ---------------------------------------------------------------------------------------------------------
# The benchmark shapes (bench/bench_<op>.py): each case runs one op's public API forward and backward.
# ---------------------------------------------------------------------------------------------------------


def _cuda(*shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(shape, dtype=dtype, device="cuda", requires_grad=grad)


def _cross_entropy():
    # Llama 3's vocabulary, 8192 tokens; mean reduction (scale in place) and "none" (per-row scale); Gemma 2's final
    # softcapping (30) with label smoothing, the forward's largest configuration
    for reduction, options in (("mean", {}), ("none", {}), ("mean", dict(softcap=30.0, label_smoothing=0.1))):
        logits = _cuda(8192, 128256, grad=True)
        target = torch.empty(8192, dtype=torch.int64, device="cuda")
        loss = kernels.cross_entropy(logits, target, reduction=reduction, **options)
        loss.backward(torch.empty_like(loss))


def _fused_linear_cross_entropy():
    # "none" with a bf16 weight runs the vocabulary pass's slice kernel, also softcapped (Gemma 2)
    for reduction, softcap in (("mean", None), ("none", None), ("none", 30.0)):
        hidden, weight = _cuda(8192, 4096, grad=True), _cuda(128256, 4096, grad=True)
        target = torch.empty(8192, dtype=torch.int64, device="cuda")
        loss = kernels.fused_linear_cross_entropy(hidden, weight, target, reduction=reduction, softcap=softcap)
        loss.backward(torch.empty_like(loss))


def _fused_linear_preference():
    # A DPO step's LM head at Llama-3.2-1B (bench_fused_linear_preference.py): 8 pairs of 1024 tokens, half of each a
    # prompt, labels on the host; the reference pass under no_grad, then the policy's forward and backward (bf16
    # weight: the token pass with per-row scales and the vocabulary pass).
    hidden, weight = _cuda(16, 1024, 2048, grad=True), _cuda(128256, 2048, grad=True)
    target = torch.randint(0, 128256, (16, 1024))
    target[:, :512] = -100
    with torch.no_grad():
        kernels.fused_linear_preference(hidden, weight, target)
    kernels.fused_linear_preference(hidden, weight, target).logps.backward(_cuda(16, dtype=torch.float32))


def _rms_norm():
    # The benchmark widths, plus two narrow ones whose tiles hold several rows (BLOCK_M 32 and 4), and 12288: a
    # 16384-wide backward block with masked columns (unpipelined, kernels/rms_norm.py's bwd_launch_config); fp16 and
    # fp32 around the backward's width switches (one 16384-wide block: fp16 upcast twice, fp32 reloading the weight).
    cases = [(hidden, torch.bfloat16) for hidden in (128, 1024, 4096, 8192, 12288, 16384, 32768)]
    cases += [(hidden, dtype) for dtype in (torch.float16, torch.float32) for hidden in (8192, 12288, 16384, 32768)]
    for hidden, dtype in cases:
        x, w = _cuda(8192, hidden, dtype=dtype, grad=True), _cuda(hidden, dtype=dtype, grad=True)
        y = kernels.rms_norm(x, w)
        y.backward(torch.empty_like(y))


def _fused_add_rms_norm():
    # The RMSNorm widths, bf16 x and residual with both outputs' gradients; and the model's case under autocast at
    # Llama-3-8B's width: a bf16 update added to the fp32 residual stream (h, normed and dresidual fp32, dx bf16).
    # Above 8192: fp16 and fp32 throughout (one 16384-wide block with d_h_out; fp16 unpipelined at exactly 16384), and
    # the autocast case at 16384 (dx in two dtypes: fp32's 8192-wide column loop).
    cases = [(hidden, torch.bfloat16, torch.bfloat16) for hidden in (128, 1024, 4096, 8192, 16384, 32768)]
    cases += [(4096, torch.bfloat16, torch.float32), (16384, torch.bfloat16, torch.float32)]
    cases += [(hidden, dtype, dtype) for dtype in (torch.float16, torch.float32) for hidden in (12288, 16384)]
    for hidden, x_dtype, res_dtype in cases:
        x, w = _cuda(8192, hidden, dtype=x_dtype, grad=True), _cuda(hidden, dtype=res_dtype, grad=True)
        residual = _cuda(8192, hidden, dtype=res_dtype, grad=True)
        normed, h = kernels.fused_add_rms_norm(x, residual, w)
        torch.autograd.backward([normed, h], [torch.empty_like(normed), torch.empty_like(h)])


def _adamw():
    # A Llama-like parameter list (an embedding, projections, a norm): fp32, bf16 with fp32 masters or stochastic
    # rounding, each with fp32 moments, and fp32 / bf16-with-masters parameters with bf16 moments.
    shapes = [(128256, 2048), (2048, 2048), (8192, 2048), (2048,)]
    for dtype, master, state_dtype in (
        (torch.float32, True, torch.float32),
        (torch.bfloat16, True, torch.float32),
        (torch.bfloat16, False, torch.float32),
        (torch.float32, True, torch.bfloat16),
        (torch.bfloat16, True, torch.bfloat16),
    ):
        params = [torch.nn.Parameter(_cuda(*s, dtype=dtype)) for s in shapes]
        for p in params:
            p.grad = torch.empty_like(p)
        FusedAdamW(params, lr=1e-4, master_weights=master, state_dtype=state_dtype).step()


def _neftune():
    # bench_neftune's 8 x 4096 x 4096 in bf16 (with and without an attention mask), fp16 and fp32; and a tensor past
    # 2^31 elements (17 x 8192 x 16384 bf16, 4.6 GB), whose offsets need 64 bits
    mask = torch.empty(8, 4096, dtype=torch.int64, device="cuda")
    for dtype, attention_mask in (
        (torch.bfloat16, None),
        (torch.bfloat16, mask),
        (torch.float16, None),
        (torch.float32, None),
    ):
        embeds = _cuda(8, 4096, 4096, dtype=dtype, grad=True)
        y = kernels.neftune_noise(embeds, 5.0, attention_mask=attention_mask)
        y.backward(torch.empty_like(y))
    kernels.neftune_noise(_cuda(17, 8192, 16384), 5.0)


def _rope():
    # bench_rope's shapes (Llama-3-8B heads, q and k as (B, H, T, D) transposes of (B, T, H, D) projections), bf16
    # and fp32 inputs; cos/sin per row (4 x 8192) and shared by the batch (the launcher's CUDA choice: one program per
    # (position, batch) either way); and a program looping over the batch (the interpreter's choice), whose runtime
    # batch count is not specialised.
    for dtype, batch, seq, cos_batch in (
        (torch.bfloat16, 4, 8192, 4),
        (torch.bfloat16, 4, 8192, 1),
        (torch.float32, 1, 2048, 1),
    ):
        q = _cuda(batch, seq, 32, 128, dtype=dtype, grad=True).transpose(1, 2)
        k = _cuda(batch, seq, 8, 128, dtype=dtype, grad=True).transpose(1, 2)
        cos = sin = _cuda(cos_batch, seq, 128, dtype=torch.float32)
        q_rot, k_rot = kernels.rope(q, k, cos, sin)
        # Output gradients as attention's backward hands them: (B, T, H, D) memory.
        grads = [_cuda(batch, seq, h, 128, dtype=dtype).transpose(1, 2) for h in (32, 8)]
        torch.autograd.backward([q_rot, k_rot], grads)
        if cos_batch == 1 and batch > 1:
            for backward in (False, True):
                rope_launch(q, k, cos, sin, backward=backward, batches_per_program=batch)


def _swiglu():
    # Llama-3-8B's MLP: 8192 tokens x intermediate 14336.
    gate, up = _cuda(8192, 14336, grad=True), _cuda(8192, 14336, grad=True)
    out = kernels.swiglu(gate, up)
    out.backward(torch.empty_like(out))
    # Llama-3-8B's down projection over it: the backward kernel that also writes act (kernels.swiglu_linear)
    out = kernels.swiglu_linear(gate, up, _cuda(4096, 14336, grad=True))
    out.backward(torch.empty_like(out))
    # GeGLU (Gemma's MLP): the same kernels with the tanh GELU
    out = kernels.geglu_linear(gate, up, _cuda(4096, 14336, grad=True))
    out.backward(torch.empty_like(out))


def _causal_conv1d():
    # Qwen3.5-9B's Gated DeltaNet: 8192 tokens x 8192 conv channels, 4 taps, bf16 and fp32; one packed row
    for dtype in (torch.bfloat16, torch.float32):
        x = _cuda(1, 8192, 8192, dtype=dtype, grad=True)
        y = kernels.causal_conv1d(x, _cuda(8192, 4, dtype=dtype, grad=True), cu_seqlens=torch.tensor([0, 4096, 8192]))
        y.backward(torch.empty_like(y))


def _gated_rms_norm():
    # Qwen3.5-9B's Gated DeltaNet: 8192 tokens x 32 value heads of 128, bf16 and fp32
    for dtype in (torch.bfloat16, torch.float32):
        x, z = _cuda(8192 * 32, 128, dtype=dtype, grad=True), _cuda(8192 * 32, 128, dtype=dtype, grad=True)
        y = kernels.gated_rms_norm(x, z, _cuda(128, dtype=dtype, grad=True))
        y.backward(torch.empty_like(y))


def _moe_experts():
    # bench_moe's GPU shapes at 8192 tokens: Qwen3-30B-A3B's experts (H 2048, I 768, E 128, k 8; concatenated
    # (E, 2I, H) layout, SwiGLU) and gpt-oss-20b's (H 2880, I 2880, E 32, k 4; transposed, interleaved, biases, the
    # clamped activation), bf16; and at Qwen3's shape what training under bf16 autocast runs (our model's experts:
    # bf16 tokens, the fp32 master weights cast tile by tile inside the kernels, fp32 weight gradients). The fp32 path
    # (IEEE fp32 dots, GPU_TILES_F32) compiled without spills when it landed (kernels/moe.py's docstring); it is not
    # compiled here, to keep this test's time (`--only moe_experts` after changing it)
    cases = (
        (2048, 768, 128, 8, torch.bfloat16, torch.bfloat16, dict(transposed=False, interleaved=False, act="silu"), 0),
        (2880, 2880, 32, 4, torch.bfloat16, torch.bfloat16, dict(transposed=True, interleaved=True, act="gpt_oss"), 1),
        (2048, 768, 128, 8, torch.bfloat16, torch.float32, dict(transposed=False, interleaved=False, act="silu"), 0),
    )
    for hidden, inter, experts, k, dtype, w_dtype, layout, bias in cases:
        x = _cuda(8192, hidden, dtype=dtype, grad=True)
        index = torch.empty(8192, k, dtype=torch.int64, device="cuda")
        weights = _cuda(8192, k, dtype=dtype, grad=True)
        w1 = _cuda(
            *((experts, hidden, 2 * inter) if layout["transposed"] else (experts, 2 * inter, hidden)),
            dtype=w_dtype,
            grad=True,
        )
        w2 = _cuda(
            *((experts, inter, hidden) if layout["transposed"] else (experts, hidden, inter)), dtype=w_dtype, grad=True
        )
        b1 = _cuda(experts, 2 * inter, dtype=w_dtype, grad=True) if bias else None
        b2 = _cuda(experts, hidden, dtype=w_dtype, grad=True) if bias else None
        out = kernels.moe_experts(x, index, weights, w1, w2, b1, b2, **layout)
        out.backward(torch.empty_like(out))
    # LoRA r 16 on both expert tensors at Qwen3's shape under autocast (frozen fp32 weights, fp32 factors): the rank
    # GEMMs fused into the four kernels, and the factors' four weight-gradient passes
    hidden, inter, experts, k, rank = 2048, 768, 128, 8, 16
    x = _cuda(8192, hidden, dtype=torch.bfloat16, grad=True)
    index = torch.empty(8192, k, dtype=torch.int64, device="cuda")
    weights = _cuda(8192, k, dtype=torch.bfloat16, grad=True)
    w1 = _cuda(experts, 2 * inter, hidden, dtype=torch.float32)
    w2 = _cuda(experts, hidden, inter, dtype=torch.float32)
    f32 = torch.float32
    loras = [
        ExpertLoRA(
            _cuda(rank * experts, fan_in, dtype=f32, grad=True),
            _cuda(fan_out, rank * experts, dtype=f32, grad=True),
            2.0,
        )
        for fan_in, fan_out in ((hidden, 2 * inter), (inter, hidden))
    ]
    out = kernels.moe_experts(x, index, weights, w1, w2, gate_up_lora=loras[0], down_lora=loras[1])
    out.backward(torch.empty_like(out))


def _dequantize_4bit():
    # Llama-3-8B's MLP weight (14336 x 4096) as QLoRA stores it: NF4 codes, blocksize 64, bf16 out, plain and double
    # quantized absmax; fp32 and fp16 outputs; blocksize 4096 (larger than a program's tile: one scale per program).
    n = 14336 * 4096
    table = {"code2": _cuda(256, dtype=torch.float32), "offset": _cuda(dtype=torch.float32)}
    for blocksize, dtype, nested in (
        (64, torch.bfloat16, False),
        (64, torch.bfloat16, True),
        (64, torch.float32, True),
        (64, torch.float16, False),
        (4096, torch.bfloat16, True),
    ):
        codes = _cuda(n // 2, 1, dtype=torch.uint8)
        blocks = n // blocksize
        absmax = _cuda(blocks, dtype=torch.uint8 if nested else torch.float32)
        second = None
        if nested:
            second = NestedAbsmax(table["code2"], _cuda(-(-blocks // 256), dtype=torch.float32), 256, table["offset"])
        kernels.dequantize_4bit(codes, absmax, "nf4", blocksize, (14336, 4096), dtype, second)


CASES: dict[str, Callable[[], None]] = {
    "cross_entropy": _cross_entropy,
    "fused_linear_cross_entropy": _fused_linear_cross_entropy,
    "fused_linear_preference": _fused_linear_preference,
    "rms_norm": _rms_norm,
    "fused_add_rms_norm": _fused_add_rms_norm,
    "adamw": _adamw,
    "neftune": _neftune,
    "rope": _rope,
    "swiglu": _swiglu,
    "gated_rms_norm": _gated_rms_norm,
    "causal_conv1d": _causal_conv1d,
    "dequantize_4bit": _dequantize_4bit,
    "moe_experts": _moe_experts,
}


def compile_cases(names=None, sass: bool = False) -> list[Compiled]:
    """Every distinct kernel configuration the named cases (default: all) launch, compiled for sm_90 (with sass: and
    their SASS opcodes counted)."""
    if triton.knobs.runtime.interpret:
        raise ValueError("bench.sm90: unset TRITON_INTERPRET (interpreted kernels cannot be compiled for sm_90)")
    unknown = sorted(set(names or ()) - set(CASES))
    if unknown:
        raise ValueError(f"bench.sm90: unknown case(s) {', '.join(unknown)} (allowed: {', '.join(CASES)})")
    backend = make_backend(TARGET)
    results = []
    with (
        tempfile.TemporaryDirectory() as cache,
        triton.knobs.cache.scope(),
        triton.knobs.compilation.scope(),
        triton.knobs.nvidia.scope(),
    ):
        triton.knobs.cache.dir = cache
        triton.knobs.compilation.always_compile = True
        triton.knobs.nvidia.dump_ptxas_log = True
        for name in names or CASES:
            with record_launches() as launches, fake_cuda():
                CASES[name]()
            if not launches:
                raise RuntimeError(f"bench.sm90: case {name} launched no Triton kernel (did its dispatch change?)")
            seen = set()
            for launch in launches:
                key, *specialised = _specialise(launch, backend)
                if key not in seen:  # e.g. one launch per token chunk: compile each configuration once
                    seen.add(key)
                    results.append(compile_sm90(name, launch, *specialised, sass=sass))
    return results


def spilled(results: list[Compiled]) -> list[Compiled]:
    return [r for r in results if r.spill_stores or r.spill_loads]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help=f"comma-separated cases (default all: {','.join(CASES)})")
    parser.add_argument("--json", action="store_true", help="one JSON object per kernel configuration")
    parser.add_argument("--sass", action="store_true", help="disassemble each cubin and count its SASS opcodes")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    try:
        results = compile_cases(names, sass=args.sass)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.json:
        for r in results:
            extra = {"instructions": r.instructions} if r.sass is not None else {}
            print(json.dumps({**dataclasses.asdict(r), **extra}))
    else:
        print(
            f"{'case':<27}{'kernel':<30}{'warps':>6}{'stages':>7}{'regs':>6}"
            f"{'spill st/ld':>13}{'shared':>8}  constexprs"
        )
        for r in results:
            consts = " ".join(f"{k}={v}" for k, v in r.constexprs.items())
            print(
                f"{r.case:<27}{r.kernel:<30}{r.num_warps:>6}{r.num_stages:>7}{r.registers:>6}"
                f"{f'{r.spill_stores}/{r.spill_loads}':>13}{r.shared:>8}  {consts}"
            )
            if r.sass is not None:
                top = " ".join(f"{op} {n}" for op, n in list(r.sass.items())[:12])
                print(f"{'':<27}SASS: {r.instructions} instructions (NOPs left out); {top}")
    return 1 if spilled(results) else 0


if __name__ == "__main__":
    sys.exit(main())
