"""NF4/FP4 dequantization: the Triton kernel (through the interpreter on CPU) and the reference against the 4-bit
format and bitsandbytes' `dequantize_4bit`, bit for bit.

Tolerance model: none. Every output element is one fp32 product rounded once (module docstring of
kernels/dequantize_4bit.py), so ours must equal the format's definition in every bit, compared as integers (-0.0 and
+0.0 differ, subnormals count; NaN payloads are compared too), on every CPU. Against bitsandbytes the comparison is
bit for bit up to what its CPU paths choose, the sign of a zero and the flush of a subnormal result, on each of its
paths: the one this CPU takes, its PyTorch fallback, and its AVX512-BF16 kernel's choices (tests/bnb_paths.py says
which are run and which modelled). No test reads the CPU's capabilities to predict bitsandbytes' result.

Run: python -m pytest tests/kernels/test_dequantize_4bit.py -q
"""

from __future__ import annotations

import importlib

import pytest
import torch

import kernels
from kernels.dequantize_4bit import (
    NestedAbsmax,
    code_table,
    dequantize_4bit,
    dequantize_4bit_fwd,
    dequantize_4bit_ref,
)
from tests.tolerance import PoisonedTorch

bnb_functional = pytest.importorskip("bitsandbytes.functional")
from tests.bnb_paths import (  # noqa: E402
    assert_agrees,
    assert_bit_equal,
    assert_matches_every_path,
    bits,
    bnb_dequantize,
    definition_of,
)

mod = importlib.import_module("kernels.dequantize_4bit")
PATHS = ["triton", "reference"]
QUANT_TYPES = ["nf4", "fp4"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (shape, blocksize, quant_storage): whole blocks; a partial last block and a partial last group of 256 blocks (the
# nested state); an odd number of elements (a padding nibble); codes in bf16, fp16 and fp32 storage; 3-D; bitsandbytes'
# smallest and largest blocksizes (4096: larger than the GPU's tile of 2048, see test_gpu_tile_under_the_interpreter)
CASES = [
    ((64, 192), 64, torch.uint8),
    ((300, 902), 64, torch.uint8),
    ((7, 1001), 128, torch.uint8),
    ((3, 50, 22), 256, torch.bfloat16),
    ((9, 32), 32, torch.float32),
    ((33, 4100), 4096, torch.float16),
]


def _ids(case):
    shape, blocksize, storage = case
    return f"{'x'.join(map(str, shape))}-bs{blocksize}-{str(storage).removeprefix('torch.')}"


def pieces(codes, state):
    """Our arguments from bitsandbytes' packed codes and QuantState (what trainer/model/quant.py passes)."""
    nested = None
    if state.nested:
        nested = NestedAbsmax(state.state2.code, state.state2.absmax, state.state2.blocksize, state.offset)
    return codes, state.absmax, state.quant_type, state.blocksize, state.shape, state.dtype, nested


def quantized(shape, blocksize, storage, quant_type, double_quant, dtype, seed=0):
    """A random weight of dtype quantized by bitsandbytes: (codes, QuantState)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(shape, generator=g) * 0.05).to(dtype)
    w.view(-1)[::97] *= 40  # some outliers: blocks with very different absmax
    return bnb_functional.quantize_4bit(
        w, blocksize=blocksize, compress_statistics=double_quant, quant_type=quant_type, quant_storage=storage
    )


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("double_quant", [False, True], ids=["absmax32", "nested"])
@pytest.mark.parametrize("quant_type", QUANT_TYPES)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_matches_bitsandbytes(case, quant_type, double_quant, dtype, path, monkeypatch):
    shape, blocksize, storage = case
    codes, state = quantized(shape, blocksize, storage, quant_type, double_quant, dtype)
    assert codes.dtype == storage and state.nested == double_quant
    poisoned = PoisonedTorch()
    monkeypatch.setattr(mod, "torch", poisoned)  # every output element must be written: torch.empty gives NaNs
    with kernels.backend(path):
        ours = dequantize_4bit(*pieces(codes, state))
    monkeypatch.undo()
    assert poisoned.calls == (1 if path == "triton" else 0)
    assert_matches_every_path(ours, codes, state, path)
    assert ours.is_contiguous()


@pytest.mark.parametrize("double_quant", [False, True], ids=["absmax32", "nested"])
@pytest.mark.parametrize("case", [((33, 4100), 4096), ((300, 902), 64), ((7, 1001), 128)], ids=str)
def test_gpu_tile_under_the_interpreter(case, double_quant, monkeypatch):
    """The GPU's tile (2048 elements) under the interpreter: several programs, and for blocksize 4096 tiles smaller than
    a block (COLS = TILE: one scale per program row, two programs per block)."""
    shape, blocksize = case
    codes, state = quantized(shape, blocksize, torch.uint8, "nf4", double_quant, torch.bfloat16, seed=1)
    monkeypatch.setattr(mod, "_CPU_MAX_TILE", mod._GPU_TILE)
    assert mod.launch_config(codes.numel() * 2, blocksize, on_cuda=False)[:2] == (2048, min(blocksize, 2048))
    with kernels.backend("triton"):
        ours = dequantize_4bit(*pieces(codes, state))
    assert_matches_every_path(ours, codes, state, "GPU tile")


# Scales that exercise every rounding: ordinary ones, fp16's overflow to inf and its subnormals, bf16's largest
# finite value and its round up to inf, fp32 subnormal scales, and powers of two.
EDGE_ABSMAX = [1.0, 3.7, 0.013, 6.1e4, 7e4, 1e5, 1e-5, 6e-8, 1e-30, 1e-39, 3e38, 3.4e38, 123.456, 2**-24, 65504, 65519]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the interpreter's fp16 inf
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("quant_type", QUANT_TYPES)
def test_every_code_and_rounding_edge(quant_type, dtype, path):
    """Every byte value (so both nibbles of every pair) under every edge scale, with each output dtype: bit for bit the
    format (zero signs, subnormals, infinities), and bitsandbytes on each of its CPU paths up to its choices."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(4).view(-1, 1)  # (1024, 1): 2048 codes, 32 blocks of 64
    absmax = torch.tensor(EDGE_ABSMAX * 2, dtype=torch.float32)  # (32,)
    absmax[16:] *= -1  # bitsandbytes never stores a negative absmax, but the arithmetic is the same: sign of zero
    code = bnb_functional.get_4bit_type(quant_type, device="cpu")
    state = bnb_functional.QuantState(
        absmax=absmax, shape=(32, 64), code=code, blocksize=64, quant_type=quant_type, dtype=dtype
    )
    with kernels.backend(path):
        ours = dequantize_4bit(codes, absmax, quant_type, 64, (32, 64), dtype)
    assert_matches_every_path(ours, codes, state, f"{path}: every code")
    if dtype == torch.float16:
        assert torch.isinf(ours).any() and (ours != 0).logical_and(ours.abs() < 2.0**-14).any()  # the edges are hit


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
def test_table_is_bitsandbytes_code_book(quant_type):
    """Our 16 values are `get_4bit_type`'s (what QuantState.code holds) bit for bit, but for FP4's code 0b1000: -0.0,
    as bitsandbytes' CUDA kernel computes it (0 * -1) and its scalar C++ table holds it (its AVX512 table: +0.0)."""
    ours = code_table(quant_type, "cpu")
    book = bnb_functional.get_4bit_type(quant_type, device="cpu")
    assert torch.equal(ours, book)  # values (-0.0 == +0.0)
    differ = (bits(ours) != bits(book)).nonzero().flatten().tolist()
    assert differ == ([8] if quant_type == "fp4" else [])
    if quant_type == "fp4":
        assert torch.signbit(ours[8]) and not torch.signbit(book[8])


@pytest.mark.parametrize("shape, blocksize", [((5, 4100), 4096), ((7, 1001), 128)], ids=str)
def test_fallback_is_what_the_avx512_switch_takes(shape, blocksize, monkeypatch):
    """The "fallback" path of tests/bnb_paths.py is bitsandbytes' own: with its AVX512 switch forced on (what an AVX512
    CPU sets), its CPU kernel returns it for blocksize >= 2048, and for an odd last dimension on every CPU; FP4's code
    0b1000 comes out +0.0 there (the format's -0.0 elsewhere)."""
    cpu_ops = importlib.import_module("bitsandbytes.backends.cpu.ops")
    monkeypatch.setattr(cpu_ops, "_has_avx512", True)
    codes, state = quantized(shape, blocksize, torch.uint8, "fp4", True, torch.bfloat16)
    switched = bnb_functional.dequantize_4bit(codes, state)
    fallback = bnb_dequantize(codes, state, "fallback")
    assert_agrees(fallback, switched, "the fallback called as bitsandbytes calls it")  # its compiled copy may flush
    zeros = switched == 0
    assert zeros.any() and not torch.signbit(switched[zeros]).any() and not torch.signbit(fallback[zeros]).any()
    assert torch.signbit(definition_of(codes, state)[zeros]).any()


def test_the_comparison_takes_bitsandbytes_choices_and_nothing_else():
    """assert_agrees lets a zero's sign and a flushed subnormal differ, as bitsandbytes' paths choose them, and
    nothing else; the modelled AVX512-BF16 path makes both choices on the edge scales, on any CPU."""
    ours = torch.tensor([-0.0, 1e-40, -5.5e-40, 1.5, -2.0, 0.0, float("nan")], dtype=torch.bfloat16)
    assert_agrees(ours, torch.tensor([0.0, 0.0, -0.0, 1.5, -2.0, -0.0, float("nan")], dtype=torch.bfloat16), "choices")
    for i, other in [(3, 1.5078125), (4, 2.0), (1, 2e-40), (0, 1e-40), (3, float("nan")), (6, 0.0)]:
        theirs = ours.clone()
        theirs[i] = other
        with pytest.raises(AssertionError, match="differ in their bits"):
            assert_agrees(ours, theirs, f"element {i} as {other}")
    codes = torch.arange(256, dtype=torch.uint8).repeat(4).view(-1, 1)
    absmax = torch.tensor(EDGE_ABSMAX * 2, dtype=torch.float32)
    for quant_type in QUANT_TYPES:
        code = bnb_functional.get_4bit_type(quant_type, device="cpu")
        state = bnb_functional.QuantState(
            absmax=absmax, shape=(32, 64), code=code, blocksize=64, quant_type=quant_type, dtype=torch.bfloat16
        )
        definition = definition_of(codes, state)
        modelled = bnb_dequantize(codes, state, "avx512_bf16")
        differ = bits(modelled) != bits(definition)
        assert differ.any() and (modelled[differ] == 0).all()  # zeros and flushed subnormals only
        assert_agrees(definition, modelled, quant_type)


@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
def test_nan_scale_stays_nan_in_bf16():
    """A NaN scale (from NaN weights) gives NaN, not -0.0: the bf16 rounding's carry from a NaN with every mantissa
    bit set (the GPU's canonical NaN, 0x7FFFFFFF) would reach the sign bit."""
    absmax = torch.tensor([0x7FFFFFFF, 0x7FC00000, 0x7F800001], dtype=torch.int32).view(torch.float32)
    codes = torch.full((96,), 0x9C, dtype=torch.uint8)  # (96,): 192 codes, 3 blocks of 64
    for path in PATHS:
        with kernels.backend(path):
            ours = dequantize_4bit(codes, absmax, "nf4", 64, (192,), torch.bfloat16)
        assert torch.isnan(ours).all(), f"{path}: {ours[~torch.isnan(ours)][:4]}"


@pytest.mark.parametrize("path", PATHS)
def test_offset_as_a_float_and_empty(path):
    codes, state = quantized((16, 70), 64, torch.uint8, "nf4", True, torch.float32)
    *args, nested = pieces(codes, state)
    with kernels.backend(path):
        ours = dequantize_4bit(*args, nested._replace(offset=state.offset.item()))
        empty = dequantize_4bit(codes[:0], torch.zeros(0), "nf4", 64, (0, 64), torch.bfloat16)
    assert_matches_every_path(ours, codes, state, "float offset")
    assert empty.shape == (0, 64) and empty.dtype == torch.bfloat16


def test_dispatch():
    codes, state = quantized((8, 64), 64, torch.uint8, "fp4", False, torch.bfloat16)
    assert kernels.dequantize_4bit is dequantize_4bit and kernels.dequantize_4bit_ref is dequantize_4bit_ref
    with kernels.backend("reference"), pytest.MonkeyPatch.context() as m:
        m.setattr(mod, "dequantize_4bit_fwd", None)  # the reference must not reach the launcher
        ref = dequantize_4bit(*pieces(codes, state))
    with kernels.backend("triton"):
        tri = dequantize_4bit(*pieces(codes, state))
    assert_bit_equal(tri, ref, "triton vs reference")
    assert_bit_equal(dequantize_4bit_fwd(*pieces(codes, state)), ref, "launcher")


def _bad(**change):
    codes = torch.zeros(64, 1, dtype=torch.uint8)
    args = {
        "codes": codes,
        "absmax": torch.ones(2),
        "quant_type": "nf4",
        "blocksize": 64,
        "shape": (2, 64),
        "dtype": torch.bfloat16,
        "nested": None,
    }
    args.update(change)
    return args


NESTED_OK = NestedAbsmax(torch.zeros(256), torch.ones(1), 256, torch.tensor(0.5))
UINT8_ABSMAX = torch.ones(2, dtype=torch.uint8)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"quant_type": "int4"}, "quant_type must be 'nf4' or 'fp4'"),
        ({"blocksize": 48}, "blocksize must be one of 32, 64"),
        ({"blocksize": True}, "blocksize must be one of"),
        ({"dtype": torch.float64}, "dtype must be torch.float32, torch.bfloat16 or torch.float16"),
        ({"shape": (2, -64)}, "shape must be non-negative integers"),
        ({"codes": torch.zeros(63, 1, dtype=torch.uint8)}, "codes hold 63 bytes, 128 elements need 64"),
        ({"codes": [0] * 64}, "codes must be a tensor"),
        ({"absmax": torch.ones(1)}, "absmax must be a torch.float32 tensor of at least 2 elements"),
        ({"absmax": torch.ones(2, dtype=torch.float16)}, "absmax must be a torch.float32 tensor"),
        ({"nested": NESTED_OK}, "absmax must be a torch.uint8 tensor of at least 2 elements"),
        ({"nested": (1, 2, 3, 4)}, "nested must be a NestedAbsmax"),
        ({"absmax": UINT8_ABSMAX, "nested": NESTED_OK._replace(blocksize=0)}, "nested.blocksize"),
        ({"absmax": UINT8_ABSMAX, "nested": NESTED_OK._replace(code=torch.ones(16))}, "nested.code"),
        ({"absmax": UINT8_ABSMAX, "nested": NESTED_OK._replace(offset="0.5")}, "nested.offset must be"),
        (
            {"absmax": UINT8_ABSMAX, "nested": NESTED_OK._replace(absmax=torch.ones(0))},
            "nested.absmax must be a torch.float32 tensor of at least 1 elements",
        ),
        (
            {"absmax": UINT8_ABSMAX, "nested": NESTED_OK._replace(offset=torch.tensor(1.0).half())},
            "nested.offset must be",
        ),
        ({"absmax": torch.ones(2, device="meta")}, "absmax is on meta, codes on cpu"),
    ],
)
def test_bad_arguments(change, match):
    with pytest.raises(ValueError, match=match):
        dequantize_4bit(**_bad(**change))


def test_custom_op_registration():
    # what torch.compile traces on CUDA; the full opcheck (aot dispatch too) runs in the gpu test, because tracing its
    # body here would run the interpreter on fake tensors
    op = torch.ops.kernelwright.dequantize_4bit
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    codes, state = quantized((4, 96), 64, torch.uint8, "nf4", True, torch.bfloat16)
    second = (state.state2.code, state.state2.absmax, 256, state.offset.reshape(1))
    torch.library.opcheck(op, (codes, state.absmax, "nf4", 64, [4, 96], torch.bfloat16, *second), test_utils=checks)
    codes, state = quantized((4, 96), 64, torch.uint8, "fp4", False, torch.float32)
    plain = (codes, state.absmax, "fp4", 64, [4, 96], torch.float32, None, None, 1, None)
    torch.library.opcheck(op, plain, test_utils=checks)


def test_compile_fullgraph_cpu_takes_the_reference():
    codes, state = quantized((5, 132), 64, torch.bfloat16, "fp4", True, torch.bfloat16)
    compiled = torch.compile(lambda *a: dequantize_4bit(*a) * 1, fullgraph=True, backend="aot_eager")
    assert_matches_every_path(compiled(*pieces(codes, state)), codes, state, "compiled")


@pytest.mark.gpu
def test_matches_bitsandbytes_cuda():
    """On a GPU: our kernel against bitsandbytes' CUDA dequantize_4bit (its kernels, -0.0 included), eager and under
    torch.compile(fullgraph=True) (the custom op), every quant type, nesting, dtype and storage; the code/edge table;
    NaN; and offsets past 2^31 elements."""
    for (shape, blocksize, storage), quant_type, double_quant, dtype in [
        (case, qt, dq, dt) for case in CASES for qt in QUANT_TYPES for dq in (False, True) for dt in DTYPES
    ]:
        g = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(shape, generator=g, device="cuda") * 0.05).to(dtype)
        codes, state = bnb_functional.quantize_4bit(
            w, blocksize=blocksize, compress_statistics=double_quant, quant_type=quant_type, quant_storage=storage
        )
        theirs = bnb_functional.dequantize_4bit(codes, state)
        what = f"{shape} bs{blocksize} {storage} {quant_type} nested={double_quant} {dtype}"
        assert_bit_equal(dequantize_4bit(*pieces(codes, state)), theirs, what)
        assert_bit_equal(dequantize_4bit_ref(*pieces(codes, state)), theirs, f"reference on cuda: {what}")
    compiled = torch.compile(lambda *a: dequantize_4bit(*a), fullgraph=True)
    assert_bit_equal(compiled(*pieces(codes, state)), theirs, "compiled")
    second = (state.state2.code, state.state2.absmax, 256, state.offset.reshape(1))
    op_args = (codes, state.absmax, state.quant_type, blocksize, list(shape), dtype, *second)
    torch.library.opcheck(torch.ops.kernelwright.dequantize_4bit, op_args)

    codes = torch.arange(256, dtype=torch.uint8, device="cuda").repeat(4).view(-1, 1)
    absmax = torch.tensor(EDGE_ABSMAX * 2, dtype=torch.float32, device="cuda")
    absmax[16:] *= -1
    for quant_type in QUANT_TYPES:
        for dtype in DTYPES:
            # bitsandbytes' CUDA kernels are built flushing fp32 subnormals to zero (an fp32 subnormal absmax, 1e-39,
            # and a subnormal product: 124 of these 2048 elements, seen on an H200): ours keeps the format's value
            ours = dequantize_4bit(codes, absmax, quant_type, 64, (32, 64), dtype)
            what = f"every code {quant_type} {dtype}"
            code = bnb_functional.get_4bit_type(quant_type, device="cpu")
            state = bnb_functional.QuantState(
                absmax=absmax.cpu(), shape=(32, 64), code=code, blocksize=64, quant_type=quant_type, dtype=dtype
            )
            assert_bit_equal(ours.cpu(), definition_of(codes.cpu(), state), what)
            theirs = torch.ops.bitsandbytes.dequantize_4bit(codes, absmax, 64, quant_type, (32, 64), dtype)
            assert_agrees(ours, theirs, what)

    nan = torch.tensor([0x7FFFFFFF, 0x7FC00000, 0x7F800001], dtype=torch.int32, device="cuda").view(torch.float32)
    assert torch.isnan(dequantize_4bit(codes[:96], nan, "nf4", 64, (192,), torch.bfloat16)).all()

    n = 2**31 + 3 * 64 + 5  # int64 offsets: compare the tail with the reference on its own blocks
    codes = torch.randint(0, 256, ((n + 1) // 2,), dtype=torch.uint8, device="cuda")
    absmax = torch.rand(-(-n // 64), device="cuda")
    out = dequantize_4bit(codes, absmax, "nf4", 64, (n,), torch.bfloat16)
    start = (n // 64 - 2) * 64
    tail = dequantize_4bit_ref(codes[start // 2 :], absmax[start // 64 :], "nf4", 64, (n - start,), torch.bfloat16)
    assert_bit_equal(out[start:], tail, "past 2^31")


def test_bench_dequantize_4bit_runs(tmp_path, monkeypatch):
    from bench import bench_dequantize_4bit, common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    rows = bench_dequantize_4bit.main(["--quick"])
    assert {r["provider"] for r in rows} == {"ours", "bitsandbytes"}
    assert all(r["ms"] > 0 and r["bit_exact"] for r in rows)
    assert (tmp_path / "dequantize_4bit.jsonl").exists()
