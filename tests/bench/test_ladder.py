"""bench.roofline --ladder: the bisection, the linear fit's confirmation, activation offloading in the model against
trainer/model/offload.py's ActivationOffloader, the QLoRA accounting, and the committed results' calibration ratios.
Tiny configs on meta tensors: seconds."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

import kernels
from bench import roofline as rf
from bench.bench_train import model_config
from bench.common import RESULTS
from kernels import FusedAdamW
from trainer.config.args import TrainingArguments
from trainer.loop.optim import build_optimizer
from trainer.model.causal_lm import CausalLM, ModelConfig
from trainer.model.offload import ActivationOffloader


def test_bisection_finds_the_largest_fitting_multiple_of_the_rung():
    def peak(t):
        return 1000 + 3 * t

    budget = 1000 + 3 * 5000
    assert rf.largest_fitting(peak, budget, 0, 256 * 100) == 4864  # 19 * 256 <= 5000 < 20 * 256
    assert rf.largest_fitting(peak, 999, 0, 256) == 0  # nothing fits
    brute = max(t for t in range(0, 256 * 100, 256) if peak(t) <= budget)
    assert rf.largest_fitting(peak, budget, 0, 256 * 100) == brute


def test_context_for_budget_corrects_a_fit_that_is_off_by_traces():
    traced = []

    def peak(t):  # not linear: a fit through two points misses; the traces must decide
        traced.append(t)
        return 1000 + 3 * t + t * t // 10_000

    a, b = rf.linear_fit({4096: peak(4096), 8192: peak(8192)})
    for budget in (50_000, 200_000, 900_000):
        found = rf.context_for_budget(peak, a, b, budget)
        brute = max(t for t in range(0, 1 << 20, rf.LADDER_RUNG) if peak(t) <= budget)
        assert found == brute
    assert rf.linear_fit({1: 5.0, 3: 9.0}) == (3.0, 2.0)


def _tiny_model(checkpointing: bool) -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_hf(model_config("tiny")), use_kernels=False)
    model.set_gradient_checkpointing(checkpointing)
    return model


def test_metered_offloader_offloads_what_the_real_one_does():
    """The same rules (ActivationOffloader's own code): the same bytes sent to the host and left on the device."""
    ids = torch.randint(0, 256, (2, 64))
    for checkpointing in (False, True):
        counts = []
        for cls in (ActivationOffloader, rf.MeteredOffloader):
            model = _tiny_model(checkpointing)
            offloader = cls.for_model(model, "cpu", min_bytes=0)
            with offloader():
                loss = model(input_ids=ids, labels=ids).loss
            counts.append((offloader.offloaded_bytes, offloader.resident_bytes))
            if cls is rf.MeteredOffloader:
                assert offloader.host_peak == offloader.offloaded_bytes > 0
            loss.backward()
            if cls is rf.MeteredOffloader:
                assert offloader.to_device_bytes == offloader.offloaded_bytes  # each byte comes back once
        assert counts[0] == counts[1]


def test_offloading_in_the_trace_frees_the_offloaded_bytes_on_the_device():
    """ours with checkpointing (each block's inputs saved), with and without offloading: the device holds exactly the
    offloaded bytes less after forward, and they are on the host; >= 1 MiB saves only (the CUDA threshold)."""
    config = rf.ladder_config("tiny")
    setting = rf.SETTINGS["1b_full"]
    seq_len = 4096  # a block input (1, 4096, 128) fp32 = 2 MiB: offloaded
    on = rf.ladder_step(setting, rf.LadderStack("ours", checkpointing=True, offloading=True), seq_len, config)
    off = rf.ladder_step(setting, rf.LadderStack("ours", checkpointing=True), seq_len, config)
    assert on["offloaded_bytes"] > 0
    assert off["live_after_forward_bytes"] - on["live_after_forward_bytes"] == on["offloaded_bytes"]
    assert on["host_activation_bytes"] == on["offloaded_bytes"] == on["fetched_bytes"]
    assert on["peak_bytes"] < off["peak_bytes"]
    small = rf.ladder_step(setting, rf.LadderStack("ours", checkpointing=True, offloading=True), 256, config)
    assert small["offloaded_bytes"] == 0  # every save under 1 MiB stays


def test_qlora_stores_base_weights_as_bitsandbytes_quantizes_them():
    config = rf.ladder_config("tiny")
    stack = rf.LadderStack("hf", checkpointing=True)
    lora = rf.ladder_step(rf.SETTINGS["8b_lora"], stack, 256, config)
    qlora = rf.ladder_step(rf.SETTINGS["8b_qlora"], stack, 256, config)
    c = config
    per_layer = [
        (c["hidden_size"], c["hidden_size"]),  # q_proj
        (c["hidden_size"], c["hidden_size"] // 2),  # k_proj (2 of 4 kv heads)
        (c["hidden_size"], c["hidden_size"] // 2),  # v_proj
        (c["hidden_size"], c["hidden_size"]),  # o_proj
        (c["hidden_size"], c["intermediate_size"]),  # gate_proj
        (c["hidden_size"], c["intermediate_size"]),  # up_proj
        (c["intermediate_size"], c["hidden_size"]),  # down_proj
    ]
    saved = c["num_hidden_layers"] * sum(2 * i * o - rf.nf4_bytes(i * o) for i, o in per_layer)
    assert lora["setup_bytes"] - qlora["setup_bytes"] == saved
    layer = rf.NF4Linear(torch.nn.Linear(1000, 300, bias=False, device="meta"))
    assert layer.packed.nbytes == rf.nf4_bytes(300_000) == 155_856


@pytest.mark.parametrize("shape", [(300, 1000), (7, 9), (1024, 4096), (4096, 4096), (14336, 4096)])
def test_nf4_bytes_are_those_of_a_layer_bitsandbytes_quantized(shape):
    """The ladder's QLoRA bytes against a real layer: bitsandbytes' NF4 with double quantisation (our
    trainer.model.quant.Linear4bit), codes and quantisation state counted from its tensors; Llama-3.1-8B's k/v, q/o
    and MLP shapes among them (0.5159 bytes a weight)."""
    pytest.importorskip("bitsandbytes")
    from trainer.model.quant import Linear4bit, quantized_bytes

    linear = torch.nn.Linear(shape[1], shape[0], bias=False, dtype=torch.bfloat16)
    layer = Linear4bit.from_linear(linear, "nf4", None, True, torch.uint8)
    assert rf.nf4_bytes(linear.weight.numel()) == quantized_bytes(layer)


def _state_bytes(optimizer) -> int:
    """Bytes of an optimizer's state that grow with the parameters: without per-tensor constants (step counters,
    bitsandbytes' 256-entry code tables qmap1/qmap2, shared by all of its tensors)."""
    return sum(
        v.nbytes
        for state in optimizer.state.values()
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and k not in ("step", "qmap1", "qmap2")
    )


def _optimizers() -> dict:
    bnb = pytest.importorskip("bitsandbytes")
    return {
        "adamw_fused": FusedAdamW,
        "adamw_fused state_dtype=bfloat16": lambda params: FusedAdamW(params, state_dtype=torch.bfloat16),
        "adamw_bnb_8bit": bnb.optim.AdamW8bit,
    }


def test_adamw_state_bytes_per_parameter_are_the_real_optimizers():
    """ADAMW_STATE_BYTES_PER_PARAM against each real optimizer: all of its state's bytes after one step, as the slope
    between a 4096 x 4096 and a 4096 x 4352 tensor (per-tensor constants cancel); bitsandbytes' 8-bit state is two
    uint8 moments and one fp32 absmax per 256 values each, 2.03125 bytes, and 2.03137 on 4096 x 4096 with its code
    tables."""
    optimizers = _optimizers()
    assert optimizers.keys() == rf.ADAMW_STATE_BYTES_PER_PARAM.keys()
    for name, make in optimizers.items():
        measured = []
        for shape in ((4096, 4096), (4096, 4352)):
            param = torch.nn.Parameter(torch.zeros(shape))
            optimizer = make([param])
            param.grad = torch.randn(shape, generator=torch.Generator().manual_seed(0))
            with kernels.backend("reference"):  # the same state as the kernels', without the interpreter's minutes
                optimizer.step()
            state = optimizer.state[param].values()
            measured.append(sum(v.nbytes for v in {id(v): v for v in state if isinstance(v, torch.Tensor)}.values()))
        assert (measured[1] - measured[0]) / (4096 * 256) == rf.ADAMW_STATE_BYTES_PER_PARAM[name], name
    assert measured[0] / 4096**2 == pytest.approx(2.03137, abs=1e-5)  # the 8-bit state with its two code tables


def test_adamw_state_bytes_of_a_model_are_build_optimizers():
    """adamw_state_bytes (the md's GB columns) against our build_optimizer's optimizer on the tiny model after a step:
    for the 8-bit state, fp32 moments for tensors under 4096 elements and the (tied) embedding, and a whole absmax
    per started block (intermediate 345: 345 x 128 weights end in half a block)."""
    config = rf.ladder_config("tiny") | {"intermediate_size": 345}
    optim_of = {
        "adamw_fused": {"optim": "adamw_fused"},
        "adamw_fused state_dtype=bfloat16": {"optim": "adamw_fused", "optim_args": "state_dtype=bfloat16"},
        "adamw_bnb_8bit": {"optim": "adamw_bnb_8bit"},
    }
    assert optim_of.keys() == rf.ADAMW_STATE_BYTES_PER_PARAM.keys()
    _optimizers()  # bitsandbytes installed, or skip
    for name, arguments in optim_of.items():
        model = CausalLM(ModelConfig.from_hf(config), use_kernels=False)
        optimizer = build_optimizer(model, TrainingArguments(**arguments))
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        with kernels.backend("reference"):
            optimizer.step()
        assert _state_bytes(optimizer) == rf.adamw_state_bytes(config, name), name


def test_cpu_offload_keeps_parameters_and_optimizer_state_off_the_device():
    """FSDP2 CPU offload: the device holds no fp32 parameters or AdamW state (the full fine-tune's 16 B/param), only
    gathered bf16 weights (the root's through the step, one block's at a time) and that block's gradients."""
    config = rf.ladder_config("tiny")
    config["num_hidden_layers"] = 8
    stack = rf.LadderStack("hf", checkpointing=True)
    full = rf.ladder_step(rf.SETTINGS["1b_full"], stack, 4096, config)
    offload = rf.ladder_step(rf.SETTINGS["8b_full_offload"], stack, 4096, config)
    model = CausalLM(ModelConfig.from_hf(config), use_kernels=False)
    n_params = sum(p.numel() for p in model.parameters())
    per_block = sum(p.numel() for p in model.model.layers[0].parameters())
    assert offload["host_state_bytes"] == 16 * n_params
    assert full["setup_bytes"] >= 12 * n_params  # fp32 parameters + two AdamW moments on the device
    root = n_params - len(model.model.layers) * per_block
    assert offload["setup_bytes"] < 2 * root + (1 << 20)  # the root's bf16 weights (+ buffers): no block's
    # at its peak the device holds less than one block's fp32 parameter + gradient + state over the root's
    assert offload["peak_bytes"] < full["peak_bytes"] - 12 * (n_params - root) + 16 * per_block


def test_committed_calibration_ratios_are_the_mds():
    """The 1B calibration rows of the committed ladder.jsonl: modelled / measured against the measured file, and the
    md's table says the same."""
    rows = [json.loads(line) for line in (RESULTS / "ladder.jsonl").read_text().splitlines()]
    calibration = [r for r in rows if r["kind"] == "calibration"]
    measured = {(m["stack"], m["seq_len"]): m["measured_peak_gb"] for m in rf.measured_calibration()}
    assert {(r["stack"], r["seq_len"]) for r in calibration} == set(measured)
    md = (RESULTS / "ladder.md").read_text()
    for r in calibration:
        ratio = r["modelled_peak_gb"] / measured[(r["stack"], r["seq_len"])]
        assert math.isclose(ratio, r["modelled_over_measured"], rel_tol=1e-12)
        row = rf"\| {r['stack']} \| {r['seq_len']:,} \| {measured[(r['stack'], r['seq_len'])]:.2f} \| "
        row += rf"{r['modelled_peak_gb']:.2f} \| {ratio:.3f} \|"
        assert re.search(row, md), row
    assert "modelled" in md.lower()


@pytest.mark.slow  # ~70 s on 2 shared cores: every LoRA stack's measured rung
def test_lora_stacks_fused_keeps_less_than_peft_where_peft_keeps_copies():
    """The LoRA stacks (`python -m bench.roofline --lora_stacks`) at the tiny config: the fused path keeps no more
    than peft's layers in our model, and less wherever peft keeps per-layer copies (dropout's dropped copy and mask;
    fp32 adapters' casts of the input); transformers + peft keeps more than our peft path (it keeps the SwiGLU output
    and its own norms' and RoPE's tensors). Dropout's mask is modelled as CUDA keeps it (a bool)."""
    rows = rf.lora_stack_rows(256, rf.ladder_config("tiny"), env={})
    assert len(rows) == len(rf.LORA_SETTINGS) * len(rf.LORA_STACKS)
    kept = {(r["setting"], r["stack"]): r["activations_gb"] for r in rows}
    for setting in rf.LORA_SETTINGS:
        fused, peft = kept[(setting, "ours_fused")], kept[(setting, "ours_peft")]
        if setting == "bf16 adapters, dropout 0.0":
            assert fused == peft  # x is lora_A's input itself: peft keeps nothing more
        else:
            assert fused < peft, setting
        assert kept[(setting, "hf_peft")] > peft, setting


def test_cuda_dropout_on_meta_keeps_a_bool_mask():
    x = torch.empty(4, 8, device="meta", requires_grad=True)
    kept = []
    with (
        rf.cuda_dropout_on_meta(),
        torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t),
    ):
        torch.nn.functional.dropout(x, 0.1, True)
    assert [t.dtype for t in kept] == [torch.bool]


def test_moe_lora_stacks_keep_the_rank_gemms_not_peft_s_whole_delta(monkeypatch):
    """`python -m bench.roofline --lora_stacks --model qwen3-30b-a3b` at a tiny Qwen3-MoE: LoRA on attention and on
    the experts; ours records the experts through MoEExpertsLoRAFunction's model (the rank GEMMs in the kernels) and
    keeps less than peft's layers in our model (which keep each layer's weight + whole delta for backward), which keep
    less than transformers + peft; with liger-kernel, transformers' experts run liger's fused MoE over peft's
    weight + delta."""
    from bench.roofline import op_models, stacks
    from bench.roofline.cli import _full_config
    from tests.bench.test_roofline import QWEN3_MOE_TINY

    monkeypatch.setitem(stacks.OUR_MODELS, "qwen3-30b-a3b", QWEN3_MOE_TINY)
    modelled, liger = [], []
    forward = op_models.MoEExpertsLoRAModel.forward
    monkeypatch.setattr(
        op_models.MoEExpertsLoRAModel, "forward", lambda self, *a: modelled.append(a[1].shape) or forward(self, *a)
    )
    liger_forward = op_models.LigerFusedMoEModel.forward
    monkeypatch.setattr(
        op_models.LigerFusedMoEModel, "forward", lambda self, *a: liger.append(a[1].shape) or liger_forward(self, *a)
    )
    rows = rf.lora_stack_rows(
        256, _full_config(QWEN3_MOE_TINY), env={}, settings=rf.MOE_LORA_SETTINGS, stacks=rf.MOE_LORA_STACKS
    )
    lora, qlora = rf.MOE_LORA_SETTINGS
    kept = {(r["setting"], r["stack"]): r for r in rows}
    assert {stack for setting, stack in kept if setting == qlora} == {"ours_fused", "hf_peft", "hf_peft_liger"}
    activations = {stack: kept[(lora, stack)]["activations_gb"] for stack in rf.MOE_LORA_STACKS}
    assert activations["ours_fused"] < activations["ours_peft"] < activations["hf_peft"], activations
    # ours' NF4 experts: the 4-bit codes in place of the bf16 tensors (2 x 8 experts' gate_up and down per layer)
    c = QWEN3_MOE_TINY
    values = c["num_hidden_layers"] * c["num_experts"] * 3 * c["hidden_size"] * c["moe_intermediate_size"]
    saved = kept[(lora, "ours_fused")]["peak_gb"] - kept[(qlora, "ours_fused")]["peak_gb"]
    assert saved * 1e9 > 1.2 * values  # 2 bytes a value down to ~0.52, the attention's NF4 on top
    assert kept[(qlora, "hf_peft")]["peak_gb"] > kept[(qlora, "ours_fused")]["peak_gb"]
    assert len(modelled) == 2 * c["num_hidden_layers"]  # ours_fused's MoE layers, once each, in both settings
    assert len(liger) == 2 * c["num_hidden_layers"]  # hf_peft_liger's, through liger's fused MoE


def test_ladder_step_keeps_a_stack_s_patches_through_the_checkpointed_recompute(monkeypatch):
    """Qwen3.5's stacks with flash-linear-attention's recurrence (a patch of the loss call, stacks._with_fla) under
    checkpointing: the recompute in backward runs fla's modelled recurrence again, as the forward did, never the
    PyTorch chunked reference (its triangular solves). Without the patches there ours' recompute records the reference
    and transformers' saves other tensors than its forward did (checkpoint refuses)."""
    from bench.roofline import tracing
    from bench.roofline.cli import _full_config
    from tests.bench.test_roofline import QWEN3_5_TINY

    recorded = []
    add = tracing.Trace.add
    monkeypatch.setattr(
        tracing.Trace, "add", lambda self, name, *a, **k: recorded.append(name) or add(self, name, *a, **k)
    )
    config = _full_config(QWEN3_5_TINY)
    linear = config["layer_types"].count("linear_attention")
    for base in ("ours_fla", "hf_fla"):
        recorded.clear()
        rf.ladder_step(rf.Setting("qwen3.5-9b", "", lora=True), rf.LadderStack(base, checkpointing=True), 512, config)
        assert not any("solve_triangular" in name for name in recorded), base
        assert recorded.count("fla.chunk_gated_delta_rule:fwd_h") == 2 * linear, base  # forward and its recompute
        assert recorded.count("fla.chunk_gated_delta_rule.backward:bwd_dhu") == linear, base


def test_lora_r16_adapts_every_linear_layer_of_the_blocks():
    """The ladder's LoRA on a tiny Qwen3.5, ours and transformers': every linear layer of the blocks gets an adapter,
    the Gated DeltaNet's projections among them, each stored as NF4 under QLoRA; the LM head keeps its bf16 weight."""
    import peft

    from bench.roofline.cli import _full_config
    from bench.roofline.ladder_parts import apply_lora_r16
    from bench.roofline.stacks import build
    from bench.sm90 import fake_cuda
    from tests.bench.test_roofline import QWEN3_5_TINY

    for base in ("ours", "hf"):
        with fake_cuda():
            model = build(base, _full_config(QWEN3_5_TINY)).model
        linear = [n for n, m in model.model.layers.named_modules() if isinstance(m, torch.nn.Linear)]
        assert any(".linear_attn.in_proj_qkv" in n for n in linear), base
        apply_lora_r16(model, nf4=True)
        adapted = {n: m for n, m in model.model.layers.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
        assert sorted(adapted) == sorted(linear), base
        assert all(isinstance(m.base_layer, rf.NF4Linear) for m in adapted.values()), base
        assert isinstance(model.lm_head, torch.nn.Linear), base


def test_model_ladder_writes_its_own_files_with_the_three_kinds_and_no_llama_sections(tmp_path, monkeypatch):
    """`python -m bench.roofline --ladder --model qwen3-30b-a3b` at a tiny Qwen3-MoE and one small GPU: the rows are
    its LoRA, QLoRA and FSDP2 CPU offload settings x MODEL_LADDER_STACKS, every rung traced (no dense MLP to tile), no
    calibration rows, written to ladder_qwen3-30b-a3b.* beside an untouched ladder.jsonl; the md has each setting x
    stack's context, Unsloth's figure beside the fit and a trace at 2,048 tokens and none of the default ladder's
    Llama sections; the chart one panel per setting."""
    from bench import common
    from bench.roofline import ladder_report, stacks
    from bench.roofline.ladder import RESERVE_BYTES
    from tests.bench.test_roofline import QWEN3_MOE_TINY

    monkeypatch.setitem(stacks.OUR_MODELS, "qwen3-30b-a3b", QWEN3_MOE_TINY | {"num_hidden_layers": 1})
    monkeypatch.setattr(ladder_report, "GPUS", {"tiny GPU": (RESERVE_BYTES + 200_000_000, "h100")})
    monkeypatch.setattr(common, "RESULTS", common.RESULTS)  # --out sets it: restored after the test
    panels = []
    save = common.save_figure
    monkeypatch.setattr(common, "save_figure", lambda fig, path: panels.append(len(fig.axes)) or save(fig, path))
    default = tmp_path / "ladder.jsonl"
    default.write_text("the default ladder's rows\n")
    rows = rf.main(["--ladder", "--model", "qwen3-30b-a3b", "--jobs", "1", "--out", str(tmp_path)])
    assert default.read_text() == "the default ladder's rows\n"
    stem = "ladder_qwen3-30b-a3b"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ladder.jsonl"] + [
        f"{stem}.{e}" for e in ("jsonl", "md", "png")
    ]
    assert len((tmp_path / f"{stem}.jsonl").read_text().splitlines()) == len(rows)
    settings = rf.model_ladder_settings("qwen3-30b-a3b")
    kinds = {(s.lora, s.nf4, s.cpu_offload) for s in settings.values()}
    assert kinds == {(True, False, False), (True, True, False), (False, False, True)}  # as SETTINGS' 8B ones
    assert all(s.title.startswith("Qwen3-30B-A3B ") for s in settings.values())
    ladder_rows = [r for r in rows if r["kind"] == "ladder"]
    assert {(r["setting"], r["stack"]) for r in ladder_rows} == {
        (s, k) for s in settings for k in rf.MODEL_LADDER_STACKS
    }
    assert all(r["max_seq_len"] > 0 and r["confirmed_by_trace"] for r in ladder_rows)
    assert {r["kind"] for r in rows} == {"ladder", "offload_cost", "short_context"}
    md = (tmp_path / f"{stem}.md").read_text()
    for r in ladder_rows:
        assert f"| {settings[r['setting']].title} | {r['stack']} | {r['max_seq_len']:,} |" in md
    assert "| Unsloth (published, its notebook's settings): Qwen3-30B-A3B 16-bit LoRA | 63 |" in md
    lora = next(r for r in ladder_rows if r["setting"] == "lora" and r["stack"] == "ours")
    fitted = lora["fit_a_gb"] + lora["fit_b_bytes_per_token"] * 2048 / 1e9
    assert f"| ours (modelled): {settings['lora'].title}, the ladder's fit at 2,048 tokens | {fitted:.1f} |" in md
    short = {r["stack"]: r["peak_gb"] for r in rows if r["kind"] == "short_context"}  # Unsloth's kind: LoRA
    assert short.keys() == set(rf.MODEL_LADDER_STACKS)
    assert f"| ours (modelled): {settings['lora'].title}, a trace at 2,048 tokens | {short['ours']:.1f} |" in md
    for llama_only in ("Llama", "Calibration", "ALST", "Unsloth's published max context"):
        assert llama_only not in md, llama_only
    assert f"({stem}.png)" in md
    assert panels == [len(settings)]


def test_model_ladder_stacks_run_fla_s_recurrence_in_a_hybrid_model():
    """Our models' ladders run MODEL_LADDER_STACKS; Qwen3.5's each with flash-linear-attention's recurrence, and named
    so (a PyTorch chunked recurrence's trace at the ladder's lengths takes minutes)."""
    assert list(rf.model_ladder_stacks("qwen3-30b-a3b")) == list(rf.MODEL_LADDER_STACKS)
    hybrid = rf.model_ladder_stacks("qwen3.5-9b")
    assert list(hybrid) == [f"{name}_fla" for name in rf.MODEL_LADDER_STACKS]
    assert all(stack.base == name for name, stack in hybrid.items())
    assert rf.model_ladder_settings("qwen3.5-9b")["lora"].title.startswith("Qwen3.5-9B LoRA r=16, all linear layers")
