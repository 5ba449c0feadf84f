"""The Mixture-of-Experts experts op (kernels/moe.py): the reference against transformers' own expert modules
(Qwen3-MoE's and Mixtral's concatenated (E, 2I, H) layout with SwiGLU, gpt-oss's transposed, interleaved, biased
layout with its clamped SwiGLU), values and gradients of every input, the router weights included; then the Triton
grouped GEMMs (through the interpreter) and the `torch._grouped_mm` path against the reference.

Tolerance model (tests/tolerance.py):
- fp32: against the reference run in fp64, every output and gradient within 2e-5 of its |ref|max (sums of at most
  2I = 48 products per GEMM step, and up to a few dozen rows in the weight gradients).
- bf16/fp16: our error against the fp32 reference <= 2x the reference's own error run in that dtype (transformers'
  eager loop), + 1 ulp of |ref|max (the interpreter truncates fp32 -> bf16 stores).
Shapes: T 17-23 tokens, H 40, I 24 (not powers of 2), E 5 (10 for k = 8), one expert without tokens, uneven loads.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

import kernels
from kernels import moe
from kernels.moe import moe_experts, moe_experts_grouped_mm, moe_experts_ref, moe_route
from tests.tolerance import PoisonedTorch, assert_lowp_close

T, H, INTER, E = 23, 16, 12, 6


def _routing(k, g, num_experts=E, tokens=T, skip_expert=None):
    """Each token's k distinct experts (uneven loads; `skip_expert` gets none) and its router weights."""
    logits = torch.randn(tokens, num_experts, generator=g)
    if skip_expert is not None:
        logits[:, skip_expert] = -1e9
    index = logits.topk(k, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)
    return index, weights


def _hf_experts(kind):
    if kind == "qwen3_moe":
        config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=E, hidden_act="silu")
        module = Qwen3MoeExperts(config)
    else:
        config = GptOssConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E)
        module = GptOssExperts(config)
    config._experts_implementation = "eager"
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (3.0 if kind == "gpt_oss" else 0.3))  # reach the clamps
    return module


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_reference_equals_transformers_experts(kind, k):
    g = torch.Generator().manual_seed(k)
    module = _hf_experts(kind)
    x = torch.randn(T, H, generator=g, requires_grad=True)
    index, weights = _routing(k, g, skip_expert=E - 1)
    weights.requires_grad_()
    dy = torch.randn(T, H, generator=g)
    gpt = kind == "gpt_oss"
    kwargs = dict(transposed=True, interleaved=True, act="gpt_oss") if gpt else {}
    biases = (module.gate_up_proj_bias, module.down_proj_bias) if gpt else (None, None)
    ours = moe_experts_ref(x, index, weights, module.gate_up_proj, module.down_proj, *biases, **kwargs)
    inputs = [x, weights, *module.parameters()]
    grads = torch.autograd.grad(ours, inputs, dy)
    theirs = module(x, index, weights)
    expected = torch.autograd.grad(theirs, inputs, dy)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6 * theirs.abs().max().item())
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * want.abs().max().item())
    if gpt:  # the clamps were reached, so their zero gradients were compared
        gate_up = torch.einsum("th,ehi->tei", x.detach(), module.gate_up_proj.detach())
        assert (gate_up[..., ::2] > 7).any() and (gate_up[..., 1::2].abs() > 7).any()


def test_bad_arguments_are_one_line_errors():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H)
    index, weights = _routing(2, g)
    w1, w2 = torch.randn(E, 2 * INTER, H), torch.randn(E, H, INTER)
    with pytest.raises(ValueError, match="act='gelu' is not one of silu, gpt_oss"):
        moe_experts_ref(x, index, weights, w1, w2, act="gelu")
    with pytest.raises(ValueError, match="do not fit hidden size"):
        moe_experts_ref(x, index, weights, w1, w2.transpose(1, 2))
    with pytest.raises(ValueError, match="tokens but top_k_index has"):
        moe_experts_ref(x[:-1], index, weights, w1, w2)


# ---- the Triton grouped GEMMs (interpreter) and torch._grouped_mm against the reference -------------------------

HID, INT = 40, 24  # not powers of 2
QWEN = dict(transposed=False, interleaved=False, act="silu")
GPT_OSS = dict(transposed=True, interleaved=True, act="gpt_oss")


def _experts(cfg, num_experts, dtype=torch.float32, bias=False, seed=0):
    """gate_up_proj, down_proj and the biases (or None) in cfg's layout. gpt-oss's scale reaches both clamps."""
    g = torch.Generator().manual_seed(seed)
    scale = 1.0 if cfg["act"] == "gpt_oss" else 0.3
    w1_shape = (num_experts, HID, 2 * INT) if cfg["transposed"] else (num_experts, 2 * INT, HID)
    w2_shape = (num_experts, INT, HID) if cfg["transposed"] else (num_experts, HID, INT)
    params = [torch.randn(w1_shape, generator=g) * scale, torch.randn(w2_shape, generator=g) * 0.3]
    if bias:
        params += [torch.randn(num_experts, 2 * INT, generator=g), torch.randn(num_experts, HID, generator=g) * 0.3]
    else:
        params += [None, None]
    return [None if p is None else p.to(dtype) for p in params]


def _case(cfg, k, dtype=torch.float32, bias=False, tokens=T, seed=0):
    num_experts = 10 if k > E - 1 else 5
    g = torch.Generator().manual_seed(100 + seed)
    index, weights = _routing(k, g, num_experts=num_experts, tokens=tokens, skip_expert=num_experts // 2)
    x = torch.randn(tokens, HID, generator=g)
    dy = torch.randn(tokens, HID, generator=g)
    return [x, weights, *_experts(cfg, num_experts, bias=bias, seed=seed)], index, dy, dtype


def _run(fn, inputs, index, dy, cfg, dtype):
    """(out, grads of every input that is not None) of fn on fresh leaves of `inputs` cast to dtype."""
    leaves = [None if t is None else t.to(dtype).requires_grad_() for t in inputs]
    x, weights, w1, w2, b1, b2 = leaves
    out = fn(x, index, weights, w1, w2, b1, b2, **cfg)
    given = [t for t in leaves if t is not None]
    return [out.detach(), *torch.autograd.grad(out, given, dy.to(dtype))]


NAMES = ("out", "dx", "dtop_k_weights", "dgate_up_proj", "ddown_proj", "dgate_up_bias", "ddown_bias")


def _triton(*args, **kwargs):
    with kernels.backend("triton"):
        return moe_experts(*args, **kwargs)


def _assert_fp32_close(ours, ref, what):
    for name, o, r in zip(NAMES, ours, ref):
        assert o.dtype == torch.float32 and o.shape == r.shape, f"{what} {name}"
        tol = 2e-5 * r.abs().max().item()
        torch.testing.assert_close(o.double(), r, atol=tol, rtol=0, msg=f"{what} {name}")


@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_triton_fp32_equals_the_reference(kind, k, monkeypatch):
    # every output buffer the launchers allocate starts as NaN: each element must be written
    monkeypatch.setattr(moe, "torch", PoisonedTorch())
    cfg, bias = (GPT_OSS, True) if kind == "gpt_oss" else (QWEN, False)
    inputs, index, dy, _ = _case(cfg, k, bias=bias, seed=k)
    ours = _run(_triton, inputs, index, dy, cfg, torch.float32)
    ref = _run(moe_experts_ref, inputs, index, dy, cfg, torch.float64)
    _assert_fp32_close(ours, ref, f"{kind} k={k}")
    if kind == "gpt_oss":  # both clamps were reached, so their zero gradients were compared
        x, w1 = inputs[0], inputs[2]
        gate_up = torch.einsum("th,ehc->tec", x, w1) + inputs[4][None]
        assert (gate_up[..., ::2] > 7).any() and (gate_up[..., 1::2].abs() > 7).any()


@pytest.mark.parametrize(
    "cfg, bias",
    [
        (dict(transposed=True, interleaved=False, act="silu"), False),
        (dict(transposed=False, interleaved=True, act="gpt_oss"), True),
    ],
)
def test_triton_fp32_other_layouts(cfg, bias):
    inputs, index, dy, _ = _case(cfg, 2, bias=bias, seed=3)
    ours = _run(_triton, inputs, index, dy, cfg, torch.float32)
    ref = _run(moe_experts_ref, inputs, index, dy, cfg, torch.float64)
    _assert_fp32_close(ours, ref, str(cfg))


def test_triton_small_tiles_multi_block_paths(monkeypatch):
    # 8-row tiles (several per expert, ragged), 16-wide column blocks (I 24 and H 40 ragged, the down bias read by
    # column block 0 only, the dtop_k_weights partials of two blocks summed), 16-row steps in the weight gradients
    monkeypatch.setattr(moe, "CPU_TILES", moe.SMALL_TILES)
    inputs, index, dy, _ = _case(GPT_OSS, 2, bias=True, tokens=17, seed=4)
    ours = _run(_triton, inputs, index, dy, GPT_OSS, torch.float32)
    ref = _run(moe_experts_ref, inputs, index, dy, GPT_OSS, torch.float64)
    _assert_fp32_close(ours, ref, "small tiles")


def _limit_away_from(inputs, index):
    """A clamp limit in [5, 10] as far as possible from every pre-activation (gpt-oss layout). The gradient jumps
    at the clamps, so an element that low precision rounds across a clamp differs from the fp32 reference by O(1):
    no tolerance judges that; the fp32 tests cover the clamps' masks."""
    x, _, w1, _, b1, _ = inputs
    gate_up = torch.einsum("th,ehc->tec", x.double(), w1.double()) + b1.double()[None]
    gate_up = gate_up[torch.arange(len(x))[:, None], index]  # (T, k, 2I): the routed experts only
    gate, up = gate_up[..., ::2].flatten(), gate_up[..., 1::2].flatten()
    candidates = torch.linspace(5, 10, 1001, dtype=torch.float64)
    gap = torch.minimum(
        (gate[None] - candidates[:, None]).abs().min(1).values,
        (up.abs()[None] - candidates[:, None]).abs().min(1).values,
    )
    assert gap.max() > 0.04, "no clamp limit keeps 0.04 (a bf16 ulp at 8 is 0.03) from the pre-activations"
    return candidates[gap.argmax()].item()


@pytest.mark.parametrize(
    "kind, dtype", [("qwen3_moe", torch.bfloat16), ("gpt_oss", torch.bfloat16), ("gpt_oss", torch.float16)]
)
def test_triton_low_precision(kind, dtype):
    cfg, bias = (GPT_OSS, True) if kind == "gpt_oss" else (QWEN, False)
    k = 8 if kind == "qwen3_moe" else 2
    inputs, index, dy, _ = _case(cfg, k, bias=bias, tokens=12 if kind == "gpt_oss" else T, seed=5)  # gaps at the clamps
    inputs = [None if t is None else t.to(dtype).float() for t in inputs]  # the same values in both runs
    if kind == "gpt_oss":  # the clamps' gradient jumps: no pre-activation within a bf16 rounding of +-limit
        cfg = dict(cfg, limit=_limit_away_from(inputs, index))
    ours = _run(_triton, inputs, index, dy, cfg, dtype)
    ref = _run(moe_experts_ref, inputs, index, dy, cfg, torch.float32)
    eager = _run(moe_experts_ref, inputs, index, dy, cfg, dtype)
    for name, o, r, e in zip(NAMES, ours, ref, eager):
        assert o.dtype == dtype, name
        assert_lowp_close(o, r, e, dtype, name=name, extra_ulps=1)


@pytest.mark.parametrize("k", [1, 2, 8])
def test_routing_tiles_cover_each_experts_rows_once(k):
    num_experts, block_m = 10, 4
    g = torch.Generator().manual_seed(k)
    index, _ = _routing(k, g, num_experts=num_experts, tokens=T, skip_expert=3)
    route = moe_route(index, num_experts, block_m)
    flat = index.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts)
    assert counts[3] == 0
    assert route.offsets.tolist() == [0, *torch.cumsum(counts, 0).tolist()]
    assert torch.equal(flat[route.assign.long()], torch.sort(flat, stable=True).values)
    assert torch.equal(route.token.long(), route.assign.long() // k)
    covered = torch.zeros(flat.numel(), dtype=torch.int64)
    for e, start, end in route.tiles.t().tolist():
        assert end - start <= block_m
        if end > start:  # a tile lies inside one expert's rows
            assert route.offsets[e] <= start and end <= route.offsets[e + 1]
            covered[start:end] += 1
    assert covered.eq(1).all()


def test_moe_block_gradients_through_the_router_equal_the_reference():
    # A whole MoE block: router logits -> softmax -> top-k -> renormalised weights -> experts. The router's
    # weight and x get their gradients through top_k_weights (and x through both paths).
    g = torch.Generator().manual_seed(7)
    k, num_experts = 2, 5
    x0 = torch.randn(T, HID, generator=g)
    router0 = torch.randn(num_experts, HID, generator=g) * 0.3
    w1, w2, _, _ = _experts(QWEN, num_experts, seed=7)
    dy = torch.randn(T, HID, generator=g)

    def block(fn, dtype):
        x, router, gu, dn = (t.to(dtype).requires_grad_() for t in (x0, router0, w1, w2))
        probs = torch.softmax(x @ router.t(), dim=-1)
        weights, index = probs.topk(k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = fn(x, index, weights, gu, dn)
        return [out.detach(), *torch.autograd.grad(out, [x, router, gu, dn], dy.to(dtype))]

    ours, ref = block(_triton, torch.float32), block(moe_experts_ref, torch.float64)
    for name, o, r in zip(("out", "dx", "drouter", "dgate_up_proj", "ddown_proj"), ours, ref):
        torch.testing.assert_close(o.double(), r, atol=2e-5 * r.abs().max().item(), rtol=0, msg=name)


def test_triton_is_deterministic():
    inputs, index, dy, _ = _case(QWEN, 2, seed=8)
    first = _run(_triton, inputs, index, dy, QWEN, torch.float32)
    second = _run(_triton, inputs, index, dy, QWEN, torch.float32)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), name


def _bf16_tokens_fp32_weights(kind, device, tokens):
    """What training under bf16 autocast runs (our model's experts: bf16 tokens and router weights, the fp32 master
    weights cast per tile in the kernels, fp32 weight gradients): within twice PyTorch's own bf16 error of the fp64
    reference (its bf16 run with bf16 weights), every output and gradient."""
    cfg, bias = (GPT_OSS, True) if kind == "gpt_oss" else (QWEN, False)
    g = torch.Generator().manual_seed(11)
    num_experts, k = 8, 2
    index, weights = _routing(k, g, num_experts=num_experts, tokens=tokens)
    x, dy = torch.randn(tokens, HID, generator=g), torch.randn(tokens, HID, generator=g)
    params = _experts(cfg, num_experts, bias=bias, seed=3)
    inputs = [x.bfloat16().float(), weights.bfloat16().float(), *params]  # the values both runs see
    if kind == "gpt_oss":
        cfg = dict(cfg, limit=_limit_away_from(inputs, index))

    def run(dtypes, fn):
        leaves = [None if t is None else t.to(device, dt).requires_grad_() for t, dt in zip(inputs, dtypes)]
        out = fn(leaves[0], index.to(device), *leaves[1:], **cfg)
        given = [t for t in leaves if t is not None]
        return [out.detach(), *torch.autograd.grad(out, given, dy.to(device, out.dtype))]

    bf16, f32, f64 = torch.bfloat16, torch.float32, torch.float64
    ours = run([bf16, bf16, f32, f32, f32, f32], _triton)
    ref = run([f64] * 6, moe_experts_ref)
    eager = run([bf16] * 6, moe_experts_ref)
    for name, o, r, e in zip(NAMES, ours, ref, eager):
        assert o.dtype == (bf16 if name in ("out", "dx", "dtop_k_weights") else f32), name
        assert_lowp_close(o.float().cpu(), r.cpu(), e.float().cpu(), bf16, name=name, extra_ulps=1)


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_triton_bf16_tokens_with_fp32_master_weights(kind):
    _bf16_tokens_fp32_weights(kind, "cpu", tokens=12)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_on_the_gpu_bf16_tokens_with_fp32_master_weights(kind):
    _bf16_tokens_fp32_weights(kind, "cuda", tokens=48)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
@pytest.mark.parametrize(
    "kind, dtype", [("qwen3_moe", torch.float32), ("gpt_oss", torch.float32), ("gpt_oss", torch.bfloat16)]
)
def test_grouped_mm_path_equals_the_reference(kind, dtype):
    # torch 2.13 runs torch._grouped_mm forward and backward on CPU (fp32, bf16) for 16-byte aligned rows
    cfg, bias = (GPT_OSS, True) if kind == "gpt_oss" else (QWEN, False)
    inputs, index, dy, _ = _case(cfg, 2, bias=bias, seed=9)
    inputs = [None if t is None else t.to(dtype).float() for t in inputs]
    ours = _run(moe_experts_grouped_mm, inputs, index, dy, cfg, dtype)
    ref = _run(moe_experts_ref, inputs, index, dy, cfg, torch.float64 if dtype == torch.float32 else torch.float32)
    if dtype == torch.float32:
        _assert_fp32_close(ours, ref, kind)
        return
    eager = _run(moe_experts_ref, inputs, index, dy, cfg, dtype)
    for name, o, r, e in zip(NAMES, ours, ref, eager):
        assert_lowp_close(o, r, e, dtype, name=name, extra_ulps=1)


def test_grouped_mm_refuses_unaligned_rows():
    g = torch.Generator().manual_seed(0)
    index, weights = _routing(2, g)
    x, w1, w2 = torch.randn(T, H).bfloat16(), torch.randn(E, 2 * INTER, H).bfloat16(), torch.randn(E, H, INTER)
    with pytest.raises(ValueError, match="16-byte aligned"):
        moe_experts_grouped_mm(x, index, weights.bfloat16(), w1, w2.bfloat16())


# ---- LoRA on the experts (peft's target_parameters) as grouped GEMMs of rank r: never the (E, out, in) delta ------


def _lora_factors(cfg, num_experts, rank, which=("gate_up", "down"), seed=0):
    """peft's lora_A (r E, in) and lora_B (out, r E) of gate_up and/or down (None where not adapted), B not zero."""
    g = torch.Generator().manual_seed(50 + seed)
    fans = {"gate_up": (HID, 2 * INT), "down": (INT, HID)}
    out = []
    for name in ("gate_up", "down"):
        fan_in, fan_out = fans[name]
        if name in which:
            out += [torch.randn(rank * num_experts, fan_in, generator=g) / fan_in**0.5]
            out += [torch.randn(fan_out, rank * num_experts, generator=g) * 0.5]
        else:
            out += [None, None]
    return out


def _run_lora(fn, inputs, factors, index, dy, cfg, dtypes, scalings=(2.0, 0.5)):
    """(out, grads of every given input and LoRA factor) of fn with ExpertLoRA built from fresh leaves."""
    leaves = [None if t is None else t.to(dt).requires_grad_() for t, dt in zip(inputs + factors, dtypes)]
    x, weights, w1, w2, b1, b2, a1, bb1, a2, bb2 = leaves
    loras = [
        None if a is None else moe.ExpertLoRA(a, b, s) for a, b, s in ((a1, bb1, scalings[0]), (a2, bb2, scalings[1]))
    ]
    out = fn(x, index, weights, w1, w2, b1, b2, **cfg, gate_up_lora=loras[0], down_lora=loras[1])
    if fn is _triton:
        assert type(out.grad_fn).__name__ == "MoEExpertsLoRAFunctionBackward"
    given = [t for t in leaves if t is not None]
    return [out.detach(), *torch.autograd.grad(out, given, dy.to(out.dtype))]


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_lora_reference_equals_peft_on_transformers_experts(kind):
    """peft's ParamWrapper (target_parameters) over transformers' experts forms the delta each forward; our
    reference adds x A_e^T B_e^T per expert: the same outputs and gradients of x, the router weights and both
    factors of both tensors."""
    peft = pytest.importorskip("peft")
    module = _hf_experts(kind)
    for p in module.parameters():
        p.requires_grad_(False)
    config = peft.LoraConfig(
        r=3, lora_alpha=6, target_parameters=["gate_up_proj", "down_proj"], init_lora_weights=False
    )
    holder = torch.nn.Module()  # peft adapts parameters of submodules only
    holder.experts = module
    peft.inject_adapter_in_model(config, holder)
    g = torch.Generator().manual_seed(3)
    wrappers = {w.parameter_name: w for w in holder.modules() if hasattr(w, "parameter_name")}
    with torch.no_grad():
        for w in wrappers.values():
            for lin in (w.lora_A["default"], w.lora_B["default"]):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.3)
    base = wrappers["gate_up_proj"].get_base_layer()
    x = torch.randn(T, H, generator=g, requires_grad=True)
    index, weights = _routing(2, g, skip_expert=E - 1)
    weights.requires_grad_()
    dy = torch.randn(T, H, generator=g)
    factors = [
        getattr(wrappers[n], f)["default"].weight for n in ("gate_up_proj", "down_proj") for f in ("lora_A", "lora_B")
    ]
    gpt = kind == "gpt_oss"
    kwargs = dict(transposed=True, interleaved=True, act="gpt_oss") if gpt else {}
    biases = (base.gate_up_proj_bias, base.down_proj_bias) if gpt else (None, None)
    loras = [moe.ExpertLoRA(a, b, 2.0) for a, b in (factors[:2], factors[2:])]
    ours = moe_experts_ref(
        x,
        index,
        weights,
        base.gate_up_proj,
        base.down_proj,
        *biases,
        **kwargs,
        gate_up_lora=loras[0],
        down_lora=loras[1],
    )
    grads = torch.autograd.grad(ours, [x, weights, *factors], dy)
    theirs = holder.experts(x, index, weights)
    expected = torch.autograd.grad(theirs, [x, weights, *factors], dy)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-6 * theirs.abs().max().item())
    for name, got, want in zip(("dx", "dw", "dA1", "dB1", "dA2", "dB2"), grads, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6 * want.abs().max().item(), msg=name)


@pytest.mark.parametrize(
    "kind, k, rank, which",
    [
        ("qwen3_moe", 2, 4, ("gate_up", "down")),
        ("qwen3_moe", 8, 20, ("gate_up", "down")),  # rank 20: a 32-wide rank block, masked
        ("gpt_oss", 2, 3, ("gate_up", "down")),
        ("gpt_oss", 1, 5, ("down",)),
        ("qwen3_moe", 2, 2, ("gate_up",)),
    ],
)
def test_triton_lora_fp32_equals_the_reference(kind, k, rank, which, monkeypatch):
    monkeypatch.setattr(moe, "torch", PoisonedTorch())
    cfg, bias = (GPT_OSS, True) if kind == "gpt_oss" else (QWEN, False)
    inputs, index, dy, _ = _case(cfg, k, bias=bias, seed=k + rank)
    num_experts = inputs[2].shape[0]
    factors = _lora_factors(cfg, num_experts, rank, which, seed=rank)
    ours = _run_lora(_triton, inputs, factors, index, dy, cfg, [torch.float32] * 10)
    ref = _run_lora(moe_experts_ref, inputs, factors, index, dy, cfg, [torch.float64] * 10)
    names = [*NAMES[:5], *(["dgate_up_bias", "ddown_bias"] if bias else []), "dA1", "dB1", "dA2", "dB2"]
    names = [n for n in names if not (n[1:] in ("A1", "B1") and "gate_up" not in which)]
    names = [n for n in names if not (n[1:] in ("A2", "B2") and "down" not in which)]
    assert len(ours) == len(ref) == len(names)
    for name, o, r in zip(names, ours, ref):
        assert o.dtype == torch.float32 and o.shape == r.shape, name
        torch.testing.assert_close(o.double(), r, atol=2e-5 * r.abs().max().item(), rtol=0, msg=f"{kind} {name}")


def test_triton_lora_small_tiles_multi_block_paths(monkeypatch):
    # several column blocks: the adapter's x A^T, h A^T and dy B are computed by every block and saved by block 0;
    # rank 18 spans a 32-wide rank block; 16-row weight-gradient steps over ragged experts
    monkeypatch.setattr(moe, "CPU_TILES", moe.SMALL_TILES)
    inputs, index, dy, _ = _case(GPT_OSS, 2, bias=True, tokens=17, seed=4)
    factors = _lora_factors(GPT_OSS, inputs[2].shape[0], 18, seed=4)
    ours = _run_lora(_triton, inputs, factors, index, dy, GPT_OSS, [torch.float32] * 10)
    ref = _run_lora(moe_experts_ref, inputs, factors, index, dy, GPT_OSS, [torch.float64] * 10)
    for i, (o, r) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(o.double(), r, atol=2e-5 * r.abs().max().item(), rtol=0, msg=str(i))


def _lora_bf16_tokens_fp32_weights(device, tokens, extra_ulps):
    """Autocast training with LoRA on the experts: bf16 tokens and router weights, fp32 frozen weights and fp32
    factors cast per tile, fp32 factor gradients; within twice PyTorch's own bf16 error of the fp64 reference (its
    eager loop in bf16, which rounds the adapter's x A^T, dy B and d gate_up B to bf16 as the kernels do)."""
    g = torch.Generator().manual_seed(12)
    num_experts, k = 8, 2
    index, weights = _routing(k, g, num_experts=num_experts, tokens=tokens)
    x, dy = torch.randn(tokens, HID, generator=g), torch.randn(tokens, HID, generator=g)
    inputs = [x.bfloat16().float(), weights.bfloat16().float(), *_experts(QWEN, num_experts, seed=3)]
    factors = _lora_factors(QWEN, num_experts, 8, seed=5)
    bf16, f32, f64 = torch.bfloat16, torch.float32, torch.float64
    inputs, factors = ([None if t is None else t.to(device) for t in ts] for ts in (inputs, factors))
    index, dy = index.to(device), dy.to(device)
    ours = _run_lora(_triton, inputs, factors, index, dy, QWEN, [bf16, bf16, *[f32] * 8])
    ref = _run_lora(moe_experts_ref, inputs, factors, index, dy, QWEN, [f64] * 10)
    eager = _run_lora(moe_experts_ref, inputs, factors, index, dy, QWEN, [bf16] * 10)
    names = ["out", "dx", "dtop_k_weights", "dgate_up_proj", "ddown_proj", "dA1", "dB1", "dA2", "dB2"]
    for name, o, r, e in zip(names, ours, ref, eager):
        assert o.dtype == (bf16 if name in ("out", "dx", "dtop_k_weights") else f32), name
        assert_lowp_close(o.float().cpu(), r.cpu(), e.float().cpu(), bf16, name=name, extra_ulps=extra_ulps)


def test_triton_lora_bf16_tokens_with_fp32_weights_and_factors():
    # 2 ulps here: the interpreter truncates fp32 -> bf16 (no round to nearest), and the adapter's path rounds its
    # rank-r intermediates once more than the base path before they are summed again (measured: dB1 4.95 against a
    # bound of 2 x 1.20 + 1.55 per ulp); the GPU rounds to nearest: its twin holds 1 ulp
    _lora_bf16_tokens_fp32_weights("cpu", tokens=12, extra_ulps=2)


@pytest.mark.gpu
def test_on_the_gpu_lora_bf16_tokens_with_fp32_weights_and_factors():
    _lora_bf16_tokens_fp32_weights("cuda", tokens=48, extra_ulps=1)
