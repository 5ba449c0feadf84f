"""GPU readiness without a GPU: every Triton kernel configuration our launchers choose at the benchmark shapes
compiles for sm_90 (H100) with no register spills.

`bench/sm90.py` does the work (launchers called on meta tensors that report cuda:0, launches recorded instead of
run, each distinct one compiled with triton.compile for GPUTarget("cuda", 90, 32) and ptxas's report read). It
runs in a subprocess because this test session sets TRITON_INTERPRET=1, and interpreted kernels cannot be
compiled. Measured: ~45 s wall on the shared 2-core CI box (24 configurations, ~20 s of CPU); the MoE experts' 18
configurations (four GEMM kernels; two models in bf16, and Qwen3-MoE's with fp32 master weights as autocast training
runs it: ~30 s of CPU) add about as much again.
Print the table yourself: python -m bench.sm90
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from bench.sm90 import CASES

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    "nvidia" not in triton.backends.backends, reason="this triton build has no NVIDIA backend (ptxas) to compile with"
)


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "bench.sm90", "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    # Exit status 1 means "compiled, but something spills": the assertions below say what.
    assert run.returncode in (0, 1), f"python -m bench.sm90 failed ({run.returncode}):\n{run.stderr[-4000:]}"
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def test_every_op_and_variant_is_compiled(compiled):
    assert {r["case"] for r in compiled} == set(CASES)
    kernels = {(r["case"], r["kernel"]) for r in compiled}
    for kernel in ("_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel", "_rms_norm_bwd_rowdot_kernel"):
        assert ("rms_norm", kernel) in kernels
    assert ("cross_entropy", "_cross_entropy_fwd_kernel") in kernels
    assert ("cross_entropy", "_cross_entropy_bwd_kernel") in kernels
    # Gemma 2's softcapping: the forward kernel (with label smoothing, its largest) and the vocabulary pass's slices
    capped = {(r["case"], r["kernel"]) for r in compiled if r["constexprs"].get("SOFTCAP", "0.0") != "0.0"}
    assert {
        ("cross_entropy", "_cross_entropy_fwd_kernel"),
        ("fused_linear_cross_entropy", "_flce_slice_grad_kernel"),
    } <= capped
    assert {("swiglu", "_swiglu_fwd_kernel"), ("swiglu", "_swiglu_bwd_kernel")} <= kernels
    # both activations: SwiGLU's silu and GeGLU's tanh GELU (Gemma)
    assert {r["constexprs"]["ACT"] for r in compiled if r["kernel"] == "_swiglu_fwd_kernel"} == {"0", "1"}
    # the preference head: cross-entropy without (reference, policy forward) and with per-row scales, the vocabulary
    # pass
    assert {
        ("fused_linear_preference", "_cross_entropy_fwd_kernel"),
        ("fused_linear_preference", "_flce_slice_grad_kernel"),
    } <= kernels
    assert {
        r["constexprs"]["COMPUTE_GRAD"]
        for r in compiled
        if (r["case"], r["kernel"]) == ("fused_linear_preference", "_cross_entropy_fwd_kernel")
    } == {"False", "True"}
    adamw = {
        (r["constexprs"]["P_DTYPE"], r["constexprs"]["HAS_MASTER"], r["constexprs"]["S_DTYPE"])
        for r in compiled
        if r["case"] == "adamw"
    }
    assert {("fp32", "False", "fp32"), ("bf16", "True", "fp32"), ("bf16", "False", "fp32")} <= adamw
    assert {("fp32", "False", "bf16"), ("bf16", "True", "bf16")} <= adamw  # bf16 moments
    # Every RMSNorm width the benchmark uses, both backward strategies (row in registers, up to 16384 wide in bf16;
    # column loop).
    bwd = {
        (r["constexprs"]["BLOCK_N"], r["constexprs"]["ONE_BLOCK"])
        for r in compiled
        if r["kernel"] == "_rms_norm_bwd_kernel"
    }
    assert {("4096", "True"), ("8192", "True"), ("16384", "True"), ("16384", "False")} <= bwd
    # fused_add_rms_norm: the same kernels with the residual (forward) and d_h_out (backward), and the autocast case's
    # second gradient dtype (bf16 dx beside the fp32 dresidual).
    fused = {
        (r["kernel"], r["constexprs"].get("HAS_RESIDUAL"), r["constexprs"].get("HAS_DH"), r["constexprs"].get("TWO_DX"))
        for r in compiled
        if r["case"] == "fused_add_rms_norm"
    }
    assert {
        ("_rms_norm_fwd_kernel", "True", None, None),
        ("_rms_norm_bwd_kernel", None, "True", "False"),
        ("_rms_norm_bwd_kernel", None, "True", "True"),
    } <= fused
    # RoPE's one kernel, forward and backward (the transpose), at Llama-3-8B's heads: every head in one tile without
    # masks, one batch per program and (batch-shared cos/sin) one program looping over the batch: B_PER_PROG=4 is a
    # runtime int, not specialised. One batch a program stays under 80 registers (7 programs an SM).
    rope = [r for r in compiled if r["kernel"] == "_rope_kernel"]
    assert {(r["constexprs"]["ONE_TILE"], r["constexprs"]["EVEN"], r["constexprs"]["BLOCK_HQ"]) for r in rope} == {
        ("True", "True", "32")
    }
    per_prog = {(r["constexprs"]["BACKWARD"], r["constexprs"].get("B_PER_PROG", "loop")) for r in rope}
    assert per_prog == {(backward, n) for backward in ("False", "True") for n in ("1", "loop")}
    assert all(r["registers"] <= 80 for r in rope if r["constexprs"].get("B_PER_PROG") == "1"), rope
    # NF4 dequantization: plain and double-quantized absmax, one block per tile row and (blocksize 4096) a row per tile
    dequant = {(r["constexprs"]["NESTED"], r["constexprs"]["COLS"]) for r in compiled if r["case"] == "dequantize_4bit"}
    assert dequant == {("False", "64"), ("True", "64"), ("True", "2048")}
    # the MoE experts' grouped GEMMs: both activations (Qwen3-MoE's SwiGLU, gpt-oss's clamped form with biases), both
    # weight-gradient passes, on the tensor cores; SwiGLU's twice (bf16 weights, and fp32 master weights cast per tile
    # as training under autocast runs it: its own compile, told apart by its larger shared memory); and LoRA on both
    # expert tensors: the rank GEMMs in gemm1, both gemm2 uses and dgrad, the factors' four weight-gradient passes
    moe = [r for r in compiled if r["case"] == "moe_experts"]
    assert all(r["constexprs"]["F32_DOT"] == "False" for r in moe)
    for kernel in ("_moe_gemm1_kernel", "_moe_dgrad_kernel"):
        acts = sorted((r["constexprs"]["ACT"], r["constexprs"]["LORA"]) for r in moe if r["kernel"] == kernel)
        assert acts == [("0", "False"), ("0", "False"), ("0", "True"), ("1", "False")]
    gemm1_silu = [r["shared"] for r in moe if r["kernel"] == "_moe_gemm1_kernel" and r["constexprs"]["ACT"] == "0"]
    assert len(set(gemm1_silu)) == 3
    gemm2 = {(r["constexprs"]["HAS_SCALE"], r["constexprs"]["LORA"]) for r in moe if r["kernel"] == "_moe_gemm2_kernel"}
    assert gemm2 == {(scale, lora) for scale in ("False", "True") for lora in ("False", "True")}
    modes = {
        tuple(r["constexprs"][c] for c in ("A_MODE", "B_MODE", "B_SCALE"))
        for r in compiled
        if r["kernel"] == "_moe_wgrad_kernel"
    }
    base = {("2", "1", "True"), ("1", "0", "False")}
    lora = {("0", "1", "False"), ("0", "0", "False"), ("2", "0", "True"), ("0", "1", "True")}
    assert modes == base | lora


def test_dequantize_4bit_rounds_products_and_sums_apart(compiled):
    # bit for bit bitsandbytes: the nested absmax is fl(fl(code * scale) + offset), two roundings; an FMA would make it
    # one (the launch passes enable_fp_fusion=False; without it the nested kernels' PTX has one fma.rn.f32)
    dequant = [r for r in compiled if r["case"] == "dequantize_4bit"]
    fmas = [(r["constexprs"], r["ptx_fma_f32"]) for r in dequant]
    assert dequant and all(count == 0 for _, count in fmas), fmas


def test_cross_entropy_forward_fits_two_programs_per_sm(compiled):
    # The default forward launch at V = 128256, measured fastest (kernels/cross_entropy.py): BLOCK 8192 over 16 warps
    # at most 64 registers, so two 512-thread programs share an SM's 64K registers.
    # Softcapped launches (Gemma 2) are not capped at 64 registers: with label smoothing they spilled under the cap.
    fwd = [r for r in compiled if r["kernel"] == "_cross_entropy_fwd_kernel" and r["constexprs"]["SOFTCAP"] == "0.0"]
    assert fwd
    for r in fwd:
        assert (r["constexprs"]["BLOCK"], r["num_warps"]) == ("8192", 16), r
        assert 2 * r["registers"] * r["num_warps"] * 32 <= 65536, f"{r['constexprs']}: {r['registers']} registers"


def test_no_register_spills(compiled):
    spills = [
        f"{r['case']}: {r['kernel']} {r['constexprs']} warps={r['num_warps']}: {r['registers']} registers, "
        f"{r['spill_stores']} B spill stores / {r['spill_loads']} B spill loads"
        for r in compiled
        if r["spill_stores"] or r["spill_loads"]
    ]
    assert not spills, "sm_90 register spills:\n" + "\n".join(spills)


def test_fits_an_sm(compiled):
    # H100: 227 KB of shared memory per block, 255 registers per thread, 64K registers per SM.
    for r in compiled:
        assert r["shared"] <= 227 * 1024, f"{r['kernel']} {r['constexprs']}: {r['shared']} B of shared memory"
        assert r["registers"] * r["num_warps"] * 32 <= 65536, (
            f"{r['kernel']} {r['constexprs']}: {r['registers']} registers"
        )


def _sm90_json(*args: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "bench.sm90", "--json", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    command = " ".join(args)
    assert run.returncode in (0, 1), f"python -m bench.sm90 {command} failed ({run.returncode}):\n{run.stderr[-4000:]}"
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def test_neftune_sass_counts():
    # bench.sm90 --sass disassembles each cubin (Triton's bundled cuobjdump) and counts SASS opcodes. NEFTune's kernel
    # must show what it is: 16-byte global loads and stores, and Philox's 32-bit multiplies (mulhi as IMAD.HI.U32 or the
    # high half of an IMAD.WIDE.U32) for its ten rounds.
    compiled = _sm90_json("--only", "neftune", "--sass")
    assert compiled and all(r["kernel"] == "_neftune_fwd_kernel" for r in compiled)
    for r in compiled:
        sass, where = r["sass"], f"{r['constexprs']}"
        assert r["instructions"] == sum(n for op, n in sass.items() if op != "NOP")
        assert sass.get("LDG.E.128", 0) > 0 and sass.get("STG.E.128", 0) > 0, where
        assert sass.get("IMAD.HI.U32", 0) + sass.get("IMAD.WIDE.U32", 0) >= 16, where
        assert "EXIT" in sass, where
        # The cost model of kernels/neftune.py ("What it costs"): instructions per element, at most 16 with 16-bit
        # uniforms (bf16/fp16: 15.0-15.2 measured, 28.4-29.2 before), 23 with 24-bit ones (fp32: 21.8, 27.9 before);
        # and no shared memory (the old kernel's layout change before each store).
        c = r["constexprs"]
        halves = c["HALVES"] == "True"
        elements = int(c["BLOCK_R"]) * int(c["BLOCK_G"]) * (8 if halves else 4) / (r["num_warps"] * 32)
        assert r["instructions"] / elements <= (16 if halves else 23), f"{where}: {r['instructions']} instructions"
        assert r["shared"] == 0, where
    assert {(r["constexprs"]["HALVES"], r["constexprs"]["WIDE"]) for r in compiled} == {
        ("True", "False"),
        ("False", "False"),
        ("True", "True"),
    }
