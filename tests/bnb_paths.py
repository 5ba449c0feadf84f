"""bitsandbytes' CPU code paths, for the tests that compare with bitsandbytes: what the 4-bit format fixes, what each
path of bitsandbytes' CPU backend chooses, and each path run (or modelled) on whatever CPU the tests run on.

bitsandbytes 0.50 picks its CPU path from the machine (bitsandbytes/backends/cpu/ops.py):
- `dequantize_4bit` runs its C++ kernel, which itself picks scalar or AVX512 code at run time (`has_avx512f_cpu`).
  The AVX512 code holds FP4's code 0b1000 as +0.0 (the scalar and CUDA kernels compute -0.0), converts to bf16 with
  AVX512-BF16's instruction, which flushes a subnormal result to zero, and indexes absmax per row: wrong where a row
  is not a whole number of blocks and its length is a multiple of 16 (a (64, 96) weight at blocksize 64: real models'
  rows are whole blocks, tiny test models' need not be). A test's oracle is then its "fallback" path here, or, where
  the oracle is transformers' own 4-bit model, a checkpoint whose rows are whole blocks. It takes its
  PyTorch fallback (`_dequantize_4bit_compute`, FP4's code 0b1000 as +0.0) for an odd last dimension, and on an
  AVX512 CPU (`_has_avx512`) for blocksize >= 2048.
- `Linear4bit.forward`, in eval mode without grad on an AVX512-BF16 CPU (`support_avx512bf16_for_cpu`), repacks the
  weight and multiplies in bf16 (`gemv_4bit`); otherwise it dequantizes and calls `F.linear`.

What the format fixes: each element is one fp32 product, its code's value times its block's scale, rounded once to
the output dtype (`format_definition`, computed here, not by the code under test). What is the library's choice: the
sign of a zero, and whether a subnormal result is flushed to zero (`assert_agrees`). So no test predicts a path from
the CPU: ours is held bit for bit (zero signs and subnormals included) against the definition, and against
bitsandbytes up to its choices, on every path `bnb_dequantize` reaches:
- "this_cpu": bitsandbytes as it runs here (scalar C++ on a CPU without AVX512, AVX512 C++ on one with it);
- "fallback": its PyTorch fallback, as its CPU kernel calls it (`test_fallback_is_what_the_avx512_switch_takes`
  holds that against the real switch, `_has_avx512` forced on);
- "avx512_bf16": the AVX512 kernel's choices applied to this CPU's result (+0.0 for every zero, subnormal bf16
  results flushed): modelled, since an AVX512 instruction cannot run on a CPU without it.
The AVX512-BF16 layer path (bf16 GEMM in eval) cannot run here either: the layer tests take the dequantize-then-linear
path on every CPU (`plain_bnb_path`) and ours never takes bitsandbytes' GEMM (test_quant.py).
"""

from __future__ import annotations

import pytest
import torch

bnb_functional = pytest.importorskip("bitsandbytes.functional")
from bitsandbytes.backends.default import ops as bnb_default_ops  # noqa: E402
from bitsandbytes.backends.utils import _get_4bit_code  # noqa: E402

# the fallback's function run eagerly: bitsandbytes wraps it in torch.compile, one compilation per shape and dtype
# (seconds each); the operations are the same
_fallback = getattr(bnb_default_ops._dequantize_4bit_compute, "__wrapped__", bnb_default_ops._dequantize_4bit_compute)

BNB_PATHS = ("this_cpu", "fallback", "avx512_bf16")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _first_difference(same: torch.Tensor, ours, theirs, what: str) -> AssertionError:
    i = (~same).nonzero()[0].tolist()
    return AssertionError(
        f"{what}: {int((~same).sum())} of {same.numel()} elements differ in their bits, first at {i}: "
        f"ours {ours[tuple(i)].item()!r} vs {theirs[tuple(i)].item()!r}"
    )


def assert_bit_equal(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    """Every bit: -0.0 and +0.0 differ, subnormals count, NaN payloads are compared."""
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, (
        f"{what}: {tuple(ours.shape)} {ours.dtype} vs {tuple(theirs.shape)} {theirs.dtype}"
    )
    same = bits(ours) == bits(theirs)
    if not same.all():
        raise _first_difference(same, ours, theirs, what)


def assert_agrees(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    """Bit for bit up to bitsandbytes' choices: a zero of either sign where ours is a zero, and a zero where ours is
    subnormal in its dtype (flushed). Anything else, a normal value one bit apart included, differs."""
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, (
        f"{what}: {tuple(ours.shape)} {ours.dtype} vs {tuple(theirs.shape)} {theirs.dtype}"
    )
    flushable = ours.float().abs() < torch.finfo(ours.dtype).tiny  # zero or subnormal
    same = (bits(ours) == bits(theirs)) | (flushable & (theirs == 0))
    if not same.all():
        raise _first_difference(same, ours, theirs, f"{what} (bitsandbytes)")


def block_scales(state) -> torch.Tensor:
    """(n_blocks,) fp32 scale of each block: absmax, or with double quantization code2[absmax] * absmax2[block // 256]
    rounded, then + offset rounded (bitsandbytes' two fp32 operations)."""
    if not state.nested:
        return state.absmax.float()
    block = torch.arange(state.absmax.numel())
    second = state.state2
    return second.code[state.absmax.long()] * second.absmax[block // second.blocksize] + state.offset


def format_definition(codes, absmax, quant_type: str, blocksize: int, shape, dtype) -> torch.Tensor:
    """The 4-bit format computed element by element: element i is the code in byte i // 2 (its high nibble for even i),
    looked up in bitsandbytes' code book (FP4's code 0b1000 as -0.0, as its CUDA kernel computes it), times its
    block's fp32 scale, rounded once to dtype."""
    n = 1
    for size in shape:
        n *= size
    book = bnb_functional.get_4bit_type(quant_type, device="cpu").float().clone()
    if quant_type == "fp4":
        book[8] = -0.0
    packed = codes.reshape(-1).view(torch.uint8)
    i = torch.arange(n)
    byte = packed[i // 2].long()
    code = torch.where(i % 2 == 0, byte >> 4, byte & 0xF)
    return (book[code] * absmax.reshape(-1)[i // blocksize]).to(dtype).reshape(tuple(shape))


def definition_of(codes, state) -> torch.Tensor:
    """`format_definition` of bitsandbytes' packed codes and QuantState."""
    return format_definition(codes, block_scales(state), state.quant_type, state.blocksize, state.shape, state.dtype)


def bnb_dequantize(codes, state, path: str) -> torch.Tensor:
    """bitsandbytes' dequantize_4bit of (codes, state) on one of its CPU paths (module docstring)."""
    if path == "this_cpu":
        return bnb_functional.dequantize_4bit(codes, state)
    if path == "fallback":  # what its CPU kernel returns when it falls back (bitsandbytes/backends/cpu/ops.py)
        scales = (
            bnb_functional.dequantize_blockwise(state.absmax, state.state2) + state.offset if state.nested else None
        )
        code = _get_4bit_code(state.quant_type, codes.device)
        flat = codes.view(torch.uint8).reshape(-1)
        return _fallback(
            flat, state.absmax if scales is None else scales, code, state.blocksize, state.shape, state.dtype
        )
    if path == "avx512_bf16":  # modelled: its AVX512 kernel's zero and bf16 conversion on this CPU's values
        out = bnb_functional.dequantize_4bit(codes, state)
        out = torch.where(out == 0, torch.zeros_like(out), out)
        if out.dtype == torch.bfloat16:
            out = torch.where(out.float().abs() < torch.finfo(out.dtype).tiny, torch.zeros_like(out), out)
        return out
    raise ValueError(f"path must be one of {BNB_PATHS}, not {path!r}")


def assert_matches_every_path(ours: torch.Tensor, codes, state, what: str) -> None:
    """Ours against the definition, bit for bit, and against bitsandbytes on each of its paths, up to its choices."""
    assert_bit_equal(ours, definition_of(codes, state), f"{what} vs the format")
    for path in BNB_PATHS:
        assert_agrees(ours, bnb_dequantize(codes, state, path), f"{what} vs {path}")


def plain_bnb_path(model) -> int:
    """bitsandbytes' Linear4bit layers of `model` on the path every CPU takes (dequantize, then F.linear): their
    AVX512-BF16 switch turned off, which otherwise repacks the weight and multiplies in bf16 in eval without grad.
    Returns how many layers were switched."""
    layers = [m for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    for layer in layers:
        layer.support_avx512bf16_for_cpu = False
    return len(layers)
