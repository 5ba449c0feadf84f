"""bench/step_profile.py: kernel names to the roofline's categories, the step's busy and idle device time, and
bench_train's --profile end to end on the tiny model (a CPU smoke run: no device events there)."""

import gzip
import json

import pytest

from bench import bench_train, step_profile


@pytest.mark.parametrize(
    "kernel, category",
    [
        # ours (Triton, kernels/) and the CUDA AdamW op
        ("_rms_norm_fwd_kernel", "norms"),
        ("_rms_norm_bwd_rowdot_kernel", "norms"),
        ("_rope_kernel", "rope"),
        ("_swiglu_bwd_kernel", "mlp_activation"),
        ("_cross_entropy_fwd_kernel", "loss"),
        ("_flce_slice_grad_kernel", "loss"),
        ("_adamw_kernel", "optimizer"),
        ("void adamw_kernel<__nv_bfloat16>(AdamWMeta, Hyper)", "optimizer"),
        # liger-kernel 0.8.5
        ("_rms_norm_forward_kernel", "norms"),
        ("_triton_rope", "rope"),
        ("_swiglu_forward_kernel", "mlp_activation"),
        ("liger_cross_entropy_kernel", "loss"),
        ("element_mul_kernel", "loss"),
        # PyTorch: cuBLAS / cuBLASLt, SDPA, eager loss, foreach clipping and AdamW, copies, elementwise
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT", "matmuls"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmuls"),
        ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>", "matmuls"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention"),
        (
            "void fmha_cutlassB_bf16_aligned_64x64_k128_sm80(PyTorchMemEffAttention::AttentionBackwardKernel)",
            "attention",
        ),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "loss"),
        ("void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d", "loss"),
        ("void at::native::multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamMathFunctor>", "optimizer"),
        ("void at::native::lpnorm_cleanup<float, NormType::L2>", "optimizer"),  # clipping's norm
        ("Memcpy HtoD (Pinned -> Device)", "copies"),
        ("Memset (Device)", "copies"),
        ("void at::native::vectorized_elementwise_kernel<4, AddFunctor<float>>", "other_elementwise"),
    ],
)
def test_kernel_names_fall_in_the_roofline_categories(kernel, category):
    assert step_profile.categorize(kernel) == category


def test_busy_is_the_union_inside_the_step_and_idle_the_rest():
    events = [
        ("nvjet_gemm", 10.0, 40.0),  # a matmul
        ("Memcpy DtoH", 30.0, 50.0),  # overlaps it on another stream: counted once in busy
        ("_rope_kernel", 60.0, 70.0),
        ("_adamw_kernel", 95.0, 130.0),  # runs past the step's end: cut at 100
        ("_rms_norm_fwd_kernel", -20.0, -5.0),  # before the step: left out
    ]
    s = step_profile.summarize((0.0, 100.0), events)
    assert s["step_ms"] == pytest.approx(0.1)
    assert s["device_busy_ms"] == pytest.approx((40 + 10 + 5) / 1e3)  # [10, 50] + [60, 70] + [95, 100]
    assert s["device_idle_ms"] == pytest.approx((100 - 55) / 1e3)
    assert s["kernels_ms"]["matmuls"] == pytest.approx(0.03)
    assert s["kernels_ms"]["copies"] == pytest.approx(0.02)
    assert s["kernels_ms"]["optimizer"] == pytest.approx(0.005)
    assert s["kernels_ms"]["norms"] == 0 and s["kernel_counts"]["norms"] == 0
    assert s["device_events"] == 4 and s["top_kernels"][0]["name"] == "nvjet_gemm"
    assert set(s["kernels_ms"]) == set(step_profile.CATEGORIES)


@pytest.mark.slow  # minutes on a 2-core CPU
def test_the_last_step_is_profiled_and_left_out_of_the_timing(tmp_path):
    argv = ["--quick", "--configs", "ours,ours_ckpt,hf", "--steps", "4", "--warmup-steps", "2"]
    rows = bench_train.main([*argv, "--repeats", "1", "--profile", "--out", str(tmp_path)])
    by_impl = {r["impl"]: r for r in rows}
    assert set(by_impl) == {"ours", "ours_ckpt", "hf"}
    for impl, r in by_impl.items():
        assert r["status"] == "ok" and r["timed_steps"] == 1  # steps 3 of 4: step 4 was profiled
        p = r["profile"]
        assert p["step_ms"] > 0 and p["device_busy_ms"] + p["device_idle_ms"] == pytest.approx(p["step_ms"])
        trace = json.loads(gzip.decompress((tmp_path / f"profile_{impl}.json.gz").read_bytes()))
        assert any(e.get("name") == step_profile.RANGE for e in trace["traceEvents"])
    md = (tmp_path / "train_profile.md").read_text()
    assert "| ms in the profiled step | ours | ours_ckpt | hf |" in md and "device_idle_ms" in md


def test_profile_refuses_what_it_cannot_profile():
    with pytest.raises(SystemExit):
        bench_train.parse_args(["--quick", "--configs", "ours_dpo", "--profile"])
    with pytest.raises(SystemExit):
        bench_train.parse_args(["--quick", "--steps", "3", "--warmup-steps", "2", "--profile"])


def test_annotations_on_the_device_timeline_are_not_device_work(tmp_path):
    """torch.profiler mirrors user annotations onto the device timeline (cat gpu_user_annotation: the train_step range
    and an optimizer's Optimizer.step#...); they span kernels and must not count as kernels (the H200 trace of
    2026-11-28 had a 262 ms train_step among its 'kernels'). The host's train_step range is the step."""
    trace = {
        "traceEvents": [
            {"cat": "user_annotation", "name": "train_step", "ts": 0.0, "dur": 100.0},
            {"cat": "gpu_user_annotation", "name": "train_step", "ts": 5.0, "dur": 90.0},
            {"cat": "gpu_user_annotation", "name": "Optimizer.step#FusedAdamW.step", "ts": 60.0, "dur": 30.0},
            {"cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": 4.0},
            {"cat": "kernel", "name": "nvjet_sm90_tst_128x256", "ts": 10.0, "dur": 20.0},
            {"cat": "gpu_memset", "name": "Memset (Device)", "ts": 40.0, "dur": 1.0},
            {"cat": "kernel", "name": "_adamw_kernel", "ts": 70.0, "dur": 10.0},
        ]
    }
    path = tmp_path / "profile_ours.json.gz"
    path.write_bytes(gzip.compress(json.dumps(trace).encode()))
    step, device = step_profile.events_of(step_profile.read_trace(path))
    assert step == (0.0, 100.0) and [name for name, *_ in device] == [
        "nvjet_sm90_tst_128x256",
        "Memset (Device)",
        "_adamw_kernel",
    ]
    s = step_profile.summarize(step, device)
    assert s["device_busy_ms"] == pytest.approx(0.031) and s["device_idle_ms"] == pytest.approx(0.069)

    rows = tmp_path / "train.jsonl"
    row = {"impl": "ours", "status": "ok", "step_ms": 0.09, "device": "X", "git_sha": "a", "date": "d", "command": "c"}
    rows.write_text(json.dumps(row) + "\n")
    out = tmp_path / "profile.md"
    assert step_profile.main([str(path), "--rows", str(rows), "--out", str(out)]) == 0
    text = out.read_text()
    assert "| matmuls | 0.02 (1) |" in text and "| device_idle_ms | 0.07 |" in text
