"""The traffic meter (bench/traffic.py) on kernels whose global-memory traffic is known by construction.

Each kernel here is written for the test; its bytes follow from its code: a masked copy (odd length, so the
mask matters), a kernel that reads its input twice (issued = 2 x distinct), atomics (an atomic reads and
writes its element) and a tensor-descriptor copy (out-of-bounds rows and columns move nothing).
"""

import pytest
import torch
import triton
import triton.language as tl

from bench import traffic


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


@triton.jit
def _read_twice_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(src_ptr + offs, mask=mask, other=0.0)
    b = tl.load(src_ptr + offs, mask=mask, other=0.0)
    tl.store(dst_ptr + offs, a + b, mask=mask)


@triton.jit
def _atomic_sum_kernel(src_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # every lane adds its value into out[0]: one load per element, one atomic per element on the same address
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src_ptr + offs, mask=mask, other=0.0)
    tl.atomic_add(out_ptr + offs * 0, x, mask=mask)


@triton.jit
def _cas_kernel(flag_ptr):
    tl.atomic_cas(flag_ptr + tl.program_id(0), 0, 1)


@triton.jit
def _desc_copy_kernel(src_ptr, dst_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
    src = tl.make_tensor_descriptor(src_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    dst = tl.make_tensor_descriptor(dst_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    r, c = tl.program_id(0) * BM, tl.program_id(1) * BN
    dst.store([r, c], src.load([r, c]))


@triton.jit
def _indirect_copy_kernel(table_ptr, n, BLOCK: tl.constexpr):
    # the source and destination addresses come from an int64 table, as AdamW's tensor table gives them
    src = tl.load(table_ptr).to(tl.pointer_type(tl.float32))
    dst = tl.load(table_ptr + 1).to(tl.pointer_type(tl.float32))
    offs = tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_copy_counts_active_lanes(dtype):
    n, block = 1001, 256  # 4 programs, the last one 233 lanes of 256
    src = torch.randn(n, dtype=dtype)
    dst = torch.empty_like(src)
    with traffic.measure() as t:
        _copy_kernel[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block)
    assert torch.equal(dst, src)
    nbytes = n * src.element_size()
    assert (t.read_bytes, t.write_bytes, t.distinct_read, t.distinct_write) == (nbytes, nbytes, nbytes, nbytes), (
        t.summary()
    )
    (launch,) = t.launches
    assert launch.kernel == "_copy_kernel" and launch.programs == 4
    tensors = t.by_tensor()
    assert set(tensors) == {"src_ptr", "dst_ptr"}, t.summary()
    assert (tensors["src_ptr"].read, tensors["src_ptr"].write) == (nbytes, 0)
    assert (tensors["dst_ptr"].read, tensors["dst_ptr"].write) == (0, nbytes)


def test_reading_twice_doubles_issued_not_distinct():
    n, block = 777, 128
    src = torch.randn(n)
    dst = torch.empty_like(src)
    with traffic.measure() as t:
        _read_twice_kernel[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block)
    assert (t.read_bytes, t.distinct_read) == (2 * 4 * n, 4 * n), t.summary()
    src_t = t.by_tensor()["src_ptr"]
    assert (src_t.read, src_t.distinct_read) == (2 * 4 * n, 4 * n)


def test_two_launches_count_issued_per_launch_and_distinct_over_both():
    n = 300
    src = torch.randn(n)
    dst = torch.empty_like(src)
    with traffic.measure() as t:
        for _ in range(2):
            _copy_kernel[(1,)](src, dst, n, BLOCK=512)
    assert len(t.launches) == 2
    assert (t.read_bytes, t.distinct_read, t.write_bytes, t.distinct_write) == (8 * n, 4 * n, 8 * n, 4 * n)
    assert t.by_kernel()["_copy_kernel"].programs == 2


def test_atomic_reads_and_writes_its_element():
    n, block = 333, 128
    src = torch.ones(n)
    out = torch.zeros(1)
    with traffic.measure() as t:
        _atomic_sum_kernel[(triton.cdiv(n, block),)](src, out, n, BLOCK=block)
    assert out.item() == n
    tensors = t.by_tensor()
    acc = tensors["out_ptr"]
    # n atomic lanes of 4 bytes, each a read and a write, all on one 4-byte address
    assert (acc.read, acc.write, acc.atomic, acc.distinct_read, acc.distinct_write) == (4 * n, 4 * n, 4 * n, 4, 4), (
        t.summary()
    )
    assert (tensors["src_ptr"].read, tensors["src_ptr"].atomic) == (4 * n, 0)


def test_atomic_cas_counts_every_lane():
    flags = torch.zeros(5, dtype=torch.int32)
    with traffic.measure() as t:
        _cas_kernel[(5,)](flags)
    assert flags.tolist() == [1] * 5
    assert (t.read_bytes, t.write_bytes, t.by_tensor()["flag_ptr"].atomic) == (20, 20, 20), t.summary()


def test_tensor_descriptor_counts_in_bounds_elements():
    m, n, bm, bn = 10, 20, 8, 16  # 2 x 2 tiles; out-of-bounds rows/columns are padding, not traffic
    src = torch.randn(m, n)
    dst = torch.zeros_like(src)
    with traffic.measure() as t:
        _desc_copy_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](src, dst, m, n, BM=bm, BN=bn)
    assert torch.equal(dst, src)
    assert (t.read_bytes, t.write_bytes) == (4 * m * n, 4 * m * n), t.summary()


def test_views_of_one_storage_are_told_apart_and_unknown_addresses_named():
    buf = torch.randn(64)
    src, dst = buf[:20], buf[32:52]  # two views of one storage
    with traffic.measure() as t:
        _copy_kernel[(1,)](src, dst, 20, BLOCK=32)
    tensors = t.by_tensor()
    assert (tensors["src_ptr"].read, tensors["dst_ptr"].write) == (80, 80), t.summary()
    assert traffic.UNKNOWN not in tensors


def test_summary_names_kernel_and_tensors():
    src = torch.randn(10)
    with traffic.measure() as t:
        _copy_kernel[(1,)](src, torch.empty_like(src), 10, BLOCK=16)
    text = t.summary()
    assert "_copy_kernel" in text and "src_ptr" in text and "total: 1 launches, read 40 B" in text


def test_measure_restores_the_interpreter():
    from triton.runtime import interpreter

    before = interpreter.InterpreterBuilder.create_masked_load
    with pytest.raises(ZeroDivisionError):
        with traffic.measure():
            _ = 1 / 0
    assert interpreter.InterpreterBuilder.create_masked_load is before
    src = torch.randn(10)
    with traffic.measure() as t:
        pass
    _copy_kernel[(1,)](src, torch.empty_like(src), 10, BLOCK=16)  # outside the block: not counted
    assert t.launches == []


def test_torch_ops_are_recorded_with_modelled_bytes():
    a, b = torch.randn(6, 5), torch.randn(5, 3)
    out = torch.empty(6, 3)
    src = torch.randn(10)
    with traffic.measure(torch_ops=True) as t:
        c = a @ b.t().t()  # the views move nothing
        torch.mm(a, b, out=out)  # out= is written, not read
        out.add_(c)  # in place: read and written
        dst = torch.empty_like(src)
        _copy_kernel[(1,)](src, dst, 10, BLOCK=16)
        dst.gather(0, torch.tensor([1, 2]))  # reads the two gathered elements and the index
    kinds = [launch.kernel for launch in t.launches]
    assert kinds == ["aten.mm", "aten.mm", "aten.add_", "_copy_kernel", "aten.gather"], t.summary()
    mm, mm_out, add, _, gather = t.launches
    assert (mm.read, mm.write) == (4 * 30 + 4 * 15, 4 * 18)
    assert (mm_out.read, mm_out.write) == (4 * 30 + 4 * 15, 4 * 18)
    assert (add.read, add.write) == (2 * 4 * 18, 4 * 18)
    assert (gather.read, gather.write) == (2 * 4 + 2 * 8, 2 * 4)
    assert torch.equal(dst, src)


def test_addresses_outside_the_arguments_go_to_named_tensors_or_unknown():
    src, dst = torch.randn(9), torch.zeros(9)
    table = torch.tensor([src.data_ptr(), dst.data_ptr()], dtype=torch.int64)
    with traffic.measure() as unnamed:
        _indirect_copy_kernel[(1,)](table, 9, BLOCK=16)
    with traffic.measure(named={"src": src, "dst": dst}) as named:
        _indirect_copy_kernel[(1,)](table, 9, BLOCK=16)
    assert torch.equal(dst, src)
    unknown = unnamed.by_tensor()[traffic.UNKNOWN]
    assert (unknown.read, unknown.write) == (36, 36), unnamed.summary()
    tensors = named.by_tensor()
    assert traffic.UNKNOWN not in tensors
    assert (tensors["src"].read, tensors["dst"].write, tensors["table_ptr"].read) == (36, 36, 16), named.summary()
