"""NF4/FP4 dequantization in Triton, bit for bit bitsandbytes' `bitsandbytes.functional.dequantize_4bit` (QLoRA's
4-bit weights), so that the 4-bit path needs bitsandbytes' quantization state but not its CUDA kernels.

What it computes (n = prod(shape) elements, blocks of `blocksize` consecutive elements in row-major order)
    w[e] = table[code[e]] * absmax[e // blocksize]             fp32 product, one rounding to the output dtype
where, as bitsandbytes lays the pieces out (`QuantState`, from `quantize_4bit`):
- codes: ceil(n / 2) bytes, two 4-bit codes a byte, element 2i in the HIGH nibble of byte i and 2i + 1 in the low one
  (for odd n the last low nibble is padding). `quant_storage` other than uint8 (bf16, fp16, fp32) only reinterprets
  the same bytes: they are read as uint8, in memory order.
- table: 16 fp32 values per `quant_type`, the ones compiled into bitsandbytes' CUDA kernel (csrc/kernels.cu,
  `nf4_dequantization_lut`, and `fp4_dequantization_lut[c & 7]` times the sign bit c >> 3) and its CPU kernel
  (csrc/cpu_ops.cpp `nf4_lut`/`fp4_lut`). The kernels ignore `QuantState.code`; it holds the same values, except
  that FP4's code 0b1000 is -0.0 in the kernels' tables (0 * -1) and +0.0 in `get_4bit_type`'s: we follow the
  kernels (-0.0 * absmax = -0.0 where bitsandbytes' CUDA and C++ kernels write it; only its pure-PyTorch fallback,
  which it takes on a CPU for an odd last dimension, writes +0.0 there).
- absmax: one fp32 scale per block, ceil(n / blocksize) of them. With double quantization
  (`compress_statistics=True`) they are stored as uint8 codes of an 8-bit blockwise quantization of absmax - offset
  (`NestedAbsmax`: `state2.code`, 256 fp32 values; `state2.absmax`, one fp32 scale per `state2.blocksize` = 256
  blocks; `offset`, the fp32 mean), and bitsandbytes first rebuilds them in fp32 (`dequantize_blockwise` then
  `absmax += offset`):
      absmax[b] = fl(fl(code2[qabsmax[b]] * absmax2[b // blocksize2]) + offset)     two roundings, no FMA

Why bit-exact is possible: every step is one IEEE fp32 operation (a table read, a product, for the nested scales a
product and then a sum), the same operations in the same order as bitsandbytes' kernels, followed by one
round-to-nearest-even cast. Nothing is summed over elements, so no order of operations can differ. Two things could
still break it, and both are pinned: (1) the compiler may fuse the nested scale's product and sum into one FMA (one
rounding instead of two): the launch passes `enable_fp_fusion=False` (ptxas --fmad=false), so they stay apart;
(2) the Triton interpreter casts fp32 -> bf16 by truncation (DESIGN.md), so the kernel rounds to bf16 itself,
with the integer round-to-nearest-even bitsandbytes' C++ kernel also uses (add 0x7FFF plus the kept lsb, keep the
high half; NaN kept a NaN), on the GPU as under the interpreter: one code path, exact on both.

Bytes moved per element (s = output element size; ideal DRAM traffic): read 1/2 (codes) + 4/blocksize (absmax)
(nested: 1/blocksize + 4/(blocksize * blocksize2), plus the 1 KiB code book and the offset), write s. bf16 with
blocksize 64: 0.5625 B read + 2 B written. The two 16-entry table lookups per byte and the per-row scale loads are
cache hits (bench/bench_dequantize_4bit.py's byte model counts them apart, and tests/bench/test_byte_models.py holds
its every term to the traffic meter).

Launch strategy: one launch, the nested absmax fused in. Each program covers TILE consecutive elements as a
(TILE // COLS, COLS) tile, COLS = min(blocksize, TILE), so each tile row lies inside one quantization block: its
scale is loaded once per row (a uint8 code, a code-book entry and a second-level scale when nested), not per
element. Each row reads its COLS / 2 code bytes contiguously, looks both nibbles up in the 16-entry table and
interleaves them (`tl.interleave`) into COLS contiguous outputs. Fusing the nested absmax saves the fp32 absmax
round trip through memory (4 B written + 4 B read per block: 0.125 B per element at blocksize 64, ~5% of the bf16
traffic) and a second launch. On CUDA TILE = 2048 over 4 warps (16 outputs a thread: two 16-byte bf16 stores, one
8-byte code load; chosen by that arithmetic, not yet timed on a GPU: bench/bench_dequantize_4bit.py is the place to
revisit it, against bitsandbytes' 1024 values per 64-thread block); under the interpreter (~37 us a program) one
program covers up to 65536 elements. Registers: `python -m bench.sm90 --only dequantize_4bit`.

No autograd (codes are integers; a 4-bit weight is frozen). Under torch.compile CUDA tensors go through the
`torch.ops.kernelwright.dequantize_4bit` custom op (fullgraph tracing takes it whole), CPU tensors the reference.

Test:  python -m pytest tests/kernels/test_dequantize_4bit.py -q   (CPU: Triton interpreter, against bitsandbytes)
Bench: python bench/bench_dequantize_4bit.py                       (GPU: ours vs bitsandbytes; --quick on a CPU)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._dispatch import HAS_TRITON, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

QUANT_TYPES = ("nf4", "fp4")
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # bitsandbytes' allowed 4-bit block sizes
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# bitsandbytes' tables (csrc/kernels.cu; csrc/cpu_ops.cpp has the same): NF4's 16 values, FP4's 8 magnitudes then
# the same negated (the sign bit is code & 8), so FP4's 0b1000 is -0.0 as the CUDA kernel's 0 * -1 is.
_NF4 = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
_FP4_MAGNITUDES = (0.0, 0.005208333333, 0.66666667, 1.0, 0.33333333, 0.5, 0.16666667, 0.25)
_VALUES = {"nf4": _NF4, "fp4": _FP4_MAGNITUDES + tuple(-v for v in _FP4_MAGNITUDES)}
_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}
# See the module docstring: 16 outputs a thread at 4 warps on CUDA; large tiles under the interpreter.
_GPU_TILE = 2048
_GPU_WARPS = 4
_CPU_MAX_TILE = 65536


class NestedAbsmax(NamedTuple):
    """Double quantization's second level (bitsandbytes' `QuantState.state2` and `offset`): the absmax of block b
    is fl(fl(code[qabsmax[b]] * absmax[b // blocksize]) + offset), in fp32."""

    code: torch.Tensor  # (256,) fp32 values of the 8-bit absmax codes (state2.code)
    absmax: torch.Tensor  # (ceil(n_blocks / blocksize),) fp32 scales of the absmax codes (state2.absmax)
    blocksize: int  # absmax codes per scale (state2.blocksize; 256 from quantize_4bit)
    offset: torch.Tensor | float  # () fp32 mean of the absmax, subtracted before their quantization (offset)


def code_table(quant_type: str, device: torch.device | str) -> torch.Tensor:
    """The (16,) fp32 value of each 4-bit code, as bitsandbytes' kernels hold it (cached per device)."""
    device = torch.device(device)
    key = (quant_type, device)
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(_VALUES[quant_type], dtype=torch.float32, device=device)
    return _TABLES[key]


def _pair_table(quant_type: str, device: torch.device) -> torch.Tensor:
    """(256, 2) fp32: the values of each byte's high and low nibble. The reference looks bytes up, not nibbles: one
    index per byte, with index_select: 15 ms against 60 ms for a lookup per element (4M elements, one CPU thread)."""
    key = (quant_type + "-pairs", device)
    if key not in _TABLES:
        byte = torch.arange(256, device=device)
        table = code_table(quant_type, device)
        _TABLES[key] = torch.stack((table[byte >> 4], table[byte & 0xF]), dim=1)
    return _TABLES[key]


if HAS_TRITON:

    @triton.jit
    def _dequantize_4bit_kernel(
        codes_ptr,  # (ceil(n / 2),) uint8: element 2i in the high nibble of byte i, 2i + 1 in the low one
        absmax_ptr,  # (ceil(n / BLOCKSIZE),) fp32 block scales; their uint8 codes when NESTED
        table_ptr,  # (16,) fp32 value of each 4-bit code
        code2_ptr,  # (256,) fp32 values of the absmax codes (NESTED)
        absmax2_ptr,  # (ceil(n_blocks / BLOCKSIZE2),) fp32 scales of the absmax codes (NESTED)
        offset_ptr,  # (1,) fp32 added to every dequantized absmax (NESTED)
        out_ptr,  # (n,) contiguous output, fp32/bf16/fp16
        n,  # number of elements
        BLOCKSIZE: tl.constexpr,  # elements per absmax
        BLOCKSIZE2: tl.constexpr,  # absmax codes per second-level scale (NESTED)
        TILE: tl.constexpr,  # elements per program
        COLS: tl.constexpr,  # min(BLOCKSIZE, TILE): the tile's rows each lie inside one block
        NESTED: tl.constexpr,
    ):
        ROWS: tl.constexpr = TILE // COLS
        HALF: tl.constexpr = COLS // 2
        row_start = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, ROWS) * COLS  # (ROWS,) first element
        in_rows = row_start < n
        block = row_start // BLOCKSIZE  # (ROWS,)
        if NESTED:
            q = tl.load(absmax_ptr + block, mask=in_rows, other=0).to(tl.int32)
            scale2 = tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=in_rows, other=0.0)
            # two roundings, as bitsandbytes' dequantize_blockwise then `absmax += offset`: the launch disables
            # FMA contraction (enable_fp_fusion=False)
            scale = tl.load(code2_ptr + q, mask=in_rows, other=0.0) * scale2
            scale = scale + tl.load(offset_ptr)
        else:
            scale = tl.load(absmax_ptr + block, mask=in_rows, other=0.0)
        byte = (row_start // 2)[:, None] + tl.arange(0, HALF)[None, :]  # (ROWS, HALF)
        in_bytes = byte < (n + 1) // 2
        packed = tl.load(codes_ptr + byte, mask=in_bytes, other=0)
        high = tl.load(table_ptr + (packed >> 4), mask=in_bytes, other=0.0)
        low = tl.load(table_ptr + (packed & 0xF), mask=in_bytes, other=0.0)
        vals = tl.interleave(high * scale[:, None], low * scale[:, None])  # (ROWS, COLS): high, low, high, ...
        offs = row_start[:, None] + tl.arange(0, COLS)[None, :]  # (ROWS, COLS)
        if out_ptr.dtype.element_ty == tl.bfloat16:
            # round to nearest even by hand (the interpreter truncates .to(tl.bfloat16)); NaN -> 0x7FFF as CUDA's
            # cvt.rn.bf16.f32 gives (the carry of the rounding could otherwise reach the sign bit)
            bits = vals.to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            rounded = tl.where(vals != vals, 0x7FFF, rounded)
            result = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            result = vals.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs, result, mask=offs < n)


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("kernels.dequantize_4bit: the Triton path needs triton (pip install triton)")


def launch_config(n: int, blocksize: int, on_cuda: bool) -> tuple[int, int, int]:
    """(TILE, COLS, num_warps) for n elements in blocks of blocksize (module docstring)."""
    tile = _GPU_TILE if on_cuda else min(_CPU_MAX_TILE, triton.next_power_of_2(max(n, 2)))
    return tile, min(blocksize, tile), (_GPU_WARPS if on_cuda else 4)


def _as_bytes(codes: torch.Tensor) -> torch.Tensor:
    """The packed codes as a flat uint8 tensor, whatever their storage dtype (memory order, as bitsandbytes reads)."""
    flat = codes.contiguous().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _offset_tensor(offset, device) -> torch.Tensor:
    return torch.as_tensor(offset, dtype=torch.float32, device=device).reshape(1)


def dequantize_4bit_fwd(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    quant_type: str,
    blocksize: int,
    shape,
    dtype: torch.dtype,
    nested: NestedAbsmax | None = None,
) -> torch.Tensor:
    """Launch the kernel on checked arguments (see `dequantize_4bit`). Returns a fresh (shape) tensor of dtype."""
    _require_triton()
    out = torch.empty(tuple(shape), dtype=dtype, device=codes.device)
    n = out.numel()
    if n == 0:
        return out
    table = code_table(quant_type, codes.device)
    if nested is not None:
        code2, absmax2, blocksize2 = nested.code, nested.absmax, nested.blocksize
        offset = _offset_tensor(nested.offset, codes.device)
    else:  # unused by the kernel (NESTED=False): any fp32 pointer
        code2 = absmax2 = offset = table
        blocksize2 = 1
    tile, cols, warps = launch_config(n, blocksize, codes.is_cuda)
    _dequantize_4bit_kernel[(triton.cdiv(n, tile),)](
        _as_bytes(codes),
        absmax.contiguous(),
        table,
        code2.contiguous(),
        absmax2.contiguous(),
        offset,
        out,
        n,
        BLOCKSIZE=blocksize,
        BLOCKSIZE2=blocksize2,
        TILE=tile,
        COLS=cols,
        NESTED=nested is not None,
        num_warps=warps,
        enable_fp_fusion=False,  # the nested scale's product and sum round separately (module docstring)
    )
    return out


# One op namespace for the project (see kernels/neftune.py): what torch.compile traces on CUDA, as one opaque call.
@torch.library.custom_op("kernelwright::dequantize_4bit", mutates_args=())
def _dequantize_4bit_op(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    quant_type: str,
    blocksize: int,
    shape: list[int],
    dtype: torch.dtype,
    code2: torch.Tensor | None,
    absmax2: torch.Tensor | None,
    blocksize2: int,
    offset: torch.Tensor | None,
) -> torch.Tensor:
    nested = None if code2 is None else NestedAbsmax(code2, absmax2, blocksize2, offset)
    return dequantize_4bit_fwd(codes, absmax, quant_type, blocksize, shape, dtype, nested)


@_dequantize_4bit_op.register_fake
def _(codes, absmax, quant_type, blocksize, shape, dtype, code2, absmax2, blocksize2, offset):
    return torch.empty(shape, dtype=dtype, device=codes.device)


def _check_args(codes, absmax, quant_type, blocksize, shape, dtype, nested) -> None:
    """One-line ValueErrors for bad arguments."""
    name = "dequantize_4bit"
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"{name}: quant_type must be 'nf4' or 'fp4', got {quant_type!r}")
    if isinstance(blocksize, bool) or blocksize not in BLOCKSIZES:
        raise ValueError(f"{name}: blocksize must be one of {', '.join(map(str, BLOCKSIZES))}, got {blocksize!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"{name}: dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"{name}: shape must be non-negative integers, got {tuple(shape)}")
    n = math.prod(shape)
    n_blocks = -(-n // blocksize)
    if not isinstance(codes, torch.Tensor) or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise ValueError(f"{name}: codes must be a tensor of packed 4-bit codes (any real storage dtype)")
    if codes.numel() * codes.element_size() < (n + 1) // 2:
        have = codes.numel() * codes.element_size()
        raise ValueError(f"{name}: codes hold {have} bytes, {n} elements need {(n + 1) // 2}")
    # (what, tensor, dtype, at least this many elements)
    wanted = [("absmax", absmax, torch.float32 if nested is None else torch.uint8, n_blocks)]
    if nested is not None:
        if not isinstance(nested, NestedAbsmax):
            raise ValueError(f"{name}: nested must be a NestedAbsmax(code, absmax, blocksize, offset) or None")
        if isinstance(nested.blocksize, bool) or not isinstance(nested.blocksize, int) or nested.blocksize <= 0:
            raise ValueError(f"{name}: nested.blocksize must be a positive integer, got {nested.blocksize!r}")
        wanted.append(("nested.code", nested.code, torch.float32, 256))
        wanted.append(("nested.absmax", nested.absmax, torch.float32, -(-n_blocks // nested.blocksize)))
        if not isinstance(nested.offset, (int, float)) or isinstance(nested.offset, bool):
            wanted.append(("nested.offset", nested.offset, torch.float32, 1))
    for what, t, want_dtype, want_numel in wanted:
        if not isinstance(t, torch.Tensor) or t.dtype != want_dtype or t.numel() < want_numel:
            got = f"{t.dtype} with {t.numel()} elements" if isinstance(t, torch.Tensor) else type(t).__name__
            want = f"a {want_dtype} tensor of at least {want_numel} elements"
            raise ValueError(f"{name}: {what} must be {want}, got {got}")
        if t.device != codes.device:
            raise ValueError(f"{name}: {what} is on {t.device}, codes on {codes.device}")


def dequantize_4bit(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    quant_type: str,
    blocksize: int,
    shape,
    dtype: torch.dtype,
    nested: NestedAbsmax | None = None,
) -> torch.Tensor:
    """bitsandbytes' `dequantize_4bit(codes, quant_state)`, bit for bit, from the quantization state's pieces (the
    arguments of its `torch.ops.bitsandbytes.dequantize_4bit`, plus the double quantization's):

        codes       packed 4-bit codes, any storage dtype (`quant_storage`), read as bytes (QuantState's `A`)
        absmax      (ceil(n / blocksize),) fp32 block scales; uint8 when `nested` (state.absmax)
        quant_type  'nf4' or 'fp4' (state.quant_type)
        blocksize   elements per block, 32 ... 4096 (state.blocksize)
        shape       the output's shape, n = prod(shape) (state.shape)
        dtype       fp32, bf16 or fp16 (state.dtype)
        nested      NestedAbsmax(state.state2.code, state.state2.absmax, state.state2.blocksize, state.offset)
                    when the absmax are double quantized (state.nested), else None

    Returns a fresh contiguous tensor of `shape` and `dtype` (bitsandbytes transposes the result when its input has
    a single row, a compatibility shim for an old layout; we never do). CUDA tensors run the Triton kernel, CPU
    tensors the reference (see `kernels._dispatch`)."""
    _check_args(codes, absmax, quant_type, blocksize, shape, dtype, nested)
    if not use_triton(codes, absmax):
        return dequantize_4bit_ref(codes, absmax, quant_type, blocksize, shape, dtype, nested)
    if torch.compiler.is_compiling():
        n2 = nested or NestedAbsmax(None, None, 1, None)
        offset = None if nested is None else _offset_tensor(nested.offset, codes.device)
        return torch.ops.kernelwright.dequantize_4bit(
            codes, absmax, quant_type, blocksize, list(shape), dtype, n2.code, n2.absmax, n2.blocksize, offset
        )
    return dequantize_4bit_fwd(codes, absmax, quant_type, blocksize, shape, dtype, nested)


def dequantize_4bit_ref(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    quant_type: str,
    blocksize: int,
    shape,
    dtype: torch.dtype,
    nested: NestedAbsmax | None = None,
) -> torch.Tensor:
    """Plain PyTorch, the same fp32 operations as the kernel and bitsandbytes (module docstring): bit for bit."""
    n = math.prod(shape)
    n_blocks = -(-n // blocksize)
    packed = _as_bytes(codes)[: (n + 1) // 2]  # (ceil(n / 2),) uint8
    values = _pair_table(quant_type, codes.device).index_select(0, packed.long())  # (ceil(n / 2), 2) fp32
    values = values.reshape(-1)[:n]  # (n,): element 2i from byte i's high nibble, 2i + 1 from its low one
    if nested is None:
        scale = absmax.reshape(-1)[:n_blocks]  # (n_blocks,) fp32
    else:
        blocks = torch.arange(n_blocks, device=codes.device)
        codes2 = absmax.reshape(-1)[:n_blocks].long()  # (n_blocks,)
        scale = nested.code[codes2] * nested.absmax.reshape(-1)[blocks // nested.blocksize]
        scale = scale + _offset_tensor(nested.offset, codes.device)  # a second rounding, as bitsandbytes' `+=`
    values = F.pad(values, (0, n_blocks * blocksize - n)).view(n_blocks, blocksize)  # (n_blocks, blocksize)
    return (values * scale[:, None]).reshape(-1)[:n].to(dtype).view(tuple(shape))
