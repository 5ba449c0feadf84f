"""The optional CUDA C++ ops (csrc/, built into kernels._C by setup.py) and their dispatch.

CPU (always run):
- the pure install works: `import kernels` without kernels._C, and the dispatch says why the op is unavailable;
- `kernels.adamw.adamw_impl` picks cuda / triton / reference by KERNELS_ADAMW_IMPL and says why, warning once when
  'cuda' is asked for and cannot be had; a bad KERNELS_ADAMW_IMPL is one clear error at import;
- csrc/ops.cpp's schema parses, and the optimizer's call site passes its arguments in the schema's order (the schema
  is registered under the real name with a Python implementation of the same semantics, so the call is checked
  against the schema the C++ library declares, without building it);
- setup.py decides to skip the build, with a warning, under KERNELWRIGHT_SKIP_CUDA_BUILD=1 and on a CPU PyTorch,
  and KERNELWRIGHT_FORCE_CUDA_BUILD=1 turns the skip into an error.
GPU (marked `gpu`, skipped without CUDA; need the extension built): the CUDA op against the reference
(`adamw_step_ref` and the optimizer's reference path) and against the Triton kernel, for fp32, bf16/fp16 with fp32
masters and bf16 stochastic rounding, on awkward sizes, unaligned tensors and more tensors than one launch holds.

Tolerances: the CUDA op and the Triton kernel compute the same fp32 expression with IEEE sqrt and division; what may
differ from the reference is FMA contraction, about one fp32 ulp per step (tests/kernels/test_adamw.py's FP32_TOL,
measured there for the Triton path); low-precision parameters are the round-to-nearest copy of their master, so at
most one ulp of their dtype apart when the masters differ in the last fp32 bit.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

import kernels
import kernels.adamw as kadamw
from kernels import FusedAdamW, adamw_step_ref

ROOT = Path(__file__).resolve().parents[2]
HAS_EXT = kadamw.cuda_op_unavailable() is None
FP32_TOL = {"param": (2e-6, 2e-6), "exp_avg": (2e-7, 1e-6), "exp_avg_sq": (1e-8, 1e-6)}


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("KERNELWRIGHT_", "KERNELS_ADAMW"))}
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=120
    )


def _schema() -> str:
    text = (ROOT / "csrc" / "ops.cpp").read_text()
    body = re.search(r'm\.def\(\s*((?:"[^"]*"\s*)+)\)', text).group(1)
    return "kernelwright::" + "".join(re.findall(r'"([^"]*)"', body))


# ---------------------------------------------------------------------------------------------------------
# The pure install and the dispatch (CPU)
# ---------------------------------------------------------------------------------------------------------


def test_cpu_params_take_the_reference_and_say_why():
    impl, why = kadamw.adamw_impl(torch.zeros(3))
    expected = "triton" if kernels.use_triton(torch.zeros(3)) else "reference"  # the interpreter in tests
    assert impl == expected
    assert "cpu" in why and "CUDA tensors" in why


def _cuda_like(dtype=torch.float32):
    """A stand-in for a CUDA parameter on a CPU-only torch: all `adamw_impl` reads is is_cuda, device and dtype."""
    return types.SimpleNamespace(is_cuda=True, device=torch.device("cuda"), dtype=dtype)


@pytest.mark.skipif(not kernels.HAS_TRITON, reason="needs triton")
def test_dispatch_rules_and_reasons(monkeypatch):
    missing = "the CUDA extension kernels._C is not built (test)"
    monkeypatch.setattr(kadamw, "_MISSING", missing)
    monkeypatch.setattr(kadamw, "_warned", set())

    monkeypatch.setattr(kadamw, "_ADAMW_IMPL", "auto")
    impl, why = kadamw.adamw_impl(_cuda_like())
    assert impl == "triton" and "auto keeps Triton" in why and missing in why

    monkeypatch.setattr(kadamw, "_ADAMW_IMPL", "triton")
    assert kadamw.adamw_impl(_cuda_like()) == ("triton", "KERNELS_ADAMW_IMPL=triton")

    monkeypatch.setattr(kadamw, "_ADAMW_IMPL", "cuda")
    with pytest.warns(UserWarning, match="KERNELS_ADAMW_IMPL=cuda but the CUDA extension kernels._C is not built"):
        impl, why = kadamw.adamw_impl(_cuda_like())
    assert impl == "triton" and missing in why
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason, not once per step
        assert kadamw.adamw_impl(_cuda_like())[0] == "triton"

    monkeypatch.setattr(kadamw, "_MISSING", None)  # as if kernels._C were built
    assert kadamw.adamw_impl(_cuda_like()) == ("cuda", "KERNELS_ADAMW_IMPL=cuda")
    # auto: the op for bf16 parameters (measured faster on an H200), Triton for fp32 (measured slower) and fp16 (not
    # measured)
    monkeypatch.setattr(kadamw, "_ADAMW_IMPL", "auto")
    for dtype in (torch.float32, torch.float16):
        assert kadamw.adamw_impl(_cuda_like(dtype)) == (
            "triton",
            "KERNELS_ADAMW_IMPL=auto keeps Triton: no committed GPU measurement shows the CUDA op faster than Triton "
            f"for {dtype} parameters",
        )
    assert kadamw.adamw_impl(_cuda_like(torch.bfloat16)) == (
        "cuda",
        "KERNELS_ADAMW_IMPL=auto and the CUDA op was measured faster for torch.bfloat16 parameters",
    )
    monkeypatch.setattr(kadamw, "_MISSING", missing)  # bf16 without the built op: Triton, and why
    impl, why = kadamw.adamw_impl(_cuda_like(torch.bfloat16))
    assert impl == "triton" and why == f"KERNELS_ADAMW_IMPL=auto keeps Triton: {missing}"


def test_bad_impl_name_is_one_clear_error():
    out = _run("import kernels", KERNELS_ADAMW_IMPL="cudnn")
    assert out.returncode != 0
    assert "KERNELS_ADAMW_IMPL='cudnn' is not one of auto, triton, cuda" in out.stderr


def test_pure_install_imports_and_cuda_forced_on_cpu_steps_on_the_reference():
    """`import kernels` without kernels._C (here: never built) works and says why the op is missing; with
    KERNELS_ADAMW_IMPL=cuda, CPU parameters still step (on torch's fused CPU AdamW, fp32)."""
    code = (
        "import torch, kernels\n"
        "from kernels.adamw import adamw_impl, cuda_op_unavailable\n"
        "p = torch.nn.Parameter(torch.ones(5)); p.grad = torch.ones(5)\n"
        "opt = kernels.FusedAdamW([p], lr=0.1, weight_decay=0.0); opt.step()\n"
        "print('IMPL', adamw_impl(p)[0], round(p[0].item(), 6))\n"
        "print('REASON', cuda_op_unavailable())\n"
    )
    out = _run(code, KERNELS_ADAMW_IMPL="cuda", TRITON_INTERPRET="0")
    assert out.returncode == 0, out.stderr
    assert "IMPL torch_cpu 0.9" in out.stdout  # first Adam step: w - lr * sign(g)
    reason = out.stdout.split("REASON", 1)[1].strip()
    if HAS_EXT:
        assert reason == "None"
    else:
        assert "kernels._C is not built" in reason and "pip install" in reason


# ---------------------------------------------------------------------------------------------------------
# The schema and the call site (CPU)
# ---------------------------------------------------------------------------------------------------------


def test_schema_parses_with_the_expected_mutability():
    schema = torch._C.parse_schema(_schema())
    names = [a.name for a in schema.arguments]
    assert names == [
        "params",
        "grads",
        "exp_avgs",
        "exp_avg_sqs",
        "masters",
        "steps",
        "lr",
        "beta1",
        "beta2",
        "eps",
        "weight_decay",
        "maximize",
        "stochastic_rounding",
    ]
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"params", "exp_avgs", "exp_avg_sqs", "masters", "steps"}
    assert not schema.returns


@pytest.mark.skipif(HAS_EXT, reason="kernels._C is built here and owns the kernelwright namespace")
def test_optimizer_calls_the_op_in_schema_order(monkeypatch):
    """Register ops.cpp's schema under its real name with a CPU implementation of the same semantics (steps
    incremented by the op, masters empty or one per param) and route the optimizer through it."""
    lib = torch.library.Library("kernelwright", "FRAGMENT")
    lib.define(_schema().split("::", 1)[1])
    calls = []

    def fused_adamw_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        masters,
        steps,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        maximize,
        stochastic_rounding,
    ):
        calls.append((len(params), len(masters), lr, beta1, beta2, eps, weight_decay, maximize, stochastic_rounding))
        kadamw._adamw_bucket_ref(
            list(params),
            list(grads),
            list(exp_avgs),
            list(exp_avg_sqs),
            list(steps),
            list(masters) or None,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            maximize=maximize,
            stochastic_rounding=stochastic_rounding,
        )

    lib.impl("fused_adamw_", fused_adamw_, "CPU")
    try:
        monkeypatch.setattr(kadamw, "adamw_impl", lambda p, state_dtype=torch.float32: ("cuda", "test"))
        g = torch.Generator().manual_seed(0)
        shapes = [(7, 3), (5,), (11,)]
        for dtype, master in ((torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)):
            ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]
            ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
            opt = FusedAdamW(
                ps, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, maximize=True, master_weights=master
            )
            opt_ref = FusedAdamW(
                ref, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, maximize=True, master_weights=master
            )
            for _ in range(3):
                for p, r in zip(ps, ref):
                    p.grad = torch.randn(p.shape, generator=g).to(dtype)
                    r.grad = p.grad.clone()
                opt.step()
                with monkeypatch.context() as m, kernels.backend("reference"):
                    m.setattr(kadamw, "adamw_impl", lambda p, state_dtype=torch.float32: ("reference", "test"))
                    opt_ref.step()
            for p, r in zip(ps, ref):
                assert torch.equal(p, r)
                assert torch.equal(opt.state[p]["exp_avg"], opt_ref.state[r]["exp_avg"])
                assert torch.equal(opt.state[p]["step"], torch.tensor(3.0))
            low = dtype != torch.float32
            assert calls[-1] == (3, 3 if low and master else 0, 1e-2, 0.8, 0.95, 1e-6, 0.1, True, low and not master)
    finally:
        lib._destroy()


# ---------------------------------------------------------------------------------------------------------
# setup.py's decision (CPU)
# ---------------------------------------------------------------------------------------------------------


def _setup_name(**env) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KERNELWRIGHT_")}
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "setup.py", "--name"], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=120
    )


def test_setup_skips_the_build_when_asked():
    out = _setup_name(KERNELWRIGHT_SKIP_CUDA_BUILD="1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "kernelwright"
    assert "KERNELWRIGHT_SKIP_CUDA_BUILD=1: installing without the CUDA ops" in out.stderr


@pytest.mark.skipif(torch.version.cuda is not None, reason="this PyTorch is a CUDA build")
def test_setup_skips_on_cpu_torch_and_force_turns_it_into_an_error():
    out = _setup_name()
    assert out.returncode == 0, out.stderr
    assert f"PyTorch {torch.__version__} is not a CUDA build; installing without the CUDA ops" in out.stderr
    forced = _setup_name(KERNELWRIGHT_FORCE_CUDA_BUILD="1")
    assert forced.returncode != 0
    assert "KERNELWRIGHT_FORCE_CUDA_BUILD=1 but the CUDA ops cannot be built" in forced.stderr


# ---------------------------------------------------------------------------------------------------------
# GPU: the CUDA op against the reference and the Triton kernel
# ---------------------------------------------------------------------------------------------------------

GPU_SHAPES = [(781,), (1000, 3), (1,), (5003,), (8193,), (0, 5), (3, 65537)]  # tails, one element, > one chunk


def _make(dtype, seed, shapes=GPU_SHAPES, unaligned=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in shapes:
        x = torch.randn(s, generator=g)
        if unaligned:  # contiguous, 4 bytes past a 16-byte boundary: the scalar path
            buf = torch.empty(x.numel() + 1, device="cuda", dtype=dtype)
            buf[1:].copy_(x.reshape(-1).to(dtype))
            out.append(torch.nn.Parameter(buf[1:].view(s)))
        else:
            out.append(torch.nn.Parameter(x.to(device="cuda", dtype=dtype)))
    return out


def _run_opt(impl, dtype, master, seed=3, steps=3, shapes=GPU_SHAPES, unaligned=False, **hyper):
    ps = _make(dtype, seed, shapes, unaligned)
    opt = FusedAdamW(ps, master_weights=master, **{"lr": 1e-2, "weight_decay": 0.1, **hyper})
    g = torch.Generator().manual_seed(seed + 100)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(kadamw, "adamw_impl", lambda p, state_dtype=torch.float32: (impl, "test"))
        for _ in range(steps):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).to(device="cuda", dtype=dtype)
            with kernels.backend("reference" if impl == "reference" else "auto"):
                opt.step()
    torch.cuda.synchronize()
    return ps, opt


def _compare(a, b, dtype, sr=False):
    (ps_a, opt_a), (ps_b, opt_b) = a, b
    for i, (x, y) in enumerate(zip(ps_a, ps_b)):
        sa, sb = opt_a.state[x], opt_b.state[y]
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            if key in sa:
                atol, rtol = FP32_TOL["param" if key == "master_param" else key]
                torch.testing.assert_close(sa[key], sb[key], atol=atol, rtol=rtol, msg=lambda m: f"{key} #{i}: {m}")
        assert torch.equal(sa["step"], sb["step"])
        if dtype == torch.float32:
            torch.testing.assert_close(x, y, atol=FP32_TOL["param"][0], rtol=FP32_TOL["param"][1])
        elif x.numel():
            ulp = torch.finfo(dtype).eps * y.detach().float().abs() + 1e-6
            diff = (x.detach().float() - y.detach().float()).abs()
            bound = 2 * ulp if sr else ulp
            assert (diff <= bound).all(), f"#{i} {dtype}: more than {'two' if sr else 'one'} ulp apart"
    if sr:
        same = sum((x == y).sum().item() for x, y in zip(ps_a, ps_b)) / sum(p.numel() for p in ps_a)
        assert same > 0.99, f"stochastic rounding bits differ: only {same:.3f} identical"


CASES = [(torch.float32, False), (torch.bfloat16, True), (torch.float16, True), (torch.bfloat16, False)]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_EXT, reason="kernels._C is not built")
@pytest.mark.parametrize("dtype,master", CASES)
@pytest.mark.parametrize("unaligned", [False, True])
def test_cuda_op_matches_reference_and_triton(dtype, master, unaligned):
    cuda = _run_opt("cuda", dtype, master, unaligned=unaligned)
    sr = dtype == torch.bfloat16 and not master
    _compare(cuda, _run_opt("reference", dtype, master, unaligned=unaligned), dtype, sr)
    _compare(cuda, _run_opt("triton", dtype, master, unaligned=unaligned), dtype, sr)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_EXT, reason="kernels._C is not built")
def test_cuda_op_maximize_and_many_tensors():
    """More tensors than one launch holds (384 with CUDA >= 12.1, 48 before), maximize, other betas."""
    shapes = [(17 + i,) for i in range(400)]
    hyper = dict(betas=(0.8, 0.95), eps=1e-6, maximize=True)
    _compare(
        _run_opt("cuda", torch.float32, False, shapes=shapes, **hyper),
        _run_opt("reference", torch.float32, False, shapes=shapes, **hyper),
        torch.float32,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_EXT, reason="kernels._C is not built")
def test_cuda_op_against_adamw_step_ref_directly():
    g = torch.Generator().manual_seed(0)
    ps = [torch.randn(s, generator=g).cuda() for s in ((129,), (4, 33))]
    grads = [torch.randn(p.shape, generator=g).cuda() for p in ps]
    state = [[torch.zeros_like(p) for p in ps] for _ in range(2)] + [[torch.zeros((), device="cuda") for _ in ps]]
    ref = [p.clone() for p in ps], [[t.clone() for t in lst] for lst in state]
    hyper = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    for _ in range(4):
        torch.ops.kernelwright.fused_adamw_(ps, grads, state[0], state[1], [], state[2], *hyper.values(), False, False)
        adamw_step_ref(ref[0], grads, ref[1][0], ref[1][1], ref[1][2], **hyper)
    for a, b in zip(ps, ref[0]):
        torch.testing.assert_close(a, b, atol=FP32_TOL["param"][0], rtol=FP32_TOL["param"][1])
    for a, b in zip(state[2], ref[1][2]):
        assert a.item() == b.item() == 4.0
