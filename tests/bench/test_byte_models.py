"""Every kernel benchmark's byte model (bench/bench_<op>.py `traffic_parts` / `traffic_model`) against the
traffic meter (bench/traffic.py): the issued bytes each Triton kernel reads and writes, counted under the
interpreter at small shapes, for every mode, dtype, ignored fraction and both sides of the widths where an
algorithm changes. Equal, exactly: the models count every O(rows) and O(programs) term, and masked lanes move
nothing in the meter as in the model. When a kernel's traffic changes, the failure prints the model and the
measured bytes per kernel and per tensor: update that bench's `traffic_parts`.

The models' "aten.*" entries (torch ops between the launches: matmuls, a sum, a cast, a step counter) are compared
where the test measures with `torch_ops=True`, which records them with the meter's one-pass rule; the
cross-entropy model leaves its O(rows) torch ops (the loss sum, the denominator) out and is measured without.
"""

import importlib

import pytest
import torch

import kernels
from bench import (
    bench_adamw,
    bench_causal_conv1d,
    bench_cross_entropy,
    bench_dequantize_4bit,
    bench_fused_linear_cross_entropy,
    bench_fused_linear_preference,
    bench_gated_rms_norm,
    bench_moe,
    bench_neftune,
    bench_rms_norm,
    bench_swiglu,
    traffic,
)
from kernels.cross_entropy import FWD_VARIANTS, cross_entropy, cross_entropy_fwd, fwd_variant
from kernels.rms_norm import (
    FusedAddRMSNormFunction,
    RMSNormFunction,
    fused_add_rms_norm_bwd,
    fused_add_rms_norm_fwd,
    rms_norm_bwd,
    rms_norm_fwd,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def assert_matches(model: dict[str, tuple[int, int]], measured: traffic.Traffic, which: str) -> None:
    """A model's entries equal the meter's per-kernel issued (read, write) bytes: its Triton kernels, and its torch
    operators ("aten.*") where the meter recorded them (`torch_ops=True`: one pass over each operand)."""
    got = {name: (launch.read, launch.write) for name, launch in measured.by_kernel().items()}
    # torch ops are compared where the meter recorded them (torch_ops=True), which it does only when they move bytes
    torch_ops = any(name.startswith("aten.") for name in got)
    want = {name: rw for name, rw in model.items() if not name.startswith("aten.") or (torch_ops and rw != (0, 0))}
    assert got == want, (
        f"{which} disagrees with the traffic meter; update its traffic_parts.\n"
        f"model    (read, write) per kernel: {want}\nmeasured (read, write) per kernel: {got}\n"
        f"measured per launch and tensor:\n{measured.summary()}"
    )


# ---- cross-entropy ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ignored", ["none", "some", "all"])
@pytest.mark.parametrize("vocab", [1003, 8200])  # one tile; two tiles (the interpreter's BLOCK is 8192)
def test_cross_entropy_forward_and_backward(dtype, ignored, vocab):
    n = 7 if vocab < 8192 else 3
    logits = torch.randn(n, vocab, dtype=DTYPES[dtype]).requires_grad_()
    target = torch.randint(0, vocab, (n,))
    target[{"none": slice(0), "some": slice(None, None, 3), "all": slice(None)}[ignored]] = -100
    n_ignored = int((target == -100).sum())
    elt = logits.element_size()
    with kernels.backend("triton"):
        with traffic.measure() as fwd:
            loss = cross_entropy(logits, target)
        with traffic.measure() as bwd:
            loss.backward()
    which = f"bench/bench_cross_entropy.py ({dtype}, N={n}, V={vocab}, {n_ignored} ignored)"
    assert_matches(bench_cross_entropy.traffic_parts("forward", n, vocab, elt, n_ignored, cuda=False), fwd, which)
    assert_matches(bench_cross_entropy.traffic_parts("backward", n, vocab, elt, n_ignored, cuda=False), bwd, which)


def test_cross_entropy_scaled_backward_and_no_grad_forward():
    n, vocab = 6, 1003
    logits = torch.randn(n, vocab, dtype=torch.bfloat16).requires_grad_()
    target = torch.randint(0, vocab, (n,))
    target[1] = -100
    with kernels.backend("triton"):
        loss = cross_entropy(logits, target)
        with traffic.measure() as bwd:
            (loss * 3).backward()  # grad_output 3: the backward scales the saved gradient in place
        with traffic.measure() as fwd:
            cross_entropy_fwd(logits.detach(), target, compute_grad=False)
    which = "bench/bench_cross_entropy.py"
    assert_matches(
        bench_cross_entropy.traffic_parts("backward", n, vocab, 2, 1, grad_output_one=False, cuda=False), bwd, which
    )
    assert_matches(bench_cross_entropy.traffic_parts("forward_nograd", n, vocab, 2, 1, cuda=False), fwd, which)


@pytest.mark.parametrize("variant", FWD_VARIANTS)
def test_cross_entropy_forward_variants_move_the_same_bytes(variant):
    # the variants change tiles, cache hints, pipelining and the grid, not what is read or written
    n, vocab = 6, 1003
    logits = torch.randn(n, vocab, dtype=torch.bfloat16)
    target = torch.randint(0, vocab, (n,))
    target[2] = -100
    with fwd_variant(variant), traffic.measure() as fwd:
        cross_entropy_fwd(logits, target, grad_scale=torch.tensor(0.2))
    model = bench_cross_entropy.traffic_parts("forward", n, vocab, 2, 1, cuda=False)
    assert_matches(model, fwd, f"bench/bench_cross_entropy.py (variant {variant})")


def test_cross_entropy_ignored_rows_cost_one_element_not_three():
    # the issue-20 finding: the old per-element model (2s + 1s for every row) overstated the bench's bytes by 7%
    n, vocab = 8192, 32000  # the bench's first GPU shape
    ours = sum(bench_cross_entropy.traffic_model("forward", n, vocab, 2, n // 10))
    old = 3 * 2 * n * vocab
    assert 1.06 < old / ours < 1.08


# ---- RMSNorm ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("w_dtype", ["same", "fp32"])
@pytest.mark.parametrize("max_block", [None, 32])  # one block per row; the column loop (and row-dot pass) forced
def test_rms_norm_forward_and_backward(dtype, w_dtype, max_block):
    m, n = 37, 100  # ragged: 37 rows over tiles of 32 (or 128) rows, 100 columns over 32-wide blocks
    x = torch.randn(m, n, dtype=DTYPES[dtype])
    w = torch.randn(n, dtype=x.dtype if w_dtype == "same" else torch.float32)
    dy = torch.randn_like(x)
    with traffic.measure() as fwd:
        _, rstd = rms_norm_fwd(x, w, 1e-6, 0.0, max_block=max_block)
    with traffic.measure() as bwd:
        rms_norm_bwd(dy, x, w, rstd, 0.0, max_block=max_block)
    s, ws = x.element_size(), w.element_size()
    which = f"bench/bench_rms_norm.py ({dtype}, weight {w.dtype}, {m}x{n}, max_block {max_block})"
    assert_matches(bench_rms_norm.traffic_parts("forward", m, n, s, ws, max_block=max_block), fwd, which)
    assert_matches(bench_rms_norm.traffic_parts("backward", m, n, s, ws, max_block=max_block), bwd, which)


@pytest.mark.parametrize("w_dtype", ["same", "fp32"])
@pytest.mark.parametrize("max_block", [None, 32])
def test_rms_norm_full_step_with_torch_ops(w_dtype, max_block):
    # the autograd path: forward, then backward with the dweight finish (sum of the partials, cast)
    m, n = 13, 100
    x = torch.randn(m, n, dtype=torch.bfloat16).requires_grad_()
    w = torch.randn(n, dtype=x.dtype if w_dtype == "same" else torch.float32).requires_grad_()
    dy = torch.randn_like(x)
    with traffic.measure(torch_ops=True) as full:
        y = RMSNormFunction.apply(x, w, 1e-6, 0.0, max_block)
        torch.autograd.grad(y, [x, w], dy)
    model = bench_rms_norm.traffic_parts("full", m, n, 2, w.element_size(), max_block=max_block)
    assert_matches(model, full, f"bench/bench_rms_norm.py full (weight {w.dtype}, max_block {max_block})")


def test_rms_norm_weight_once_is_the_distinct_weight_bytes():
    # byte_model (the GB/s columns) counts the weight once per launch: issued bytes less the weight's re-reads
    m, n = 9, 4100  # one row per program, so the weight is re-read by every program
    x, w = torch.randn(m, n, dtype=torch.bfloat16), torch.randn(n, dtype=torch.bfloat16)
    with traffic.measure() as fwd:
        _, rstd = rms_norm_fwd(x, w, 1e-6, 0.0)
    with traffic.measure() as bwd:
        rms_norm_bwd(torch.randn_like(x), x, w, rstd, 0.0, max_block=1024)
    for mode, measured in (("forward", fwd), ("backward", bwd)):
        model = bench_rms_norm.traffic_parts(
            mode, m, n, 2, 2, max_block=None if mode == "forward" else 1024, weight_once=True
        )
        got = {
            name: (launch.read - launch.tensors["w_ptr"].read + launch.tensors["w_ptr"].distinct_read, launch.write)
            for name, launch in measured.by_kernel().items()
        }
        assert got == {k: v for k, v in model.items() if not k.startswith("aten.")}, measured.summary()


@pytest.mark.parametrize("n", [8192 + 24, 16384 + 40])  # one 16384-wide block; above it, the column loop
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_rms_norm_backward_above_8192(dtype, n):
    # every dtype keeps a row up to 16384 wide in one block (x and dy read once; fp32 reloads the weight every row),
    # wider rows loop over column blocks after the row-dot pass (read twice)
    m = 2
    x, dy, w = (torch.randn(m, n, dtype=DTYPES[dtype]), torch.randn(m, n, dtype=DTYPES[dtype]), torch.randn(n))
    _, rstd = rms_norm_fwd(x, w, 1e-6, 0.0)
    with traffic.measure() as bwd:
        rms_norm_bwd(dy, x, w, rstd, 0.0)
    model = bench_rms_norm.traffic_parts("backward", m, n, x.element_size(), 4)
    assert ("_rms_norm_bwd_rowdot_kernel" in model) == (n > 16384)
    assert_matches(model, bwd, f"bench/bench_rms_norm.py backward ({dtype}, {m}x{n})")
    if dtype == "fp32" and n <= 16384:  # the weight issued once per row, read from DRAM once
        assert bwd.by_kernel()["_rms_norm_bwd_kernel"].tensors["w_ptr"].read == m * n * 4
        assert bwd.by_kernel()["_rms_norm_bwd_kernel"].tensors["w_ptr"].distinct_read == n * 4


@pytest.mark.parametrize("dtypes", ["fp32", "fp16", "bf16+fp32"])  # bf16+fp32: dx in two dtypes keeps the 8192 cap
def test_fused_add_rms_norm_backward_above_8192(dtypes):
    x_dtype, res_dtype = (DTYPES[d] for d in (dtypes.split("+") * 2)[:2])
    m, n = 2, 8192 + 24
    h = torch.randn(m, n, dtype=res_dtype)
    w = torch.randn(n, dtype=res_dtype)
    _, rstd = rms_norm_fwd(h, w, 1e-6, 0.0)
    with traffic.measure() as bwd:
        fused_add_rms_norm_bwd(torch.randn_like(h), torch.randn_like(h), h, w, rstd, 0.0, x_dtype, res_dtype)
    s, rs = torch.empty(0, dtype=x_dtype).element_size(), h.element_size()
    model = bench_rms_norm.traffic_parts("backward", m, n, s, rs, residual_size=rs)
    assert ("_rms_norm_bwd_rowdot_kernel" in model) == (x_dtype != res_dtype)
    assert_matches(model, bwd, f"bench/bench_rms_norm.py fused add backward ({dtypes}, {m}x{n})")


def test_rms_norm_model_counts_partials_and_the_two_pass_backward():
    # the old model charged 3s per element to every backward; at 264 programs (two per H100 SM), 4096 tokens:
    # hidden 4096: + the dweight partials, written and summed (2 * 264 * 4 / 4096 = 0.52 B per element): 1.084x (bf16)
    # hidden 32768: + the row-dot pass's second read of x and dy (5s, not 3s) and the partials: 1.75x (bf16)
    # hidden 12288 and 16384 keep the row in one block in every dtype: 6.50 B per element in bf16/fp16, 12.50 in fp32,
    # against liger's one block (3s + its 132 partial rows, 0.26 B): 1.04x and 1.02x; issue 20's target for RMSNorm
    # backward above 8192 is <= 1.1x liger's bytes. fp32 issues the weight every row (16.50 B per element issued, 1.33x
    # liger's issued 12.39), 64 KB that stays in L1/L2: DRAM sees it once, as weight_once counts it.
    for n, s, ratio in ((4096, 2, 1.084), (32768, 2, 1.751), (16384, 2, 1.084), (16384, 4, 1.042)):
        read, write = bench_rms_norm.traffic_model("backward", 4096, n, s, s, num_programs=264, weight_once=True)
        assert abs((read + write) / (3 * 4096 * n * s) - ratio) < 1e-3
    for n in (12288, 16384):
        for s, low, high in ((2, 1.03, 1.04), (4, 1.01, 1.03)):
            liger = 3 * 4096 * n * s + 2 * 132 * n * 4
            ours = sum(bench_rms_norm.traffic_model("backward", 4096, n, s, s, num_programs=264, weight_once=True))
            assert low < ours / liger < high  # the target: <= 1.1
    issued = sum(bench_rms_norm.traffic_model("backward", 4096, 16384, 4, 4, num_programs=264))
    assert abs(issued / (4096 * 16384) - 16.50) < 0.01


@pytest.mark.parametrize(
    "dtypes", ["fp32", "bf16", "fp16", "bf16+fp32"]
)  # x's dtype (+ the residual's where it differs)
@pytest.mark.parametrize("w_dtype", ["same", "fp32"])
@pytest.mark.parametrize("max_block", [None, 32])  # one block per row; the column loops (h read back, row-dot pass)
@pytest.mark.parametrize("grad_h", [True, False])  # False: no gradient at h (the model's final norm)
def test_fused_add_rms_norm_forward_and_backward(dtypes, w_dtype, max_block, grad_h):
    x_dtype, res_dtype = (DTYPES[d] for d in (dtypes.split("+") * 2)[:2])
    m, n = 37, 100
    x, residual = torch.randn(m, n, dtype=x_dtype), torch.randn(m, n, dtype=res_dtype)
    w = torch.randn(n, dtype=x_dtype if w_dtype == "same" else torch.float32)
    with traffic.measure() as fwd:
        _, h, rstd = fused_add_rms_norm_fwd(x, residual, w, 1e-6, 0.0, max_block=max_block)
    with traffic.measure() as bwd:
        fused_add_rms_norm_bwd(
            torch.randn_like(h),
            torch.randn_like(h) if grad_h else None,
            h,
            w,
            rstd,
            0.0,
            x_dtype,
            res_dtype,
            max_block=max_block,
        )
    s, ws, rs = x.element_size(), w.element_size(), residual.element_size()
    which = f"bench/bench_rms_norm.py fused add ({dtypes}, weight {w.dtype}, {m}x{n}, max_block {max_block})"
    for mode, measured in (("forward", fwd), ("backward", bwd)):
        model = bench_rms_norm.traffic_parts(mode, m, n, s, ws, max_block=max_block, residual_size=rs, grad_h=grad_h)
        assert_matches(model, measured, f"{which} {mode}")
    # where the row is in registers our model is the minimum but for O(M + N): rstd (4 B a row, written and read),
    # one program's fp32 dweight partial row summed and cast (the weight counted once, as DRAM sees it)
    if max_block is None and grad_h:
        for mode in ("forward", "backward", "full"):
            ours = bench_rms_norm.traffic_model(mode, m, n, s, ws, residual_size=rs, weight_once=True, num_programs=1)
            low = bench_rms_norm.min_traffic(mode, m, n, s, ws, residual_size=rs)
            assert all(0 <= o - lo <= 4 * m + 12 * n for o, lo in zip(ours, low)), (mode, ours, low)


@pytest.mark.parametrize("max_block", [None, 32])
def test_fused_add_rms_norm_full_step_with_torch_ops(max_block):
    m, n = 13, 100
    x = torch.randn(m, n, dtype=torch.bfloat16).requires_grad_()
    residual = torch.randn(m, n).requires_grad_()  # fp32 stream, bf16 update: the model under autocast
    w = torch.randn(n).requires_grad_()
    dnormed, dh = torch.randn(m, n), torch.randn(m, n)
    with traffic.measure(torch_ops=True) as full:
        normed, h = FusedAddRMSNormFunction.apply(x, residual, w, 1e-6, 0.0, max_block)
        torch.autograd.grad([normed, h], [x, residual, w], [dnormed, dh])
    model = bench_rms_norm.traffic_parts("full", m, n, 2, 4, max_block=max_block, residual_size=4)
    assert_matches(model, full, f"bench/bench_rms_norm.py fused add full (max_block {max_block})")


# ---- NEFTune ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 5, 24), (1, 3, 4100)])  # one column block; two (quarter 1025 > 1024)
@pytest.mark.parametrize("mask", [False, True])
def test_neftune(dtype, shape, mask):
    b, t, d = shape
    e = torch.randn(shape, dtype=DTYPES[dtype])
    attention_mask = torch.ones(b, t, dtype=torch.long)
    attention_mask[0, -1] = 0
    with traffic.measure() as m:
        kernels.neftune_noise(e, 5.0, attention_mask=attention_mask if mask else None)
    model = {"_neftune_fwd_kernel": bench_neftune.traffic_model(b, t, d, e.element_size(), mask=mask)}
    assert_matches(model, m, f"bench/bench_neftune.py ({dtype}, {shape}, mask={mask})")


# ---- AdamW --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["ours_fp32", "ours_bf16_master", "ours_bf16_sr"])
def test_adamw(variant):
    shapes = [(2100,), (3, 7), (33,)]  # one full block + a tail, and two small tensors
    params, opt = bench_adamw.build(variant, shapes, torch.device("cpu"))
    with bench_adamw.forced_impl("triton"):
        opt.step()  # state allocated
        with traffic.measure(torch_ops=True) as m:
            opt.step()
    numels = [p.numel() for p in params]
    assert_matches(bench_adamw.traffic_parts(variant, numels), m, f"bench/bench_adamw.py {variant}")


# ---- fused linear cross-entropy -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", DTYPES
)  # every dtype: the weight gradient in the token pass (fp32 or the weight's dtype)
@pytest.mark.parametrize("ignored", ["none", "some", "all"])
@pytest.mark.parametrize("tiles", ["one", "several"])  # several: chunks of 4 rows
def test_fused_linear_cross_entropy(dtype, ignored, tiles, monkeypatch):
    flce = importlib.import_module("kernels.fused_linear_cross_entropy")  # kernels/__init__ shadows the module name
    if tiles == "several":
        monkeypatch.setattr(flce, "MIN_CHUNK_ROWS", 4)
    n, h, v = 11, 16, 100
    hidden = torch.randn(n, h, dtype=DTYPES[dtype]).requires_grad_()
    weight = torch.randn(v, h, dtype=DTYPES[dtype]).requires_grad_()
    target = torch.randint(0, v, (n,))
    target[{"none": slice(0), "some": slice(None, None, 3), "all": slice(None)}[ignored]] = -100
    n_ignored = int((target == -100).sum())
    with kernels.backend("triton"):
        with traffic.measure(torch_ops=True) as fwd:
            loss = flce.fused_linear_cross_entropy(hidden, weight, target)
        with traffic.measure(torch_ops=True) as bwd:
            loss.backward()
    s = hidden.element_size()
    which = (
        f"bench/bench_fused_linear_cross_entropy.py ({dtype}, N={n} H={h} V={v}, {n_ignored} ignored, {tiles} tiles)"
    )
    for mode, measured in (("forward", fwd), ("backward", bwd)):
        model = bench_fused_linear_cross_entropy.traffic_parts(mode, n, h, v, s, n_ignored, cuda=False)
        assert_matches(model, measured, f"{which} {mode}")


def use_tiles(monkeypatch, tiles):
    """tiles "several": fused linear cross-entropy's token chunks of 4 rows and vocabulary tiles of 3 x 64 ("one": its
    own)."""
    if tiles == "several":
        flce = importlib.import_module("kernels.fused_linear_cross_entropy")  # kernels/__init__ shadows the module name
        monkeypatch.setattr(flce, "MIN_CHUNK_ROWS", 4)
        monkeypatch.setattr(flce, "VOCAB_TILE_ROWS", 3)
        monkeypatch.setattr(flce, "VOCAB_TILE_COLS", 64)


def lm_head_inputs(lead, hdim, vocab, dtype):
    """hidden (*lead, H) and weight (V, H) requiring gradients, targets (*lead) in [0, V)."""
    hidden = torch.randn(*lead, hdim, dtype=dtype).requires_grad_()
    weight = torch.randn(vocab, hdim, dtype=dtype).requires_grad_()
    return hidden, weight, torch.randint(0, vocab, lead)


@pytest.mark.parametrize("dtype", DTYPES)  # fp32: the token pass's weight gradient; bf16/fp16: the vocabulary pass
@pytest.mark.parametrize("ignored", ["none", "some", "all"])
@pytest.mark.parametrize("tiles", ["one", "several"])  # several: token chunks of 4 rows, vocabulary tiles of 3 x 64
def test_fused_linear_cross_entropy_per_row_losses(dtype, ignored, tiles, monkeypatch):
    # reduction="none": the forward computes the losses only; the backward takes a per-row grad_output
    use_tiles(monkeypatch, tiles)
    n, h, v = 11, 16, 100
    hidden, weight, target = lm_head_inputs((n,), h, v, DTYPES[dtype])
    target[{"none": slice(0), "some": slice(None, None, 3), "all": slice(None)}[ignored]] = -100
    n_ignored = int((target == -100).sum())
    with kernels.backend("triton"):
        with traffic.measure(torch_ops=True) as fwd:
            loss = kernels.fused_linear_cross_entropy(hidden, weight, target, reduction="none")
        grad_output = torch.linspace(-1, 2, n, dtype=loss.dtype)
        with traffic.measure(torch_ops=True) as bwd:
            loss.backward(grad_output)
    which = f"bench/bench_fused_linear_cross_entropy.py reduction none ({dtype}, {n_ignored} ignored, {tiles} tiles)"
    for mode, measured in (("forward", fwd), ("backward", bwd)):
        model = bench_fused_linear_cross_entropy.traffic_parts(
            mode, n, h, v, hidden.element_size(), n_ignored, cuda=False, reduction="none"
        )
        assert_matches(model, measured, f"{which} {mode}")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("ignored", ["none", "some"])
def test_fused_linear_cross_entropy_fp32_weight_under_autocast(dtype, ignored):
    # the trainer's case: fp32 master weight, activations in bf16/fp16: the token-pass weight gradient in fp32
    n, h, v = 11, 16, 100
    hidden = torch.randn(n, h, dtype=DTYPES[dtype]).requires_grad_()
    weight = torch.randn(v, h).requires_grad_()
    target = torch.randint(0, v, (n,))
    target[{"none": slice(0), "some": slice(None, None, 3)}[ignored]] = -100
    n_ignored = int((target == -100).sum())
    with kernels.backend("triton"), torch.autocast("cpu", dtype=DTYPES[dtype]):
        with traffic.measure(torch_ops=True) as fwd:
            loss = kernels.fused_linear_cross_entropy(hidden, weight, target)
        with traffic.measure(torch_ops=True) as bwd:
            loss.backward()
    which = f"bench/bench_fused_linear_cross_entropy.py ({dtype} under autocast, fp32 weight, {n_ignored} ignored)"
    for mode, measured in (("forward", fwd), ("backward", bwd)):
        model = bench_fused_linear_cross_entropy.traffic_parts(
            mode, n, h, v, hidden.element_size(), n_ignored, w=4, cuda=False
        )
        assert_matches(model, measured, f"{which} {mode}")


# ---- fused linear preference --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ignored", ["none", "prompt", "all"])
@pytest.mark.parametrize("tiles", ["one", "several"])  # several: token chunks of 4 rows, vocabulary tiles of 3 x 64
def test_fused_linear_preference(dtype, ignored, tiles, monkeypatch):
    use_tiles(monkeypatch, tiles)
    n_seqs, seq_len, h, v = 4, 5, 16, 100
    hidden, weight, target = lm_head_inputs((n_seqs, seq_len), h, v, DTYPES[dtype])
    target[:, {"none": slice(0), "prompt": slice(0, 2), "all": slice(None)}[ignored]] = -100
    n_ignored = int((target == -100).sum())
    with kernels.backend("triton"):
        with torch.no_grad(), traffic.measure(torch_ops=True) as reference:
            kernels.fused_linear_preference(hidden, weight, target)
        with traffic.measure(torch_ops=True) as fwd:
            logps = kernels.fused_linear_preference(hidden, weight, target).logps
        upstream = torch.tensor([1.0, -2.0, 0.5, 3.0])
        with traffic.measure(torch_ops=True) as bwd:
            logps.backward(upstream)
    which = f"bench/bench_fused_linear_preference.py ({dtype}, {n_ignored} ignored, {tiles} tiles)"
    for mode, measured in (("forward", reference), ("forward", fwd), ("backward", bwd)):
        model = bench_fused_linear_preference.traffic_parts(
            mode, n_seqs, seq_len, h, v, hidden.element_size(), n_ignored, cuda=False
        )
        assert_matches(model, measured, f"{which} {mode}")


def test_fused_linear_preference_fp32_weight_under_autocast():
    n_seqs, seq_len, h, v = 4, 5, 16, 100
    hidden, _, target = lm_head_inputs((n_seqs, seq_len), h, v, torch.bfloat16)
    weight = torch.randn(v, h).requires_grad_()
    target[:, :2] = -100
    with kernels.backend("triton"), torch.autocast("cpu", dtype=torch.bfloat16):
        with traffic.measure(torch_ops=True) as fwd:
            logps = kernels.fused_linear_preference(hidden, weight, target).logps
        upstream = torch.ones(n_seqs)
        with traffic.measure(torch_ops=True) as bwd:
            logps.backward(upstream)
    for mode, measured in (("forward", fwd), ("backward", bwd)):
        model = bench_fused_linear_preference.traffic_parts(mode, n_seqs, seq_len, h, v, 2, 8, w=4, cuda=False)
        assert_matches(
            model, measured, f"bench/bench_fused_linear_preference.py (bf16 under autocast, fp32 weight) {mode}"
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [6, 40])  # one pair per chunk; every pair in one chunk
def test_fused_linear_preference_loss(dtype, chunk, monkeypatch):
    # the loss's O(pairs) torch ops (the chunk's autograd of its pair losses, the final loss value) run with the
    # meter paused: the model leaves them out
    from torch.utils._python_dispatch import _disable_current_modes

    loss_mod = importlib.import_module("kernels.fused_linear_preference_loss")

    def paused(fn):
        def run(*args, **kwargs):
            with _disable_current_modes():
                return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(loss_mod, "_chunk_grad", paused(loss_mod._chunk_grad))
    monkeypatch.setattr(loss_mod, "preference_loss", paused(loss_mod.preference_loss))
    monkeypatch.setattr(
        importlib.import_module("kernels.fused_linear_cross_entropy"), "_chunk_rows", lambda n, h, v: chunk
    )
    n_seqs, seq_len, h, v = 4, 5, 16, 100
    hidden, weight, target = lm_head_inputs((n_seqs, seq_len), h, v, DTYPES[dtype])
    target[:, :2] = -100
    ref = torch.zeros(n_seqs)
    per_pair = [(6, 1), (6, 1)] if chunk == 6 else [(12, 2)]
    with kernels.backend("triton"):
        with traffic.measure(torch_ops=True) as fwd:
            loss, _ = loss_mod.FusedLinearPreferenceLossFunction.apply(
                hidden, weight, target, None, ref, ("sigmoid", 0.1, 0.0, 0.5, 0.5, 1.0), -100, None
            )[:2]
        with traffic.measure(torch_ops=True) as bwd:
            loss.backward()
    for mode, measured in (("forward", fwd), ("backward", bwd)):
        model = bench_fused_linear_preference.loss_traffic_parts(
            mode, n_seqs, seq_len, h, v, hidden.element_size(), per_pair, cuda=False
        )
        assert_matches(model, measured, f"bench/bench_fused_linear_preference.py loss_traffic_parts ({dtype}) {mode}")


# ---- SwiGLU -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(dtype):
    # 3 x 70001 elements: several interpreter programs, the last one ragged (masked lanes move nothing)
    gate = torch.randn(3, 70001, dtype=DTYPES[dtype]).requires_grad_()
    up = torch.randn(3, 70001, dtype=DTYPES[dtype]).requires_grad_()
    dout = torch.randn(3, 70001, dtype=DTYPES[dtype])
    with kernels.backend("triton"):
        with traffic.measure() as fwd:
            out = kernels.swiglu(gate, up)
        with traffic.measure() as bwd:
            out.backward(dout)
    for mode, measured in (("forward", fwd), ("backward", bwd)):
        model = bench_swiglu.traffic_parts(mode, gate.numel(), gate.element_size())
        assert_matches(model, measured, f"bench/bench_swiglu.py ({dtype}) {mode}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_backward_writing_act(dtype):
    """kernels.swiglu_bwd_act (kernels.swiglu_linear's backward): the backward's bytes plus act's write."""
    from kernels.swiglu import swiglu_bwd_act

    gate, up, dout = (torch.randn(3, 70001, dtype=DTYPES[dtype]) for _ in range(3))
    with traffic.measure() as bwd:
        swiglu_bwd_act(dout, gate, up)
    model = bench_swiglu.traffic_parts("backward", gate.numel(), gate.element_size(), store_act=True)
    assert_matches(model, bwd, f"bench/bench_swiglu.py ({dtype}) backward, act written")


# ---- NF4/FP4 dequantization ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tile", ["interpreter", "gpu"])  # one program per 65536 elements; the GPU's 2048
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nested", [False, True], ids=["absmax32", "nested"])
@pytest.mark.parametrize("case", [(64 * 40, 64), (7007, 128), (9001, 4096)], ids=str)  # whole blocks, odd, > tile
def test_dequantize_4bit(case, nested, dtype, tile, monkeypatch):
    n, blocksize = case
    if tile == "gpu":
        monkeypatch.setattr(importlib.import_module("kernels.dequantize_4bit"), "_CPU_MAX_TILE", 2048)
    blocks = -(-n // blocksize)
    codes = torch.randint(0, 256, ((n + 1) // 2, 1), dtype=torch.uint8)
    second = None
    if nested:
        absmax = torch.randint(0, 256, (blocks,), dtype=torch.uint8)
        second = kernels.NestedAbsmax(torch.rand(256), torch.rand(-(-blocks // 256)), 256, torch.tensor(0.1))
    else:
        absmax = torch.rand(blocks)
    with kernels.backend("triton"), traffic.measure() as measured:
        out = kernels.dequantize_4bit(codes, absmax, "nf4", blocksize, (n,), DTYPES[dtype], second)
    s = out.element_size()
    which = f"bench/bench_dequantize_4bit.py ({dtype}, n={n}, blocksize {blocksize}, nested={nested}, {tile} tile)"
    assert_matches(bench_dequantize_4bit.traffic_parts(n, s, blocksize, nested, cuda=False), measured, which)
    per_tensor = {k: (t.read, t.write) for k, t in measured.by_tensor().items()}
    if nested:  # every argument its own tensor: the model's terms one by one
        assert per_tensor == bench_dequantize_4bit.traffic_tensors(n, s, blocksize, nested, cuda=False), which
    # the DRAM model (the GB/s columns): the distinct bytes of codes, scales and output, plus the 1 KiB code book and
    # the offset when nested (read whole from DRAM at most once; here only the entries the random codes pick)
    distinct = {k: t.distinct_read + t.distinct_write for k, t in measured.by_tensor().items()}
    scales = distinct["absmax_ptr"] + (distinct["absmax2_ptr"] if nested else 0)
    read, write = bench_dequantize_4bit.dram_bytes(n, s, blocksize, nested)
    assert (distinct["codes_ptr"], distinct["out_ptr"]) == ((n + 1) // 2, write)
    assert read == distinct["codes_ptr"] + scales + (256 * 4 + 4 if nested else 0), which


# ---- gated RMSNorm (Gated DeltaNet's output norm) ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("w_dtype", ["same", "fp32"])
def test_gated_rms_norm_full_step_with_torch_ops(dtype, w_dtype):
    # 37 ragged rows of 100 (tiles of 32 rows over 4 backward programs): forward, then the autograd backward with the
    # dweight finish (sum of the partials, cast)
    m, n = 37, 100
    x = torch.randn(m, n, dtype=DTYPES[dtype]).requires_grad_()
    z = torch.randn(m, n, dtype=x.dtype).requires_grad_()
    w = torch.randn(n, dtype=x.dtype if w_dtype == "same" else torch.float32).requires_grad_()
    dy = torch.randn_like(x)
    with kernels.backend("triton"):
        with traffic.measure(torch_ops=True) as fwd:
            y = kernels.gated_rms_norm(x, z, w)
        with traffic.measure(torch_ops=True) as bwd:
            torch.autograd.grad(y, [x, z, w], dy)
    s, ws = x.element_size(), w.element_size()
    for mode, measured in (("forward", fwd), ("backward", bwd)):
        model = bench_gated_rms_norm.traffic_parts(mode, m, n, s, ws)
        assert_matches(model, measured, f"bench/bench_gated_rms_norm.py ({dtype}, weight {w.dtype}) {mode}")


# ---- Gated DeltaNet's causal convolution ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("packed", [None, [0, 2, 40, 47, 70]])  # rows; sequences of 2, 38, 7 and 23 tokens
def test_causal_conv1d(dtype, bias, packed):
    # 2 rows of 35 tokens (or one packed row of 70) x 200 channels: ragged token tiles and channel blocks
    shape = (2, 35, 200) if packed is None else (1, 70, 200)
    x = torch.randn(shape, dtype=DTYPES[dtype]).requires_grad_()
    w = torch.randn(200, 4, dtype=x.dtype).requires_grad_()
    b = torch.randn(200, dtype=x.dtype).requires_grad_() if bias else None
    dy = torch.randn_like(x)
    cu = None if packed is None else torch.tensor(packed)
    lengths = [35, 35] if packed is None else [e - s for s, e in zip(packed, packed[1:])]
    with kernels.backend("triton"):
        with traffic.measure() as fwd:  # the kernel (the tokens' sequence starts are built by torch ops before it)
            y = kernels.causal_conv1d(x, w, b, "silu", cu)
        with traffic.measure(torch_ops=True) as bwd:  # the kernel, then the partials' sum
            torch.autograd.grad(y, [x, w] + ([b] if bias else []), dy)
    s = x.element_size()
    for mode, measured in (("forward", fwd), ("backward", bwd)):
        model = bench_causal_conv1d.traffic_parts(mode, lengths, 200, s, s, bias=bias)
        assert_matches(model, measured, f"bench/bench_causal_conv1d.py ({dtype}, bias {bias}, {lengths}) {mode}")


# ---- MoE experts (grouped GEMMs) ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, kind, k, small, rank",
    [
        ("fp32", "gpt_oss", 2, True, 0),
        ("bf16", "qwen3_moe", 1, False, 0),
        ("bf16", "gpt_oss", 4, False, 0),
        ("bf16", "qwen3_moe", 2, False, 4),  # LoRA on both expert tensors, the experts' weights frozen
        ("fp32", "gpt_oss", 2, True, 18),  # a 32-wide rank block, several column blocks
        ("bf16", "qwen3_moe", 2, True, (0, 5)),  # down alone adapted
        ("bf16", "gpt_oss", 2, False, (3, 0)),  # gate_up alone adapted
    ],
)
def test_moe_experts_forward_and_backward(dtype, kind, k, small, rank, monkeypatch):
    # 23 tokens, H 40, I 24, 5 experts with one empty (the grid's empty tiles read their two table entries only);
    # small: 8-row tiles and 16-wide blocks (ragged column blocks, the down bias read by block 0 only)
    from kernels import moe

    if small:
        monkeypatch.setattr(moe, "CPU_TILES", moe.SMALL_TILES)
    t, hidden, inter, experts = 23, 40, 24, 5
    cfg = bench_moe.GPT_OSS if kind == "gpt_oss" else bench_moe.SILU
    bias = kind == "gpt_oss"
    dt = DTYPES[dtype]
    logits = torch.randn(t, experts)
    logits[:, 2] = -1e9
    index = logits.topk(k, dim=-1).indices
    weights = torch.softmax(torch.randn(t, k), -1).requires_grad_()  # fp32 router weights: no cast of dw
    x = torch.randn(t, hidden, dtype=dt).requires_grad_()
    w1 = torch.randn((experts, hidden, 2 * inter) if cfg["transposed"] else (experts, 2 * inter, hidden), dtype=dt)
    w2 = torch.randn((experts, inter, hidden) if cfg["transposed"] else (experts, hidden, inter), dtype=dt)
    params = [w1, w2]
    params += [torch.randn(experts, n, dtype=dt) for n in (2 * inter, hidden)] if bias else [None] * 2
    loras = {}
    if rank:
        ranks = rank if isinstance(rank, tuple) else (rank, rank)  # gate_up's, down's (0: not adapted)
        loras = {
            f"{name}_lora": moe.ExpertLoRA(
                torch.randn(r * experts, fan_in, dtype=dt).requires_grad_(),
                torch.randn(fan_out, r * experts, dtype=dt).requires_grad_(),
                2.0,
            )
            for (name, fan_in, fan_out), r in zip((("gate_up", hidden, 2 * inter), ("down", inter, hidden)), ranks)
            if r
        }
        trained = [t for lora in loras.values() for t in (lora.lora_A, lora.lora_B)]
    else:
        trained = [p.requires_grad_() for p in params if p is not None]
    dout = torch.randn(t, hidden, dtype=dt)
    with kernels.backend("triton"):
        with traffic.measure() as fwd:  # the kernels (the routing sort and the slots' sum are torch ops)
            out = kernels.moe_experts(x, index, weights, *params, **cfg, **loras)
        with traffic.measure(torch_ops=True) as bwd:  # the kernels, the slots' sum, the dweights partials' sum
            torch.autograd.grad(out, [x, weights, *trained], dout)
    counts = torch.bincount(index.reshape(-1), minlength=experts).tolist()
    s = x.element_size()
    for mode, measured in (("forward", fwd), ("backward", bwd)):
        model = bench_moe.traffic_parts(
            mode, counts, t, k, hidden, inter, s, s, bias=bias, router_size=4, tiles=moe.CPU_TILES, lora_rank=rank
        )
        what = f"bench/bench_moe.py ({dtype}, {kind}, k={k}, small={small}, LoRA rank {rank}) {mode}"
        assert_matches(model, measured, what)
