"""The memory ladder (`python -m bench.roofline --ladder`): the largest context whose modelled peak fits each GPU
(GPUS), per setting (SETTINGS) x stack (LADDER_STACKS); `--ladder --model` one of our models' (MODEL_LADDERS:
`model_ladder_settings` x `model_ladder_stacks`). One step at a sequence length (`ladder_step`), the linear
fit, the bisection and its confirmation by traces (`ladder_combo`), the measured H200 ladder's calibration rows;
bench/roofline/ladder_report.py renders the rows. bench/roofline/__init__.py's docstring says how."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import math
import multiprocessing
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.autograd.graph import _engine_run_backward

from bench.roofline import tracing
from bench.roofline.ladder_parts import (
    HostParameters,
    MeteredOffloader,
    apply_lora_r16,
    checkpoint_on_meta,
    cuda_dropout_on_meta,
    hf_through_backward,
)
from bench.roofline.recording import autocast_bf16, modelled_ops, recording
from bench.roofline.stacks import build, clip_grad_norm, labels_for, optimizer_for, patched
from bench.roofline.tracing import BF16, DEVICES, Trace, nbytes
from bench.sm90 import fake_cuda
from trainer.model.causal_lm import HYBRID_TYPES, ModelConfig
from trainer.model.offload import COPY_BYTES_PER_S

GIB = 1 << 30
RESERVE_BYTES = int(1.5 * GIB)  # CUDA context + allocator fragmentation, off every GPU's total
# name -> (total device memory in bytes, the DEVICES entry whose compute the step time is modelled at)
GPUS = {
    "24 GB": (int(23.99 * GIB), "h100"),  # a 24 GB card (RTX 4090 / A10 / L4: 24564 MiB)
    "40 GB": (40 * GIB, "h100"),  # A100 40GB (40960 MiB)
    "80 GB": (int(79.6 * GIB), "h100"),  # H100 80GB (81559 MiB = 79.6 GiB)
    "141 GB": (int(140.4 * GIB), "h200"),  # H200 (143771 MiB)
}
PCIE_BYTES_S = COPY_BYTES_PER_S  # per direction: PCIe Gen5 x16's 64 GB/s derated (trainer/model/offload.py)


# AdamW's state per parameter by --optim, measured (tests/bench/test_ladder.py holds each figure to the real optimizer:
# its state bytes after one step on 4096 x 4096 and 4096 x 4352 tensors, the slope between them, so per-tensor
# constants such as step counters and bitsandbytes' two 256-entry code tables are left out; on 4096 x 4096 the 8-bit
# state with its code tables is 2.03137 bytes per parameter). The ladder's full fine-tunes run the first.
ADAMW_STATE_BYTES_PER_PARAM = {
    "adamw_fused": 8.0,  # two fp32 moments (adamw_torch and adamw_torch_fused: the same)
    "adamw_fused state_dtype=bfloat16": 4.0,  # two bf16 moments (kernels.FusedAdamW(state_dtype=torch.bfloat16))
    "adamw_bnb_8bit": 2.03125,  # two uint8 moments + one fp32 absmax per 256-value block each: 2 x (1 + 4/256)
}
BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes' min_8bit_size: smaller tensors keep fp32 moments
LADDER_RUNG = 256  # the ladder's answers are multiples of this many tokens
LADDER_FIT_SEQ_LENS = (32768, 65536)  # traces the linear fit is drawn through
LADDER_CHECK_SEQ_LEN = 131072  # the third trace: how far the fit is from linear
# A tiled MLP's trace records every tile (hidden_size tokens) of every block three times (forward, the block's
# recompute, the tile's): past this many tokens a trace takes minutes on a CPU, and the answer is the fit's
LADDER_TRACE_MAX_TILED = 131072
LADDER_TARGET_SEQ_LEN = 32768  # where offloading's step-time cost is checked
LLAMA_31_8B = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "eos_token_id": 128001,
    "pad_token_id": 128004,
}


@dataclasses.dataclass(frozen=True)
class Setting:
    model: str
    title: str
    lora: bool = False  # LoRA r=16 on every linear layer of the blocks, bf16 frozen base
    nf4: bool = False  # the frozen base linear weights stored as NF4 (QLoRA)
    cpu_offload: bool = False  # FSDP2 CPU offload of parameters, gradients and optimizer state
    lora_dropout: float = 0.0
    adapter_dtype: torch.dtype | None = None  # None: the base's (bf16), as inject_adapter_in_model leaves them


SETTINGS = {
    "1b_full": Setting("llama-3.2-1b", "Llama-3.2-1B full fine-tune (fp32 master weights + AdamW, bf16 autocast)"),
    "8b_lora": Setting("llama-3.1-8b", "Llama-3.1-8B LoRA r=16, all linear layers (bf16 base)", lora=True),
    "8b_qlora": Setting("llama-3.1-8b", "Llama-3.1-8B QLoRA r=16 (NF4 base, 0.516 B/param)", lora=True, nf4=True),
    "8b_full_offload": Setting("llama-3.1-8b", "Llama-3.1-8B full fine-tune, FSDP2 CPU offload", cpu_offload=True),
}


@dataclasses.dataclass(frozen=True)
class LadderStack:
    base: str  # the `build` stack
    checkpointing: bool
    offloading: bool = False
    tiled_mlp: bool = False
    fused_lora: bool = True  # ours: LoRA layers through kernels.lora (False: peft's layers)


LADDER_STACKS = {
    "hf": LadderStack("hf", checkpointing=True),  # transformers + flash attention (modelled as flash) + checkpointing
    "hf_liger": LadderStack("hf_liger", checkpointing=True),
    "ours": LadderStack("ours", checkpointing=True, offloading=True, tiled_mlp=True),
}
# Our models' own ladders (`--ladder --model`, issues 45 and 46): the name their settings' titles give them
MODEL_LADDERS = {
    "qwen3-30b-a3b": "Qwen3-30B-A3B",
    "gpt-oss-20b": "gpt-oss-20b",
    "qwen3.5-4b": "Qwen3.5-4B",
    "qwen3.5-9b": "Qwen3.5-9B",
}
MODEL_LADDER_STACKS = ("hf", "ours")  # their stacks, LADDER_STACKS' names
# The measured H200 ladder (bench/results/h200/train_memory_seq_len.jsonl): no checkpointing, full fine-tune
CALIBRATION_STACKS = {name: LadderStack(name, checkpointing=False) for name in ("ours", "hf", "hf_liger")}
CALIBRATION_FILE = Path(__file__).parents[1] / "results" / "h200" / "train_memory_seq_len.jsonl"


def ladder_config(model: str) -> dict:
    from bench.bench_train import model_config
    from bench.roofline.cli import _full_config
    from bench.roofline.stacks import OUR_MODELS

    if model in OUR_MODELS:
        config = _full_config(OUR_MODELS[model])
    else:
        config = dict(LLAMA_31_8B) if model == "llama-3.1-8b" else model_config(model)
    config["max_position_embeddings"] = 1 << 23  # RoPE is computed per position; no table of this size is built
    return config


def model_ladder_settings(model: str) -> dict[str, Setting]:
    """The ladder's settings of one of our models (a key of MODEL_LADDERS), the three kinds the 8B has: LoRA r=16
    (bf16 base), QLoRA (NF4 base) and full fine-tune with FSDP2 CPU offload. LoRA as `apply_lora_r16` puts it: every
    linear layer of the blocks and, in a mixture of experts, both expert tensors."""
    name = MODEL_LADDERS[model]
    moe = ModelConfig.from_hf(ladder_config(model)).num_experts is not None
    targets = "attention and the experts" if moe else "all linear layers"
    return {
        "lora": Setting(model, f"{name} LoRA r=16, {targets} (bf16 base)", lora=True),
        "qlora": Setting(model, f"{name} QLoRA r=16, {targets} (NF4 base, 0.516 B/param)", lora=True, nf4=True),
        "full_offload": Setting(model, f"{name} full fine-tune, FSDP2 CPU offload", cpu_offload=True),
    }


def model_ladder_stacks(model: str) -> dict[str, LadderStack]:
    """MODEL_LADDER_STACKS for one of our models; for Qwen3.5's family (HYBRID_TYPES) each with flash-linear-attention's
    recurrence (fla-core installed; modelled by op_models.FlaGatedDeltaRuleModel) and named so (`_fla`): the PyTorch
    chunked recurrence's trace records every 64-token chunk of every Gated DeltaNet layer (about 6 minutes a trace at
    32,768 tokens on 2 CPU cores), out of a ladder's reach."""
    fla = "_fla" if ladder_config(model)["model_type"] in HYBRID_TYPES else ""
    stacks = {name: LADDER_STACKS[name] for name in MODEL_LADDER_STACKS}
    return {name + fla: dataclasses.replace(stack, base=stack.base + fla) for name, stack in stacks.items()}


def ladder_of(model: str | None) -> tuple[dict[str, Setting], dict[str, LadderStack]]:
    """A ladder's settings and stacks: the default ladder's (model None: SETTINGS x LADDER_STACKS) or one of our
    models' (a key of MODEL_LADDERS)."""
    if model is None:
        return SETTINGS, LADDER_STACKS
    return model_ladder_settings(model), model_ladder_stacks(model)


def adamw_state_bytes(config: dict, optim: str) -> int:
    """AdamW's state bytes over every parameter of `config`'s model (a full fine-tune) under `optim`, a key of
    ADAMW_STATE_BYTES_PER_PARAM. bitsandbytes' 8-bit rate applies per tensor as our build_optimizer sets it up (as
    transformers does): to tensors of at least BNB_MIN_8BIT_SIZE elements other than an nn.Embedding's weight, each
    with a whole fp32 absmax per started 256-value block; every other tensor keeps fp32 moments."""
    from trainer.model.causal_lm import CausalLM

    with torch.device("meta"):
        model = CausalLM(ModelConfig.from_hf(config), use_kernels=False)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    rate = ADAMW_STATE_BYTES_PER_PARAM[optim]
    total = 0
    for p in model.parameters():
        n = p.numel()
        if optim != "adamw_bnb_8bit":
            total += int(rate * n)
        elif n < BNB_MIN_8BIT_SIZE or id(p) in embeddings:
            total += 8 * n
        else:
            total += 2 * (n + 4 * math.ceil(n / 256))
    return total


def ladder_step(setting: Setting, stack: LadderStack, seq_len: int, config: dict | None = None) -> dict:
    """One modelled step of `stack` in `setting` at micro batch 1, one sequence of seq_len tokens: the device peak
    (and what is live there), the host bytes, the PCIe bytes and the modelled compute by phase on each of DEVICES."""
    config = config or ladder_config(setting.model)
    # checkpoint's recompute asks torch for its device's module, a cached lookup: make it before fake_cuda, under
    # which the name "cuda" reads as the meta device (which has none)
    torch.get_device_module("cuda")
    trace = Trace()
    with fake_cuda(), modelled_ops(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = build(stack.base, config)
        model = built.model
        if setting.lora or setting.cpu_offload:
            model.to(BF16)  # LoRA's frozen base in bf16; FSDP2's gathered parameters in bf16 (param_dtype)
        if setting.lora:
            apply_lora_r16(model, setting.nf4, setting.lora_dropout, setting.adapter_dtype)
            if not stack.base.startswith("hf"):
                model.fused_lora = stack.fused_lora
        if stack.checkpointing:  # no dropout: the RNG state checkpoint would save is moot (and not on meta)
            if stack.base.startswith("hf"):
                kwargs = {"use_reentrant": False, "preserve_rng_state": False}
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            else:
                model.set_gradient_checkpointing(True, preserve_rng_state=False)
        if stack.tiled_mlp:
            model.tiled_mlp = True
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = None
        if not setting.cpu_offload:  # with CPU offload the optimizer steps on the host
            optimizer = optimizer_for("hf" if stack.base.startswith("hf") else "ours", params)
            tracing._TRACE = Trace()  # the optimizer state's creation: one step outside the trace
            for p in params:
                p.grad = torch.empty_like(p)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tracing._TRACE = None
    # outside fake_cuda, where torch.device("cuda:0") would read as meta
    offloader = MeteredOffloader.for_model(model, "cuda:0") if stack.offloading else None
    trace.phase = "setup"
    state = [v for s in optimizer.state.values() for v in s.values()] if optimizer else []
    for t in [*([] if setting.cpu_offload else model.parameters()), *model.buffers(), *state]:
        trace.track(t)
    if setting.cpu_offload:
        for p in model.parameters():
            trace.elsewhere(p)  # on the host; HostParameters allocates the device copies
    ids = torch.empty((1, seq_len), dtype=torch.int64, device="meta")
    labels = labels_for(1, seq_len, 0.0)
    hf = hf_through_backward(model) if stack.base.startswith("hf") else contextlib.nullcontext()
    with recording(trace), hf, checkpoint_on_meta(), cuda_dropout_on_meta():
        host_params = HostParameters(model, model.model.layers) if setting.cpu_offload else None
        trace.phase = "forward"
        with autocast_bf16(), offloader() if offloader else contextlib.nullcontext():
            loss = built.loss(ids, labels)
        live_after_forward = trace.live
        trace.phase = "backward"
        # checkpoint's recompute re-enters the forward's autocast on a GPU: the emulated autocast's flag stays on
        # through backward (checkpoint_on_meta; autograd's own ops are aten ops, which the emulation leaves alone). The
        # engine is called directly, with every mode of the recording on its stack: Tensor.backward would run it
        # inside fake CUDA's handler alone, torch.autograd.backward inside the emulation's, and the recompute needs
        # both, and the patches the stack's loss call ran under (the recompute calls the patched functions again)
        with autocast_bf16(), patched(built.patches):
            grad = torch.ones_like(loss)
            _engine_run_backward((loss,), (grad,), False, False, (), allow_unreachable=True, accumulate_grad=True)
        del loss
        if optimizer is not None:
            trace.phase = "optimizer"
            clip_grad_norm(params, 1.0)
            optimizer.step()
    if host_params is not None:
        host_params.remove()
    ms = {key: {phase: 0.0 for phase in ("forward", "backward", "optimizer")} for key in DEVICES}
    for op in trace.ops:
        for key, dev in DEVICES.items():
            ms[key][op.phase] += 1e3 * op.seconds(dev)
    n_params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(nbytes(p) for p in model.parameters()) if setting.cpu_offload else 0
    return {
        "seq_len": seq_len,
        "peak_bytes": trace.peak,
        "setup_bytes": trace.phase_peaks.get("setup", 0),  # parameters, buffers, optimizer state on the device
        "live_after_forward_bytes": live_after_forward,
        "peak_at": trace.peak_phase,
        "peak_breakdown_gb": {k: v / 1e9 for k, v in sorted(trace.at_peak.items(), key=lambda kv: -kv[1])[:6]},
        "offloaded_bytes": offloader.offloaded_bytes if offloader else 0,
        "fetched_bytes": offloader.to_device_bytes if offloader else 0,
        "host_activation_bytes": offloader.host_peak if offloader else 0,
        # FSDP2 CPU offload: fp32 parameters, gradients and AdamW's two moments on the host, 16 bytes a parameter
        "host_state_bytes": 16 * n_params if setting.cpu_offload else 0,
        "param_transfer_bytes": param_bytes,  # bf16 weights to the device (forward, then backward) and grads back
        "ms": ms,  # {device: {phase: modelled ms}}
        "step_bytes": sum(op.bytes for op in trace.ops),  # every op's modelled DRAM traffic (the roofline's bytes)
        # MLPs run over token tiles (a tiled MLP where the model has dense MLPs; a mixture of experts has none to tile)
        "mlp_tiled": stack.tiled_mlp and model.tiled_mlp,
    }


def pcie_ms(step: dict, device: str, activations: bool = True) -> tuple[float, float]:
    """(modelled PCIe ms, what it adds to the step) for a ladder step: per direction at PCIE_BYTES_S, each phase's
    copies against that phase's compute (forward: activations to the host, weights to the device; backward:
    activations back one block ahead, weights again, gradients out); what a copy outlasts its phase's compute by is
    added to the step."""
    act_out = step["offloaded_bytes"] if activations else 0
    act_in = step["fetched_bytes"] if activations else 0
    weights = step["param_transfer_bytes"]
    forward_s = max(act_out, weights) / PCIE_BYTES_S
    backward_s = max(act_in + weights, weights) / PCIE_BYTES_S
    ms = step["ms"][device]
    added = max(0.0, 1e3 * forward_s - ms["forward"]) + max(0.0, 1e3 * backward_s - ms["backward"])
    return 1e3 * (forward_s + backward_s), added


def offload_cost_ms(step: dict, device: str) -> float:
    """What activation offloading's copies add to the modelled step (over the same step without them)."""
    return pcie_ms(step, device)[1] - pcie_ms(step, device, activations=False)[1]


def step_ms(step: dict, device: str) -> float:
    """The modelled step: compute (forward, backward, optimizer) plus what PCIe copies add to it."""
    return sum(step["ms"][device].values()) + pcie_ms(step, device)[1]


def largest_fitting(peak_of: Callable[[int], float], budget: float, lo: int, hi: int, rung: int = LADDER_RUNG) -> int:
    """The largest multiple of `rung` T in [lo, hi) with peak_of(T) <= budget, by bisection, for a peak growing with
    T; lo and hi are multiples of rung with peak_of(lo) <= budget < peak_of(hi) (lo = 0: nothing fits)."""
    while hi - lo > rung:
        mid = (lo + hi) // (2 * rung) * rung
        if peak_of(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def linear_fit(points: dict[int, float]) -> tuple[float, float]:
    """(a, b) of peak = a + b * T through two (T, peak) points."""
    (t1, p1), (t2, p2) = sorted(points.items())[:2]
    b = (p2 - p1) / (t2 - t1)
    return p1 - b * t1, b


def fit_context(a: float, b: float, budget: float) -> int:
    """The largest fitting multiple of LADDER_RUNG on the line a + b*T, by bisection."""
    hi = (max(0, int((budget - a) / b)) // LADDER_RUNG + 1) * LADDER_RUNG
    return largest_fitting(lambda t: a + b * t, budget, 0, hi)


def context_for_budget(peak_of: Callable[[int], float], a: float, b: float, budget: float) -> int:
    """The largest fitting T: bisection on the linear fit a + b*T, then the (traced) peak_of at the answer and the next
    rung; where they disagree with the fit, a bracket widened from the answer (doubling) until traces agree, and
    bisection on traces inside it."""
    lo = fit_context(a, b, budget)
    hi = lo + LADDER_RUNG
    while lo and peak_of(lo) > budget:  # the fit was optimistic
        lo, hi = max(0, lo - 2 * (hi - lo)) // LADDER_RUNG * LADDER_RUNG, lo
    while peak_of(hi) <= budget:  # the fit was pessimistic
        lo, hi = hi, hi + 2 * (hi - lo)
    return largest_fitting(peak_of, budget, lo, hi)


def extrapolated_step(steps: dict[int, dict], seq_len: int) -> dict:
    """A ladder step at seq_len from traced ones (where tracing it would take too long): byte counts on the line
    through the two longest traces, modelled ms per phase on the parabola through the three longest (attention's
    FLOPs grow with T^2, the rest with T); what is live at the peak is the longest trace's."""
    ts = sorted(steps)[-3:]
    (t1, s1), (t2, s2) = [(t, steps[t]) for t in ts[-2:]]

    def line(key):
        return s1[key] + (s2[key] - s1[key]) * (seq_len - t1) / (t2 - t1)

    def parabola(ys):
        return sum(
            y * math.prod((seq_len - tj) / (ti - tj) for tj in ts if tj != ti) for ti, y in zip(ts, ys, strict=True)
        )

    out = {k: line(k) for k in s2 if isinstance(s2[k], int) and k != "seq_len"}
    ms = {dev: {ph: parabola([steps[t]["ms"][dev][ph] for t in ts]) for ph in s2["ms"][dev]} for dev in s2["ms"]}
    return out | {"seq_len": seq_len, "ms": ms, "peak_at": s2["peak_at"], "peak_breakdown_gb": s2["peak_breakdown_gb"]}


def ladder(settings: dict[str, Setting], stacks: dict[str, LadderStack], gpus: dict, jobs: int = 1) -> list[dict]:
    """The ladder rows of every setting x stack (`ladder_combo`), `jobs` of them at a time in worker processes."""
    combos = [(*setting, *stack, gpus) for setting in settings.items() for stack in stacks.items()]
    if jobs <= 1:
        return [row for combo in combos for row in ladder_combo(*combo)]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        return [row for rows in pool.map(ladder_combo, *zip(*combos)) for row in rows]


def ladder_combo(setting_name: str, setting: Setting, stack_name: str, stack: LadderStack, gpus: dict) -> list[dict]:
    """One setting x stack: the linear fit through traces at LADDER_FIT_SEQ_LENS, its deviation at
    LADDER_CHECK_SEQ_LEN, then per GPU the largest fitting context (`context_for_budget`: confirmed by traces at it
    and at the next rung; `fit_context` alone where a trace would be too long: a tiled MLP's past
    LADDER_TRACE_MAX_TILED); for a stack that offloads, offloading's cost at LADDER_TARGET_SEQ_LEN."""
    config = ladder_config(setting.model)
    steps: dict[int, dict] = {}

    def step_at(t: int) -> dict:
        if t not in steps:
            steps[t] = ladder_step(setting, stack, t, config)
            print(
                f"  {setting_name} {stack_name} T={t}: modelled peak {steps[t]['peak_bytes'] / GIB:.2f} GiB", flush=True
            )
        return steps[t]

    def peak_of(t: int) -> int:
        return step_at(t)["peak_bytes"] if t else 0

    a, b = linear_fit({t: peak_of(t) for t in LADDER_FIT_SEQ_LENS})
    deviation = peak_of(LADDER_CHECK_SEQ_LEN) / (a + b * LADDER_CHECK_SEQ_LEN) - 1
    traced = dict(steps)  # the fit's traces: what an unconfirmed rung is extrapolated from
    tiled = steps[LADDER_CHECK_SEQ_LEN]["mlp_tiled"]  # its traces grow with T: past LADDER_TRACE_MAX_TILED, fit only
    common_fields = {
        "bench": "ladder",
        "modelled": True,
        "setting": setting_name,
        "model": setting.model,
        "stack": stack_name,
        **dataclasses.asdict(stack),
        "fit_a_gb": a / 1e9,
        "fit_b_bytes_per_token": b,
        "fit_check_seq_len": LADDER_CHECK_SEQ_LEN,
        "fit_check_deviation": deviation,
    }
    rows = []
    for gpu, (total, device) in gpus.items():
        budget = total - RESERVE_BYTES
        found = fit_context(a, b, budget)
        confirmed = not tiled or found + LADDER_RUNG <= LADDER_TRACE_MAX_TILED
        if confirmed:
            found = context_for_budget(peak_of, a, b, budget)
            at, after = (step_at(found) if found else None), step_at(found + LADDER_RUNG)
        else:
            at, after = extrapolated_step(traced, found), None
        host_act = at["host_activation_bytes"] if at else 0
        host_state = at["host_state_bytes"] if at else 0
        row = common_fields | {
            "kind": "ladder",
            "gpu": gpu,
            "gpu_bytes": total,
            "reserve_bytes": RESERVE_BYTES,
            "budget_bytes": budget,
            "modelled_device": DEVICES[device].name,
            "max_seq_len": found,
            "confirmed_by_trace": confirmed,
            "fit_peak_gb": (a + b * found) / 1e9,
            "peak_gb": at["peak_bytes"] / 1e9 if at and confirmed else None,
            "next_rung_peak_gb": after["peak_bytes"] / 1e9 if after else None,
            "peak_at": (at or after)["peak_at"],
            "peak_breakdown_gb": (at or after)["peak_breakdown_gb"],
            "host_activation_gb": host_act / 1e9,
            "host_state_gb": host_state / 1e9,
            "host_total_gb": (host_act + host_state) / 1e9,
            "ms_step": step_ms(at, device) if at else None,
            "pcie_ms": pcie_ms(at, device)[0] if at else None,
            "offload_cost_ms": offload_cost_ms(at, device) if at else None,
            "traces": len(steps),
        }
        rows.append(row)
        print(f"{setting_name} {stack_name} {gpu}: modelled max context {found} (confirmed {confirmed})", flush=True)
    if stack.offloading:
        at = step_at(LADDER_TARGET_SEQ_LEN)
        cost = offload_cost_ms(at, "h100")
        without = step_ms(at, "h100") - cost
        rows.append(
            common_fields
            | {
                "kind": "offload_cost",
                "seq_len": LADDER_TARGET_SEQ_LEN,
                "modelled_device": DEVICES["h100"].name,
                "offloaded_gb": at["offloaded_bytes"] / 1e9,
                "pcie_ms": pcie_ms(at, "h100")[0],
                "ms_step_without_offloading": without,
                "offload_cost_ms": cost,
                "offload_cost_frac": cost / without,
            }
        )
    return rows


def measured_calibration() -> list[dict]:
    """The measured H200 ladder's fitting rungs: {"stack", "seq_len", "measured_peak_gb"} (1e9 bytes,
    torch.cuda.max_memory_allocated)."""
    out = []
    for line in CALIBRATION_FILE.read_text().splitlines():
        row = json.loads(line)
        if row.get("status") == "ok" and row.get("seq_len") and row.get("peak_memory_gb"):
            out.append({"stack": row["impl"], "seq_len": row["seq_len"], "measured_peak_gb": row["peak_memory_gb"]})
    return out


def calibration_rows() -> list[dict]:
    """Modelled peaks of the 1B full fine-tune without checkpointing at the measured rungs, and their ratio."""
    config = ladder_config("llama-3.2-1b")
    rows = []
    for m in measured_calibration():
        step = ladder_step(SETTINGS["1b_full"], CALIBRATION_STACKS[m["stack"]], m["seq_len"], config)
        modelled = step["peak_bytes"] / 1e9
        rows.append(
            {
                "bench": "ladder",
                "modelled": True,
                "kind": "calibration",
                "setting": "1b_full",
                "stack": m["stack"],
                "checkpointing": False,
                "seq_len": m["seq_len"],
                "modelled_peak_gb": modelled,
                "measured_peak_gb": m["measured_peak_gb"],
                "modelled_over_measured": modelled / m["measured_peak_gb"],
                "peak_breakdown_gb": step["peak_breakdown_gb"],
            }
        )
        measured = m["measured_peak_gb"]
        print(f"calibration {m['stack']} T={m['seq_len']}: modelled {modelled:.2f} GB, measured {measured:.2f}")
    return rows
