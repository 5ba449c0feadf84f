"""The experts of a Mixture-of-Experts block (Qwen3-MoE, Mixtral, gpt-oss, Qwen3.5-MoE): every token's k routed
experts, each a gated MLP, weighted by the router and summed back into the token's row.

Math (x: (T, H) tokens; e = top_k_index[t, j], w = top_k_weights[t, j] for each of a token's k slots)
    gate, up = x_t W_gate[e] (+ b_gate[e]),  x_t W_up[e] (+ b_up[e])          (each (I,))
    h        = act(gate, up)                                                 act: see ACTS
    y_tj     = h W_down[e] (+ b_down[e])                                     ((H,))
    out_t    = sum_j w_tj y_tj
The parameters stay in the layout transformers 5 stores (so checkpoints load and save as they are):
    transposed=False (Qwen3-MoE, Mixtral, Qwen3.5-MoE): gate_up_proj (E, 2I, H), down_proj (E, H, I), no biases
    transposed=True  (gpt-oss):                         gate_up_proj (E, H, 2I), down_proj (E, I, H), biases
    interleaved=False: gate = columns [0, I), up = [I, 2I) of the 2I axis; interleaved=True (gpt-oss): gate = even
    columns, up = odd columns
These are transformers' `use_experts_implementation(is_transposed=..., is_concatenated=not interleaved)`.

ACTS
    "silu"    act = silu(gate) * up                                          (SwiGLU: Qwen3-MoE, Mixtral)
    "gpt_oss" g = min(gate, limit), u = clamp(up, -limit, limit),
              act = (u + 1) * g * sigmoid(alpha g)                           (alpha 1.702, limit 7: gradients are
                                                                              zero where a value was clamped)

`moe_experts_ref` is the golden: transformers' eager expert loop (one matmul per expert that has tokens, the
weighting in the router weights' dtype, `index_add_` back in x's dtype), differentiable by autograd in every input,
the router weights included.

Backward (dout: (T, H); g_tj = dout_t W_down[e]^T, the gradient of h before the router weight)
    dw_tj    = <dout_t, y_tj> = <g_tj, h_tj> + <dout_t, b_down[e]>           (y never saved)
    dh       = w_tj g_tj;   dgate, dup = dh act'(gate, up)                    (dgu: (2I,) in the 2I axis' own order)
    dx_t     = sum_j dgu_tj W1[e]^T;   dW1[e] = sum x_t^T dgu_tj;   db1[e] = sum dgu_tj
    dW2[e]   = sum h_tj^T (w_tj dout_t);   db2[e] = sum w_tj dout_t           (sums over expert e's rows)

The Triton path (`moe_experts` on CUDA tensors, or forced with the interpreter)
Routing (`moe_route`, torch ops, once per call, no host sync): the (T, k) assignments flattened to N = T k rows and
sorted by expert with a stable sort (deterministic; a token's slots keep their order within an expert); `offsets`
(E + 1) by searchsorted on the sorted experts (bincount would sync to size its output); a tile table (3, max_tiles)
of (expert, row start, row end), each tile at most BLOCK_M rows of one expert, built with cumsum and searchsorted.
The grid cannot depend on the counts without a sync, so it is max_tiles = cdiv(N, BLOCK_M) + min(E, N) long (each
expert with rows adds at most one partial tile) and the unused tail holds empty tiles whose programs read two table
entries and return. Experts without rows have no tiles (and zero weight gradients).
Kernels (fp32 accumulation everywhere; bf16/fp16 operands on the tensor cores, fp32 ones as IEEE fp32 dots):
    _moe_gemm1_kernel  (tile, I block): x rows loaded by token index (the gather fused into the A loads: x[token]
                       never exists), gate and up as two accumulators over one K loop over H, both read from the
                       gate_up_proj parameter through its strides and a column map (gate of column j at j col_step,
                       up at j col_step + up_off: (1, I) concatenated, (2, 1) interleaved), so neither layout nor
                       interleaving is copied; bias and activation in the epilogue; writes h (N, I) and, when a
                       gradient is needed, the pre-activation gate_up (N, 2I) in x's dtype.
    _moe_gemm2_kernel  (tile, H block): h @ W_down (+ bias) x the router weight, each row stored at its assignment
                       t k + j of a (T k, H) buffer: every row written by one program, no atomics. The backward
                       reuses it for dx: dgu @ W1^T (W1 read transposed through its strides), no bias or weight.
    _moe_dgrad_kernel  (tile, I block): g = dout[token] @ W_down^T with the dout gather fused; the epilogue reloads
                       gate and up, recomputes h and act', writes dgu (N, 2I) and one fp32 partial <g, h> per row and
                       I block (block 0 adds <dout, b_down>), summed by torch: dtop_k_weights, deterministic.
    _moe_wgrad_kernel  (expert, P block, Q block): dW[e] = A_e^T B_e looping over expert e's rows, stored straight
                       into the gradient in the parameter's own layout (its strides; no transposed copy), the bias
                       gradient as B's column sums by the P block 0 programs. DOWN: A = act(gate_up) recomputed,
                       B = w dout[token]; else A = x[token], B = dgu.
Combine: the k slots of a token are summed by torch (`.view(T, k, H).sum(1)`: fp32 accumulation for 16-bit dtypes,
one rounding, deterministic; k = 1 is a view), for the output and for dx.
Saved vs recomputed: the pre-activation gate_up (N, 2I, x's dtype) is saved and h is recomputed from it elementwise
where the backward needs it (dgrad's epilogue, the DOWN pass's A tiles): the same tensors transformers' eager loop
keeps alive (it holds gate_up and h), no second GEMM1 (recomputing gate_up from x would save 2 N I s bytes per layer
for 4 N H I more FLOPs, a third of the forward). Neither y nor h is kept.

Bytes (s = x's element size, w = the weights', per call; bench/bench_moe.py's `traffic_parts` counts every launch's
issued bytes exactly, equal to the traffic meter in tests/bench/test_byte_models.py): gemm1 reads x once per I block
and W_gate_up once per row tile (real tiles ~ N / BLOCK_M + E), writes 3 N I s; gemm2 reads h once per H block and
W_down once per tile, writes N H s, which the slots' sum reads back to write T H s. The weights dominate at few rows
per expert (E 3 H I w per pass over the tiles of an expert: L2 serves the re-reads across an expert's tiles on a
GPU), the rows at many. The least the forward can move is T H s + 3 E H I w + T H s.

Launch: GPU tiles (`GPU_TILES`) 64 rows x 64 I columns (gemm1, dgrad: two 64 x 64 accumulators or the gate/up
epilogue), 64 x 128 H columns (gemm2), K step 64, weight gradients 64 x 64 over 64-row steps; 4 warps, 3 stages;
fp32 inputs use K step 32 and 64-wide gemm2 tiles (`GPU_TILES_F32`). Not yet timed on a GPU. ptxas (sm_90,
`python -m bench.sm90 --only moe_experts`, the benchmark shapes at 8192 tokens), registers per thread, no spills:
    bf16 Qwen3-30B-A3B (SwiGLU)      gemm1 128, gemm2 111 (dx pass 106), dgrad 167, wgrad DOWN 118 / UP 64
    bf16 gpt-oss-20b (clamped, bias) gemm1 217, gemm2 119 (dx pass 111), dgrad 208, wgrad DOWN 175 / UP 80
    fp32 Qwen3-30B-A3B               gemm1 244, gemm2 168 (dx pass 128), dgrad 195, wgrad DOWN 83 / UP 77
    bf16 tokens, fp32 weights        gemm1 181, gemm2 168 (dx pass 164), dgrad 167, wgrad DOWN 113 / UP 59 (Qwen3's
    (training under bf16 autocast)   shape; shared memory up to 104 KB: the fp32 weight tiles; CI compiles this one)
    the same with LoRA r 16 on both  gemm1 224 (112 KB shared), gemm2 180 (dx pass 170), dgrad 168; the factors'
    (frozen fp32 weights)            passes dA1 39, dB1 34, dA2 62, dB2 56
(64 x 128 weight-gradient tiles spilled 32 B in gpt-oss's DOWN pass and fp32 at K step 64 spilled up to 904 B.)

LoRA on the experts (`gate_up_lora`, `down_lora`: ExpertLoRA, peft's `target_parameters` factors as they are)
    gate_up += s1 (x A1_e^T) B1_e^T;  y += s2 (h A2_e^T) B2_e^T              (A_e (r, in), B_e (out, r) per expert)
as more rank-r GEMMs on the same sorted rows and tiles, fused into the base kernels (never the (E, out, in) delta
that peft's ParamWrapper forms and adds to the weight every forward, 2 E H I elements per tensor):
    gemm1   x A1^T accumulated in the same K loop over H (each I block: r / (2 BLOCK_N) more FLOPs), rounded to x's
            dtype, times B1^T into gate and up before the bias and activation; column block 0 saves x A1^T (N, r).
    gemm2   h A2^T in the K loop over I, times B2^T into y before the bias and router weight; saves h A2^T (N, r).
    dgrad   dy B2 in the K loop over H: g += s2 (dy B2) A2 (so dtop_k_weights and d gate_up include the adapter);
            saves dy B2 (N, r).
    dx pass dgu B1 in its K loop over 2I: dx += s1 (dgu B1) A1; saves dgu B1 (N, r).
    factor gradients, four more `_moe_wgrad_kernel` passes (rank-r wide), written into peft's layouts:
            dA1 = s1 (dgu B1)^T x,  dB1 = s1 dgu^T (x A1^T),  dA2 = s2 (w dy B2)^T h,  dB2 = s2 (w dy)^T (h A2^T).
The rank-r intermediates are rounded to x's dtype as peft's own 16-bit LoRA layers round them. Kept for the
backward: 2 N r more elements per layer. `moe_experts_ref` adds the same terms expert by expert.

`moe_experts_grouped_mm` is the same op through `torch._grouped_mm` (transformers 5's "grouped_mm" experts): the
rows gathered in expert order, two grouped GEMMs, the rest in PyTorch, `index_add` back; autograd for the backward.
torch 2.13 runs it forward and backward on CPU too (fp32, bf16) when H and I rows are 16-byte aligned (it raises
otherwise), and an upstream gradient with zero strides (`out.sum().backward()` straight into it) is refused there.

Test:  python -m pytest tests/kernels/test_moe.py -q      (CPU: the Triton interpreter; ~35 s on 2 cores)
Bench: python bench/bench_moe.py                         (GPU: Qwen3-30B-A3B and gpt-oss-20b experts; --quick on CPU)
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ._dispatch import HAS_TRITON, interpreter_on, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

ACTS = ("silu", "gpt_oss")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0


def _check_args(x, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, transposed, act):
    if act not in ACTS:
        raise ValueError(f"moe_experts: act={act!r} is not one of {', '.join(ACTS)}")
    if x.dim() != 2 or top_k_index.dim() != 2 or top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"moe_experts: x must be (T, H) and top_k_index/top_k_weights (T, k) alike, got {tuple(x.shape)}, "
            f"{tuple(top_k_index.shape)}, {tuple(top_k_weights.shape)}"
        )
    if top_k_index.shape[0] != x.shape[0]:
        raise ValueError(f"moe_experts: {x.shape[0]} tokens but top_k_index has {top_k_index.shape[0]} rows")
    e, two_i, h = gate_up_proj.shape if not transposed else (gate_up_proj.shape[0], *gate_up_proj.shape[:0:-1])
    want_down = (e, h, two_i // 2) if not transposed else (e, two_i // 2, h)
    if h != x.shape[1] or two_i % 2 or tuple(down_proj.shape) != want_down:
        raise ValueError(
            f"moe_experts: gate_up_proj {tuple(gate_up_proj.shape)} and down_proj {tuple(down_proj.shape)} do not "
            f"fit hidden size {x.shape[1]} (transposed={transposed})"
        )
    if gate_up_bias is not None and tuple(gate_up_bias.shape) != (e, two_i):
        raise ValueError(f"moe_experts: gate_up_bias must be ({e}, {two_i}), got {tuple(gate_up_bias.shape)}")
    if down_bias is not None and tuple(down_bias.shape) != (e, h):
        raise ValueError(f"moe_experts: down_bias must be ({e}, {h}), got {tuple(down_bias.shape)}")


@dataclasses.dataclass(frozen=True)
class ExpertLoRA:
    """peft's LoRA on one stacked expert tensor (`target_parameters`), as its ParamWrapper holds it: lora_A (r E, in)
    with expert e's rows at [e r, (e + 1) r), lora_B (out, r E) with expert e's column j at j E + e; expert e's
    delta maps `in` to `out` of the projection (gate_up: H to 2I in the parameter's column order, down: I to H) as
    scaling B_e A_e, whatever the parameter's layout (peft's einsum). The kernels read both through their strides
    (no copy) and never form the (E, out, in) delta: x A_e^T then B_e, on the expert's rows."""

    lora_A: torch.Tensor
    lora_B: torch.Tensor
    scaling: float

    def rank(self, num_experts: int) -> int:
        return self.lora_A.shape[0] // num_experts

    def factors(self, e: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (A_e (r, in), B_e (out, r)), views."""
        r = self.rank(num_experts)
        return self.lora_A[e * r : (e + 1) * r], self.lora_B[:, e::num_experts]


def _check_lora(lora: ExpertLoRA | None, name: str, num_experts: int, fan_in: int, fan_out: int) -> None:
    if lora is None:
        return
    a, b = lora.lora_A, lora.lora_B
    r = a.shape[0] // num_experts if a.dim() == 2 else 0
    if (
        a.dim() != 2
        or b.dim() != 2
        or r < 1
        or a.shape != (r * num_experts, fan_in)
        or b.shape != (fan_out, r * num_experts)
    ):
        raise ValueError(
            f"moe_experts: {name} LoRA factors must be lora_A (r E, {fan_in}) and lora_B ({fan_out}, r E) with "
            f"E = {num_experts}, got {tuple(a.shape)} and {tuple(b.shape)}"
        )


def _check_loras(gate_up, down, transposed, gate_up_lora, down_lora) -> None:
    e = gate_up.shape[0]
    h, two_i = (gate_up.shape[1], gate_up.shape[2]) if transposed else (gate_up.shape[2], gate_up.shape[1])
    _check_lora(gate_up_lora, "gate_up", e, h, two_i)
    _check_lora(down_lora, "down", e, two_i // 2, h)


def split_gate_up(gate_up: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of a (..., 2I) projection: even/odd columns if interleaved, else first/second half."""
    if interleaved:
        return gate_up[..., ::2], gate_up[..., 1::2]
    return gate_up.chunk(2, dim=-1)


def expert_act(
    gate: torch.Tensor, up: torch.Tensor, act: str, alpha: float = GPT_OSS_ALPHA, limit: float = GPT_OSS_LIMIT
) -> torch.Tensor:
    """The expert's gated activation, as transformers computes it (in the inputs' dtype)."""
    if act == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def moe_experts_ref(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    *,
    transposed: bool = False,
    interleaved: bool = False,
    act: str = "silu",
    alpha: float = GPT_OSS_ALPHA,
    limit: float = GPT_OSS_LIMIT,
    gate_up_lora: ExpertLoRA | None = None,
    down_lora: ExpertLoRA | None = None,
) -> torch.Tensor:
    """transformers' eager expert loop: for each expert with tokens, its rows through the gated MLP, weighted, and
    `index_add_`-ed back in x's dtype. Differentiable in x, the router weights, the weights, the biases and the LoRA
    factors, which join as `rows A_e^T B_e^T scaling` (ExpertLoRA: the delta is never formed)."""
    _check_args(x, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, transposed, act)
    _check_loras(gate_up_proj, down_proj, transposed, gate_up_lora, down_lora)
    out = torch.zeros_like(x)
    num_experts = gate_up_proj.shape[0]
    with torch.no_grad():
        hit = torch.bincount(top_k_index.reshape(-1), minlength=num_experts).nonzero().flatten().tolist()
    for e in hit:
        token_idx, slot = torch.where(top_k_index == e)
        rows = x[token_idx]
        w1 = gate_up_proj[e] if transposed else gate_up_proj[e].t()  # (H, 2I)
        gate_up = rows @ w1
        if gate_up_lora is not None:
            a, b = gate_up_lora.factors(e, num_experts)
            gate_up = gate_up + (rows @ a.t()) @ b.t() * gate_up_lora.scaling
        if gate_up_bias is not None:
            gate_up = gate_up + gate_up_bias[e]
        h = expert_act(*split_gate_up(gate_up, interleaved), act, alpha, limit)
        w2 = down_proj[e] if transposed else down_proj[e].t()  # (I, H)
        y = h @ w2
        if down_lora is not None:
            a, b = down_lora.factors(e, num_experts)
            y = y + (h @ a.t()) @ b.t() * down_lora.scaling
        if down_bias is not None:
            y = y + down_bias[e]
        y = y * top_k_weights[token_idx, slot, None]
        out = out.index_add(0, token_idx, y.to(x.dtype))
    return out


# ---------------------------------------------------------------------------------------------------------
# Routing: one stable sort of the (T, k) assignments by expert, and the tile table of the grouped GEMMs.
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Block sizes of the four kernels: rows per tile (one tile table for every row kernel), the column blocks of the
    row kernels (gemm1 and dgrad over I, gemm2 and the dx pass over H), the reduction step, the weight-gradient
    tiles (P x Q of an expert's weight, stepping BLOCK_K rows), warps and pipeline stages."""

    block_m: int
    block_n1: int  # gemm1 and dgrad: I columns per program (two accumulators of block_m x block_n1 in gemm1)
    block_n2: int  # gemm2 and the dx pass: H columns per program
    block_k: int
    block_p: int
    block_q: int
    num_warps: int
    num_stages: int


# GPU: 64-row tiles (Qwen3-30B-A3B averages 512 rows per expert at 8192 tokens, so about 1/8 of a tile is padding per
# expert at 64) and bf16 operands on the tensor cores with fp32 accumulators. Not yet timed on a GPU. ptxas (sm_90,
# `python -m bench.sm90 --only moe_experts`): 64 x 128 weight-gradient tiles spilled in the gpt-oss DOWN pass (255
# registers, 32 B spill stores: the activation recomputed on the A tile), 64 x 64 do not; fp32 (IEEE dots, twice the
# operand bytes) spilled up to 904 B at BLOCK_K 64 and fits at 32.
GPU_TILES = Tiles(block_m=64, block_n1=64, block_n2=128, block_k=64, block_p=64, block_q=64, num_warps=4, num_stages=3)
GPU_TILES_F32 = Tiles(
    block_m=64, block_n1=64, block_n2=64, block_k=32, block_p=64, block_q=64, num_warps=4, num_stages=3
)
# Interpreter: the cost is per program and per operation, not per element (measured on this 2-core box at T 23, k 2,
# H 40, I 24: a forward and backward took 3.1 s at 8-row tiles and 16-wide blocks, 1.2 s at 16/32, 0.55 s at these):
# the tests' shapes fit one column block and one reduction step; tests/kernels/test_moe.py runs the masked multi-block
# paths at SMALL_TILES.
CPU_TILES = Tiles(block_m=16, block_n1=32, block_n2=64, block_k=64, block_p=64, block_q=64, num_warps=1, num_stages=1)
SMALL_TILES = Tiles(block_m=8, block_n1=16, block_n2=16, block_k=16, block_p=16, block_q=16, num_warps=1, num_stages=1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass
class Routing:
    """The (T, k) assignments sorted by expert: row r of every sorted buffer is assignment `assign[r]` = t k + j."""

    tokens: int
    k: int
    assign: torch.Tensor  # (N,) int32: the original assignment (t * k + j) of each sorted row, N = T k
    token: torch.Tensor  # (N,) int32: its token t
    offsets: torch.Tensor  # (E + 1,) int32: expert e owns sorted rows [offsets[e], offsets[e + 1])
    tiles: torch.Tensor  # (3, max_tiles) int32: expert, row start, row end of each tile (empty: start = end = 0)

    @property
    def max_tiles(self) -> int:
        return self.tiles.shape[1]


def max_tiles(n: int, num_experts: int, block_m: int) -> int:
    """An upper bound of sum_e cdiv(count_e, block_m) known without reading the counts: each expert that has rows
    adds at most one partial tile."""
    return _cdiv(n, block_m) + min(num_experts, n)


def moe_route(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> Routing:
    """Sort the assignments by expert (stable: deterministic, and a token's slots in order within an expert), count
    each expert's rows and cut them into tiles of at most `block_m` rows that never straddle two experts. Torch ops
    only, no host sync: the grid is `max_tiles` programs long and the unused tail of the table is empty tiles."""
    t, k = top_k_index.shape
    n, dev = t * k, top_k_index.device
    flat = top_k_index.reshape(-1)
    sorted_e, order = torch.sort(flat, stable=True)  # (N,)
    bounds = torch.arange(num_experts + 1, device=dev, dtype=sorted_e.dtype)
    offsets = torch.searchsorted(sorted_e, bounds)  # (E + 1,): first row of each expert (no bincount: it syncs)
    counts = offsets[1:] - offsets[:-1]  # (E,)
    tiles_e = (counts + block_m - 1) // block_m  # (E,)
    tile_end = torch.cumsum(tiles_e, 0)  # (E,)
    i = torch.arange(max_tiles(n, num_experts, block_m), device=dev)  # (max_tiles,)
    e = torch.searchsorted(tile_end, i, right=True)  # (max_tiles,) in [0, E]: E past the last real tile
    valid = e < num_experts
    e = e.clamp(max=num_experts - 1)
    start = offsets[e] + (i - (tile_end[e] - tiles_e[e])) * block_m
    end = torch.minimum(start + block_m, offsets[e + 1])
    zero = torch.zeros((), dtype=start.dtype, device=dev)
    tiles = torch.stack([e, torch.where(valid, start, zero), torch.where(valid, end, zero)]).to(torch.int32)
    return Routing(t, k, order.to(torch.int32), (order // k).to(torch.int32), offsets.to(torch.int32), tiles)


# ---------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _act_fwd(gate, up, alpha, limit, ACT: tl.constexpr):
        # fp32 in and out; ACT 0: silu(gate) * up, 1: gpt-oss's clamped form
        if ACT == 0:
            h = gate * tl.sigmoid(gate) * up
        else:
            g = tl.minimum(gate, limit)
            u = tl.minimum(tl.maximum(up, -limit), limit)
            h = (u + 1.0) * g * tl.sigmoid(alpha * g)
        return h

    @triton.jit
    def _act_bwd(gate, up, alpha, limit, ACT: tl.constexpr):
        # (h, dh/dgate, dh/dup) in fp32; the clamps pass gradient where torch.clamp does (bounds included)
        if ACT == 0:
            s = tl.sigmoid(gate)
            a = gate * s
            h = a * up
            d_gate = up * s * (1.0 + gate * (1.0 - s))
            d_up = a
        else:
            g = tl.minimum(gate, limit)
            u = tl.minimum(tl.maximum(up, -limit), limit)
            s = tl.sigmoid(alpha * g)
            a = g * s
            h = (u + 1.0) * a
            d_gate = tl.where(gate <= limit, (u + 1.0) * s * (1.0 + alpha * g * (1.0 - s)), 0.0)
            d_up = tl.where((up >= -limit) & (up <= limit), a, 0.0)
        return h, d_gate, d_up

    @triton.jit
    def _mma(acc, a, b, F32_DOT: tl.constexpr):
        # acc += a @ b: fp32 operands in IEEE fp32 (the interpreter, fp32 inputs), else both in a's 16-bit dtype
        if F32_DOT:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b.to(a.dtype), acc)
        return acc

    @triton.jit
    def _moe_gemm1_kernel(
        x_ptr,  # (T, H) tokens, row stride stride_xt, unit column stride
        w_ptr,  # gate_up_proj: W1[e][h, c] at e stride_we + h stride_wh + c stride_wc (either layout, no copy)
        b_ptr,  # (E, 2I) gate_up_bias, row stride stride_be, unit column stride (unused without HAS_BIAS)
        tile_ptr,  # (3, n_tiles) int32: expert, row start, row end of each tile
        tok_ptr,  # (N,) int32: the token of each sorted row
        h_ptr,  # (N, I) output in x's dtype: act(gate, up) of each sorted row
        gu_ptr,  # (N, 2I) output in x's dtype: gate and up before the activation, the parameter's column order (SAVE)
        n_tiles,
        H,
        INTER,
        stride_xt,
        stride_we,
        stride_wh,
        stride_wc,
        stride_be,
        col_step,  # gate of column j at c = j col_step, up at j col_step + up_off (interleaved: 2, 1; else 1, I)
        up_off,
        alpha,
        limit,
        la_ptr,  # LoRA: A[e][k, j] (H, r) at e la_e + k la_k + j la_j (peft's lora_A read transposed)
        lb_ptr,  # LoRA: B[e][j, c] (r, 2I) at e lb_e + j lb_j + c lb_n, c the parameter's column (lora_B transposed)
        lsave_ptr,  # LoRA: (N, r) output in x's dtype: x A^T of each sorted row (SAVE; written by column block 0)
        rank,
        l_scale,
        la_e,
        la_k,
        la_j,
        lb_e,
        lb_j,
        lb_n,
        ACT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        SAVE: tl.constexpr,
        F32_DOT: tl.constexpr,
        LORA: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        tile = tl.program_id(0)
        row_start = tl.load(tile_ptr + n_tiles + tile)
        row_end = tl.load(tile_ptr + 2 * n_tiles + tile)
        if row_start >= row_end:  # the empty tail of the tile table
            return
        e = tl.load(tile_ptr + tile).to(tl.int64)
        rows = row_start + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
        row_ok = rows < row_end
        tok = tl.load(tok_ptr + rows, mask=row_ok, other=0).to(tl.int64)  # the gather, fused: x rows by token
        j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) columns of gate and up
        j_ok = j < INTER
        c_gate = j * col_step
        c_up = c_gate + up_off
        w_base = w_ptr + e * stride_we
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        jr = tl.arange(0, BLOCK_R)  # LoRA rank index
        jr_ok = jr < rank
        acc_r = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)  # x A^T (LORA)
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
            k_ok = ks < H
            a = tl.load(x_ptr + tok[:, None] * stride_xt + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & j_ok[None, :]
            w_rows = w_base + ks[:, None] * stride_wh
            wg = tl.load(w_rows + c_gate[None, :] * stride_wc, mask=w_mask, other=0.0)  # (BLOCK_K, BLOCK_N)
            wu = tl.load(w_rows + c_up[None, :] * stride_wc, mask=w_mask, other=0.0)
            acc_g = _mma(acc_g, a, wg, F32_DOT)
            acc_u = _mma(acc_u, a, wu, F32_DOT)
            if LORA:
                la_tile = la_ptr + e * la_e + ks[:, None] * la_k + jr[None, :] * la_j
                acc_r = _mma(acc_r, a, tl.load(la_tile, mask=k_ok[:, None] & jr_ok[None, :], other=0.0), F32_DOT)
        if LORA:
            # (x A^T rounded to x's dtype, as saved for the backward) B, scaled, joins gate and up before the bias
            xa = acc_r.to(gu_ptr.dtype.element_ty)
            lb_rows = lb_ptr + e * lb_e + jr[:, None] * lb_j
            lb_mask = jr_ok[:, None] & j_ok[None, :]
            lg = _mma(
                tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32),
                xa,
                tl.load(lb_rows + c_gate[None, :] * lb_n, mask=lb_mask, other=0.0),
                F32_DOT,
            )
            lu = _mma(
                tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32),
                xa,
                tl.load(lb_rows + c_up[None, :] * lb_n, mask=lb_mask, other=0.0),
                F32_DOT,
            )
            acc_g += l_scale * lg
            acc_u += l_scale * lu
            if SAVE and tl.program_id(1) == 0:
                r_mask = row_ok[:, None] & jr_ok[None, :]
                tl.store(lsave_ptr + rows.to(tl.int64)[:, None] * rank + jr[None, :], xa, mask=r_mask)
        if HAS_BIAS:
            acc_g += tl.load(b_ptr + e * stride_be + c_gate, mask=j_ok, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(b_ptr + e * stride_be + c_up, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        alpha32, limit32 = tl.cast(alpha, tl.float32), tl.cast(limit, tl.float32)  # fp64 under torch.compile
        # the activation reads gate and up rounded to x's dtype, as saved: the backward's act' and clamp masks then see
        # the values the forward used (a gate stored as 7.0 from 7.01 would pass gradient the forward had clamped)
        acc_g = acc_g.to(gu_ptr.dtype.element_ty).to(tl.float32)
        acc_u = acc_u.to(gu_ptr.dtype.element_ty).to(tl.float32)
        h = _act_fwd(acc_g, acc_u, alpha32, limit32, ACT)
        rows64 = rows.to(tl.int64)
        mask = row_ok[:, None] & j_ok[None, :]
        tl.store(h_ptr + rows64[:, None] * INTER + j[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)
        if SAVE:
            gu_rows = gu_ptr + rows64[:, None] * (2 * INTER)
            tl.store(gu_rows + c_gate[None, :], acc_g.to(gu_ptr.dtype.element_ty), mask=mask)
            tl.store(gu_rows + c_up[None, :], acc_u.to(gu_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _moe_gemm2_kernel(
        a_ptr,  # (N, K) sorted rows, contiguous: h (forward) or d gate_up (the dx pass)
        w_ptr,  # B[e][k, n] at e stride_we + k stride_wk + n stride_wn: W_down (forward) or W1 read transposed (dx)
        b_ptr,  # (E, NC) bias, row stride stride_be (HAS_BIAS)
        scale_ptr,  # (T k,) the top-k weights by assignment (HAS_SCALE)
        tile_ptr,  # (3, n_tiles) int32: expert, row start, row end of each tile
        assign_ptr,  # (N,) int32: the assignment t k + j of each sorted row
        out_ptr,  # (T k, NC) output: row r of the product goes to row assign[r] (written once: no atomics)
        n_tiles,
        K,
        NC,
        stride_we,
        stride_wk,
        stride_wn,
        stride_be,
        la_ptr,  # LoRA: P[e][k, j] (K, r) at e la_e + k la_k + j la_j: A_down^T (forward) or B_gate_up (dx)
        lb_ptr,  # LoRA: Q[e][j, n] (r, NC) at e lb_e + j lb_j + n lb_n: B_down^T (forward) or A_gate_up (dx)
        lsave_ptr,  # LoRA: (N, r) output in a's dtype, a P of each sorted row (written by column block 0)
        rank,
        l_scale,
        la_e,
        la_k,
        la_j,
        lb_e,
        lb_j,
        lb_n,
        HAS_BIAS: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        F32_DOT: tl.constexpr,
        LORA: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        tile = tl.program_id(0)
        row_start = tl.load(tile_ptr + n_tiles + tile)
        row_end = tl.load(tile_ptr + 2 * n_tiles + tile)
        if row_start >= row_end:
            return
        e = tl.load(tile_ptr + tile).to(tl.int64)
        rows = row_start + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        rows64 = rows.to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < NC
        w_base = w_ptr + e * stride_we + cols[None, :] * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        jr = tl.arange(0, BLOCK_R)
        jr_ok = jr < rank
        acc_r = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)  # a P (LORA)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(a_ptr + rows64[:, None] * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_base + ks[:, None] * stride_wk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = _mma(acc, a, b, F32_DOT)
            if LORA:
                la_tile = la_ptr + e * la_e + ks[:, None] * la_k + jr[None, :] * la_j
                acc_r = _mma(acc_r, a, tl.load(la_tile, mask=k_ok[:, None] & jr_ok[None, :], other=0.0), F32_DOT)
        if LORA:
            ap = acc_r.to(a_ptr.dtype.element_ty)  # rounded to a's dtype, as saved for the backward
            lb_tile = lb_ptr + e * lb_e + jr[:, None] * lb_j + cols[None, :] * lb_n
            lq = _mma(
                tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32),
                ap,
                tl.load(lb_tile, mask=jr_ok[:, None] & col_ok[None, :], other=0.0),
                F32_DOT,
            )
            acc += l_scale * lq
            if tl.program_id(1) == 0:
                tl.store(lsave_ptr + rows64[:, None] * rank + jr[None, :], ap, mask=row_ok[:, None] & jr_ok[None, :])
        if HAS_BIAS:
            acc += tl.load(b_ptr + e * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        dest = tl.load(assign_ptr + rows, mask=row_ok, other=0).to(tl.int64)  # (BLOCK_M,)
        if HAS_SCALE:
            acc *= tl.load(scale_ptr + dest, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        mask = row_ok[:, None] & col_ok[None, :]
        tl.store(out_ptr + dest[:, None] * NC + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _moe_dgrad_kernel(
        dy_ptr,  # (T, H) upstream gradient, row stride stride_dyt, unit column stride
        w_ptr,  # down_proj: W2[e][i, h] at e stride_we + i stride_wi + h stride_wh (either layout)
        b_ptr,  # (E, H) down_bias, row stride stride_be (HAS_BIAS)
        scale_ptr,  # (T k,) the top-k weights by assignment
        gu_ptr,  # (N, 2I) saved gate and up before the activation, the parameter's column order
        tile_ptr,  # (3, n_tiles) int32: expert, row start, row end of each tile
        tok_ptr,  # (N,) int32: the token of each sorted row
        assign_ptr,  # (N,) int32: its assignment t k + j
        dgu_ptr,  # (N, 2I) output in x's dtype: d gate and d up, the parameter's column order
        dw_ptr,  # (column blocks, T k) fp32 output: <g, h> over this block's columns (+ <dy, b_down> in block 0)
        n_tiles,
        H,
        INTER,
        n_assign,
        stride_dyt,
        stride_we,
        stride_wi,
        stride_wh,
        stride_be,
        col_step,
        up_off,
        alpha,
        limit,
        la_ptr,  # LoRA: B_down[e][h, j] (H, r) at e la_e + h la_k + j la_j (peft's lora_B)
        lb_ptr,  # LoRA: A_down[e][j, i] (r, I) at e lb_e + j lb_j + i lb_n (peft's lora_A)
        lsave_ptr,  # LoRA: (N, r) output in x's dtype: dout[token] B_down of each sorted row (column block 0)
        rank,
        l_scale,
        la_e,
        la_k,
        la_j,
        lb_e,
        lb_j,
        lb_n,
        ACT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        F32_DOT: tl.constexpr,
        LORA: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        tile = tl.program_id(0)
        pid_n = tl.program_id(1)
        row_start = tl.load(tile_ptr + n_tiles + tile)
        row_end = tl.load(tile_ptr + 2 * n_tiles + tile)
        if row_start >= row_end:
            return
        e = tl.load(tile_ptr + tile).to(tl.int64)
        rows = row_start + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        rows64 = rows.to(tl.int64)
        tok = tl.load(tok_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        j_ok = j < INTER
        w_base = w_ptr + e * stride_we + j[None, :] * stride_wi
        g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # dy W_down^T, before the top-k weight
        bias_dot = tl.zeros([BLOCK_M], dtype=tl.float32)  # <dy, b_down[e]> (block 0 only)
        bias_h = tl.where(pid_n == 0, H, 0)  # the bias columns this program reads: all in block 0, none elsewhere
        jr = tl.arange(0, BLOCK_R)
        jr_ok = jr < rank
        acc_r = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)  # dy B_down (LORA)
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < H
            dy_mask = row_ok[:, None] & k_ok[None, :]
            dy = tl.load(dy_ptr + tok[:, None] * stride_dyt + ks[None, :], mask=dy_mask, other=0.0)
            w = tl.load(w_base + ks[:, None] * stride_wh, mask=k_ok[:, None] & j_ok[None, :], other=0.0)
            g = _mma(g, dy, w, F32_DOT)
            if HAS_BIAS:
                b = tl.load(b_ptr + e * stride_be + ks, mask=ks < bias_h, other=0.0).to(tl.float32)
                bias_dot += tl.sum(dy.to(tl.float32) * b[None, :], axis=1)
            if LORA:
                la_tile = la_ptr + e * la_e + ks[:, None] * la_k + jr[None, :] * la_j
                acc_r = _mma(acc_r, dy, tl.load(la_tile, mask=k_ok[:, None] & jr_ok[None, :], other=0.0), F32_DOT)
        if LORA:
            # the adapter's share of dy W_down'^T: s (dy B) A, with dy B rounded to x's dtype as saved
            gb = acc_r.to(dgu_ptr.dtype.element_ty)
            lb_tile = lb_ptr + e * lb_e + jr[:, None] * lb_j + j[None, :] * lb_n
            lg = _mma(
                tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32),
                gb,
                tl.load(lb_tile, mask=jr_ok[:, None] & j_ok[None, :], other=0.0),
                F32_DOT,
            )
            g += l_scale * lg
            if pid_n == 0:
                tl.store(lsave_ptr + rows64[:, None] * rank + jr[None, :], gb, mask=row_ok[:, None] & jr_ok[None, :])
        mask = row_ok[:, None] & j_ok[None, :]
        c_gate = j * col_step
        c_up = c_gate + up_off
        gu_rows = gu_ptr + rows64[:, None] * (2 * INTER)
        gate = tl.load(gu_rows + c_gate[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_rows + c_up[None, :], mask=mask, other=0.0).to(tl.float32)
        alpha32, limit32 = tl.cast(alpha, tl.float32), tl.cast(limit, tl.float32)
        h, d_gate, d_up = _act_bwd(gate, up, alpha32, limit32, ACT)
        dest = tl.load(assign_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        dw = tl.sum(g * h, axis=1)  # (BLOCK_M,): masked columns hold g = 0
        if HAS_BIAS:
            dw += bias_dot
        tl.store(dw_ptr + pid_n * n_assign + dest, dw, mask=row_ok)
        dh = g * tl.load(scale_ptr + dest, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        dgu_rows = dgu_ptr + rows64[:, None] * (2 * INTER)
        tl.store(dgu_rows + c_gate[None, :], (dh * d_gate).to(dgu_ptr.dtype.element_ty), mask=mask)
        tl.store(dgu_rows + c_up[None, :], (dh * d_up).to(dgu_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _moe_wgrad_kernel(
        a_ptr,  # A's rows (row stride stride_at): A_MODE 0 sorted rows, 1 rows by token, 2 act(gate, up) of the
        #         saved (N, 2I) gate_up (column p at p col_step and p col_step + up_off)
        b_ptr,  # B's rows (row stride stride_bt): B_MODE 0 sorted rows, 1 rows by token; times the top-k weight of
        #         the row's assignment if B_SCALE
        scale_ptr,  # (T k,) the top-k weights by assignment (B_SCALE)
        off_ptr,  # (E + 1,) int32: expert e owns sorted rows [off[e], off[e + 1])
        tok_ptr,  # (N,) int32: the token of each sorted row
        assign_ptr,  # (N,) int32: its assignment
        dw_ptr,  # dW[e][p, q] at e stride_de + p stride_dp + q stride_dq: the parameter's own layout, its dtype
        db_ptr,  # (E, Q) bias gradient, row stride stride_dbe (HAS_BIAS): the column sums of B over the expert's rows
        P,
        Q,
        stride_at,
        stride_bt,
        stride_de,
        stride_dp,
        stride_dq,
        stride_dbe,
        col_step,
        up_off,
        alpha,
        limit,
        out_scale,
        A_MODE: tl.constexpr,
        B_MODE: tl.constexpr,
        B_SCALE: tl.constexpr,
        ACT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        F32_DOT: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # dW[e] = out_scale A_e^T B_e over expert e's rows. The base weights: DOWN (A act, B by token scaled; P = I,
        # Q = H) dW_down = h^T (w dy); UP (A by token, B sorted; P = H, Q = 2I) dW_gate_up = x^T dgu. The LoRA
        # factors' passes (`_WGRAD_PASSES`) mix the modes. A^T is loaded as a (BLOCK_P, BLOCK_K) tile directly.
        e = tl.program_id(0).to(tl.int64)
        pid_p = tl.program_id(1)
        alpha32, limit32 = tl.cast(alpha, tl.float32), tl.cast(limit, tl.float32)
        row_start = tl.load(off_ptr + e)
        row_end = tl.load(off_ptr + e + 1)
        p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
        p_ok = p < P
        q = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        q_ok = q < Q
        acc = tl.zeros([BLOCK_P, BLOCK_Q], dtype=tl.float32)
        db = tl.zeros([BLOCK_Q], dtype=tl.float32)
        for m0 in range(row_start, row_end, BLOCK_K):
            m = m0 + tl.arange(0, BLOCK_K)  # (BLOCK_K,) sorted rows
            m_ok = m < row_end
            m64 = m.to(tl.int64)
            tok = tl.load(tok_ptr + m, mask=m_ok, other=0).to(tl.int64)
            a_mask = p_ok[:, None] & m_ok[None, :]
            b_mask = m_ok[:, None] & q_ok[None, :]
            if A_MODE == 2:
                c_gate = p * col_step
                gate = tl.load(a_ptr + m64[None, :] * stride_at + c_gate[:, None], mask=a_mask, other=0.0)
                up = tl.load(a_ptr + m64[None, :] * stride_at + (c_gate + up_off)[:, None], mask=a_mask, other=0.0)
                a = _act_fwd(gate.to(tl.float32), up.to(tl.float32), alpha32, limit32, ACT)
                a = a.to(gate.dtype)  # (BLOCK_P, BLOCK_K): h^T, rounded like the forward's stored h
            elif A_MODE == 1:
                a = tl.load(a_ptr + tok[None, :] * stride_at + p[:, None], mask=a_mask, other=0.0)  # x^T
            else:
                a = tl.load(a_ptr + m64[None, :] * stride_at + p[:, None], mask=a_mask, other=0.0)
            b_rows = tok if B_MODE == 1 else m64
            b = tl.load(b_ptr + b_rows[:, None] * stride_bt + q[None, :], mask=b_mask, other=0.0)
            if B_SCALE:
                dest = tl.load(assign_ptr + m, mask=m_ok, other=0).to(tl.int64)
                w = tl.load(scale_ptr + dest, mask=m_ok, other=0.0).to(tl.float32)
                b = b.to(tl.float32) * w[:, None]  # (BLOCK_K, BLOCK_Q) fp32: _mma casts it to a's dtype
            acc = _mma(acc, a, b, F32_DOT)
            if HAS_BIAS:
                db += tl.sum(b.to(tl.float32), axis=0)
        tl.store(
            dw_ptr + e * stride_de + p[:, None] * stride_dp + q[None, :] * stride_dq,
            (acc * out_scale).to(dw_ptr.dtype.element_ty),
            mask=p_ok[:, None] & q_ok[None, :],
        )
        if HAS_BIAS:
            tl.store(db_ptr + e * stride_dbe + q, db.to(db_ptr.dtype.element_ty), mask=q < tl.where(pid_p == 0, Q, 0))


# ---------------------------------------------------------------------------------------------------------
# Launchers (no autograd)
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the kernels read the two parameters in place: strides of the logical W1[e] (H, 2I) and W2[e] (I, H), and
    where gate and up sit on the 2I axis (gate of column j at c = j col_step, up at c + up_off)."""

    transposed: bool
    inter: int  # I
    w1_h: int  # stride of W1's h index
    w1_c: int  # stride of W1's 2I index
    w2_i: int
    w2_h: int
    col_step: int
    up_off: int

    @staticmethod
    def of(gate_up: torch.Tensor, down: torch.Tensor, transposed: bool, interleaved: bool) -> Layout:
        w1 = (gate_up.stride(1), gate_up.stride(2)) if transposed else (gate_up.stride(2), gate_up.stride(1))
        w2 = (down.stride(1), down.stride(2)) if transposed else (down.stride(2), down.stride(1))
        inter = down.shape[1] if transposed else down.shape[2]
        return Layout(transposed, inter, *w1, *w2, *((2, 1) if interleaved else (1, inter)))


def _f32_dot(x: torch.Tensor) -> bool:
    # fp32 inputs multiply in IEEE fp32 (not TF32); the interpreter computes bf16 wrongly (DESIGN.md): fp32 there too
    return x.dtype == torch.float32 or interpreter_on()


def _unit_col(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _sum_slots(buf: torch.Tensor, route: Routing) -> torch.Tensor:
    """(T k, H) rows by assignment -> (T, H): each token's k slots summed (fp32 accumulation inside torch's sum for
    16-bit dtypes, one rounding; deterministic). k = 1 is a view."""
    if route.k == 1:
        return buf
    return buf.view(route.tokens, route.k, buf.shape[1]).sum(dim=1)


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))  # tl.dot's least dimension


def _lora_args(lora: ExpertLoRA | None, num_experts: int, use: str, ref: torch.Tensor) -> tuple:
    """The LoRA arguments of gemm1, gemm2 and dgrad (la, lb, rank, scaling and their strides): `use` says which
    factor each kernel reads as its (K, r) and (r, N) operands, "AtBt" (x A^T then B^T: the forward) or "BA"
    (g B then A: the backward's input gradients). Without LoRA, placeholders the kernels never read."""
    if lora is None:
        return (ref, ref, 0, 0.0, 0, 0, 0, 0, 0, 0)
    a, b, r = lora.lora_A, lora.lora_B, lora.rank(num_experts)
    a_t = (r * a.stride(0), a.stride(1), a.stride(0))  # A_e^T (in, r): [k, j] = A[e r + j, k]
    a_n = (r * a.stride(0), a.stride(0), a.stride(1))  # A_e (r, in): [j, n] = A[e r + j, n]
    b_t = (b.stride(1), num_experts * b.stride(1), b.stride(0))  # B_e^T (r, out): [j, n] = B[n, j E + e]
    b_n = (b.stride(1), b.stride(0), num_experts * b.stride(1))  # B_e (out, r): [k, j] = B[k, j E + e]
    first, second, strides = (a, b, (*a_t, *b_t)) if use == "AtBt" else (b, a, (*b_n, *a_n))
    return (first, second, r, float(lora.scaling), *strides)


def moe_experts_fwd(
    x,
    route,
    weights,
    gate_up,
    down,
    gate_up_bias,
    down_bias,
    *,
    layout,
    act,
    alpha,
    limit,
    tiles,
    save,
    lora=(None, None),
):
    """Forward on sorted rows. Returns out (T, H) in x's dtype and what the backward keeps (all None without `save`):
    the pre-activation gate_up (N, 2I), and with LoRA x A_gate_up^T and h A_down^T (N, r) of each sorted row, in x's
    dtype. x, gate_up_bias and down_bias need unit column strides; weights the contiguous (T, k) top-k weights.
    `lora`: the ExpertLoRA of gate_up and of down, or None each."""
    hidden, n, inter = x.shape[1], route.assign.numel(), layout.inter
    num_experts = gate_up.shape[0]
    f32 = _f32_dot(x)
    lora1, lora2 = lora
    h = torch.empty((n, inter), dtype=x.dtype, device=x.device)  # (N, I)
    gu = torch.empty((n, 2 * inter), dtype=x.dtype, device=x.device) if save else None  # (N, 2I)
    xa = torch.empty((n, lora1.rank(num_experts)), dtype=x.dtype, device=x.device) if save and lora1 else None
    ha = torch.empty((n, lora2.rank(num_experts)), dtype=x.dtype, device=x.device) if lora2 else None
    args1 = _lora_args(lora1, num_experts, "AtBt", x)
    _moe_gemm1_kernel[(route.max_tiles, triton.cdiv(inter, tiles.block_n1))](
        x,
        gate_up,
        gate_up if gate_up_bias is None else gate_up_bias,
        route.tiles,
        route.token,
        h,
        h if gu is None else gu,
        route.max_tiles,
        hidden,
        inter,
        x.stride(0),
        gate_up.stride(0),
        layout.w1_h,
        layout.w1_c,
        0 if gate_up_bias is None else gate_up_bias.stride(0),
        layout.col_step,
        layout.up_off,
        alpha,
        limit,
        args1[0],
        args1[1],
        h if xa is None else xa,
        *args1[2:],
        ACT=ACTS.index(act),
        HAS_BIAS=gate_up_bias is not None,
        SAVE=save,
        F32_DOT=f32,
        LORA=lora1 is not None,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n1,
        BLOCK_K=tiles.block_k,
        BLOCK_R=_block_r(args1[2]),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    y = torch.empty((n, hidden), dtype=x.dtype, device=x.device)  # (T k, H) by assignment
    args2 = _lora_args(lora2, num_experts, "AtBt", h)
    _moe_gemm2_kernel[(route.max_tiles, triton.cdiv(hidden, tiles.block_n2))](
        h,
        down,
        down if down_bias is None else down_bias,
        weights,
        route.tiles,
        route.assign,
        y,
        route.max_tiles,
        inter,
        hidden,
        down.stride(0),
        layout.w2_i,
        layout.w2_h,
        0 if down_bias is None else down_bias.stride(0),
        args2[0],
        args2[1],
        h if ha is None else ha,
        *args2[2:],
        HAS_BIAS=down_bias is not None,
        HAS_SCALE=True,
        F32_DOT=f32,
        LORA=lora2 is not None,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n2,
        BLOCK_K=tiles.block_k,
        BLOCK_R=_block_r(args2[2]),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return _sum_slots(y, route), (gu, xa, ha if save else None)


def _wgrad(a, b, out, logical_strides, p, q, route, weights, modes, *, options, block_p, block_q, scale=1.0, bias=None):
    """One weight-gradient pass: out[e][p, q] = scale sum over expert e's rows of A[row, p] B[row, q], written through
    `logical_strides` (expert, p, q) into `out` (a parameter's own layout, or peft's for the LoRA factors); `modes`
    (A_MODE, B_MODE, B_SCALE) say where A's and B's rows come from (see _moe_wgrad_kernel); `bias` receives B's
    column sums per expert."""
    layout, tiles = options["layout"], options["tiles"]
    _moe_wgrad_kernel[(route.offsets.numel() - 1, triton.cdiv(p, block_p), triton.cdiv(q, block_q))](
        a,
        b,
        weights,
        route.offsets,
        route.token,
        route.assign,
        out,
        out if bias is None else bias,
        p,
        q,
        a.stride(0),
        b.stride(0),
        *logical_strides,
        0 if bias is None else bias.stride(0),
        layout.col_step,
        layout.up_off,
        float(options["alpha"]),
        float(options["limit"]),
        float(scale),
        A_MODE=modes[0],
        B_MODE=modes[1],
        B_SCALE=modes[2],
        ACT=ACTS.index(options["act"]),
        HAS_BIAS=bias is not None,
        F32_DOT=_f32_dot(a),
        BLOCK_P=block_p,
        BLOCK_Q=block_q,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


# A_MODE: 0 sorted rows, 1 rows by token, 2 act(gate_up); B_MODE: 0 sorted, 1 by token; B_SCALE: times the top-k weight
_DOWN, _UP = (2, 1, True), (1, 0, False)


def moe_experts_bwd(
    dout,
    x,
    route,
    weights,
    gate_up,
    down,
    gate_up_bias,
    down_bias,
    saved,
    *,
    layout,
    act,
    alpha,
    limit,
    tiles,
    needs=(True,) * 6,
    lora=(None, None),
    lora_needs=(False,) * 4,
):
    """Backward. `saved`: the forward's (gate_up, x A^T, h A^T). `needs`: which of (dx, dweights, dgate_up, ddown,
    dgate_up_bias, ddown_bias) to return (the others are None; dweights always comes with the dgrad pass);
    `lora_needs`: which of (d lora_A, d lora_B of gate_up, of down). Returns the six, then the four (None where not
    needed). Gradients in their inputs' dtypes, dW in the parameters' own layouts (the LoRA factors' in peft's)."""
    gu, xa, ha = saved
    lora1, lora2 = lora
    (t, hidden), n, inter = x.shape, route.assign.numel(), layout.inter
    num_experts = gate_up.shape[0]
    f32 = _f32_dot(x)
    options = dict(layout=layout, act=act, alpha=alpha, limit=limit, tiles=tiles)
    alpha, limit, act_id = float(alpha), float(limit), ACTS.index(act)
    warps = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    dgu = torch.empty((n, 2 * inter), dtype=x.dtype, device=x.device)  # (N, 2I) d gate_up, parameter column order
    gb = torch.empty((n, lora2.rank(num_experts)), dtype=x.dtype, device=x.device) if lora2 else None
    blocks = triton.cdiv(inter, tiles.block_n1)
    dw_part = torch.empty((blocks, n), dtype=torch.float32, device=x.device)  # every element written once
    args2 = _lora_args(lora2, num_experts, "BA", dout)
    _moe_dgrad_kernel[(route.max_tiles, blocks)](
        dout,
        down,
        down if down_bias is None else down_bias,
        weights,
        gu,
        route.tiles,
        route.token,
        route.assign,
        dgu,
        dw_part,
        route.max_tiles,
        hidden,
        inter,
        n,
        dout.stride(0),
        down.stride(0),
        layout.w2_i,
        layout.w2_h,
        0 if down_bias is None else down_bias.stride(0),
        layout.col_step,
        layout.up_off,
        alpha,
        limit,
        args2[0],
        args2[1],
        dgu if gb is None else gb,
        *args2[2:],
        ACT=act_id,
        HAS_BIAS=down_bias is not None,
        F32_DOT=f32,
        LORA=lora2 is not None,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n1,
        BLOCK_K=tiles.block_k,
        BLOCK_R=_block_r(args2[2]),
        **warps,
    )
    d_weights = dw_part.sum(dim=0).view(t, route.k).to(weights.dtype) if needs[1] else None  # (T, k)
    dx = d_gate_up = d_down = d_gate_up_bias = d_down_bias = None
    dgb = None  # d gate_up B_gate_up (N, r): the dx pass gives it, dA_gate_up needs it
    if needs[0] or lora_needs[0]:
        dxbuf = torch.empty((n, hidden), dtype=x.dtype, device=x.device)  # (T k, H) by assignment
        dgb = torch.empty((n, lora1.rank(num_experts)), dtype=x.dtype, device=x.device) if lora1 else None
        args1 = _lora_args(lora1, num_experts, "BA", dgu)
        _moe_gemm2_kernel[(route.max_tiles, triton.cdiv(hidden, tiles.block_n2))](
            dgu,
            gate_up,
            gate_up,
            weights,
            route.tiles,
            route.assign,
            dxbuf,
            route.max_tiles,
            2 * inter,
            hidden,
            gate_up.stride(0),
            layout.w1_c,  # W1 read transposed: B[e][c, h]
            layout.w1_h,
            0,
            args1[0],
            args1[1],
            dgu if dgb is None else dgb,
            *args1[2:],
            HAS_BIAS=False,
            HAS_SCALE=False,
            F32_DOT=f32,
            LORA=lora1 is not None,
            BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n2,
            BLOCK_K=tiles.block_k,
            BLOCK_R=_block_r(args1[2]),
            **warps,
        )
        dx = _sum_slots(dxbuf, route) if needs[0] else None
    blocks_pq = dict(block_p=tiles.block_p, block_q=tiles.block_q)
    for down_pass, want_w, want_b in ((True, needs[3], needs[5]), (False, needs[2], needs[4])):
        bias = down_bias if down_pass else gate_up_bias
        want_b = want_b and bias is not None
        if not (want_w or want_b):
            continue
        weight = down if down_pass else gate_up
        dweight = torch.empty_like(weight)  # the parameter's own layout (empty_like keeps dense strides)
        dbias = torch.empty_like(bias) if want_b else None
        p, q = (inter, hidden) if down_pass else (hidden, 2 * inter)
        # the logical (P, Q) = (I, H) or (H, 2I) index of dW in the parameter's layout (as Layout reads the weight)
        strides = (dweight.stride(0), *(dweight.stride()[1:] if layout.transposed else dweight.stride()[:0:-1]))
        a, b = (gu, dout) if down_pass else (x, dgu)
        _wgrad(
            a,
            b,
            dweight,
            strides,
            p,
            q,
            route,
            weights,
            _DOWN if down_pass else _UP,
            options=options,
            bias=dbias,
            **blocks_pq,
        )
        if down_pass:
            d_down, d_down_bias = (dweight if want_w else None), dbias
        else:
            d_gate_up, d_gate_up_bias = (dweight if want_w else None), dbias
    lora_grads = [None] * 4
    for i, (lora, want) in enumerate(zip((lora1, lora1, lora2, lora2), lora_needs)):
        if not want:
            continue
        factor = lora.lora_A if i % 2 == 0 else lora.lora_B
        grad = torch.empty_like(factor)
        r = lora.rank(num_experts)
        br = _block_r(r)
        s0, s1 = grad.stride()
        if i == 0:  # dA_gate_up[e r + j, h] = s sum (dgu B)[row, j] x[token, h]
            _wgrad(
                dgb,
                x,
                grad,
                (r * s0, s0, s1),
                r,
                hidden,
                route,
                weights,
                (0, 1, False),
                options=options,
                block_p=br,
                block_q=tiles.block_q,
                scale=lora.scaling,
            )
        elif i == 1:  # dB_gate_up[c, j E + e] = s sum dgu[row, c] (x A^T)[row, j]
            _wgrad(
                dgu,
                xa,
                grad,
                (s1, s0, num_experts * s1),
                2 * inter,
                r,
                route,
                weights,
                (0, 0, False),
                options=options,
                block_p=tiles.block_p,
                block_q=br,
                scale=lora.scaling,
            )
        elif i == 2:  # dA_down[e r + j, i] = s sum h[row, i] w (dy B)[row, j]
            _wgrad(
                gu,
                gb,
                grad,
                (r * s0, s1, s0),
                inter,
                r,
                route,
                weights,
                (2, 0, True),
                options=options,
                block_p=tiles.block_p,
                block_q=br,
                scale=lora.scaling,
            )
        else:  # dB_down[h, j E + e] = s sum (h A^T)[row, j] w dy[token, h]
            _wgrad(
                ha,
                dout,
                grad,
                (s1, num_experts * s1, s0),
                r,
                hidden,
                route,
                weights,
                (0, 1, True),
                options=options,
                block_p=br,
                block_q=tiles.block_q,
                scale=lora.scaling,
            )
        lora_grads[i] = grad
    return (dx, d_weights, d_gate_up, d_down, d_gate_up_bias, d_down_bias, *lora_grads)


def _loras(a1, b1, a2, b2, scalings) -> tuple[ExpertLoRA | None, ExpertLoRA | None]:
    return tuple(
        None if a is None else ExpertLoRA(a, b, s) for a, b, s in ((a1, b1, scalings[0]), (a2, b2, scalings[1]))
    )


def _backward(ctx, dout, tensors, saved, lora=(None, None), lora_needs=(False,) * 4):
    """moe_experts_bwd for either Function: `tensors` (x, weights, gate_up, down, gate_up_bias, down_bias)."""
    x, weights, gate_up, down, gate_up_bias, down_bias = tensors
    return moe_experts_bwd(
        _unit_col(dout),
        x,
        ctx.route,
        weights,
        gate_up,
        down,
        gate_up_bias,
        down_bias,
        saved,
        needs=ctx.needs_input_grad[:6],
        lora=lora,
        lora_needs=lora_needs,
        **ctx.options,
    )


class MoEExpertsFunction(torch.autograd.Function):
    """Autograd over the launchers. Saves x, the top-k weights, the parameters, the routing and the pre-activation
    gate_up (N, 2I) in x's dtype; h is recomputed from it where the backward needs it."""

    @staticmethod
    def forward(ctx, x, weights, gate_up, down, gate_up_bias, down_bias, route, options):
        save = any(ctx.needs_input_grad[:6])
        out, saved = moe_experts_fwd(x, route, weights, gate_up, down, gate_up_bias, down_bias, save=save, **options)
        if save:
            ctx.save_for_backward(x, weights, gate_up, down, gate_up_bias, down_bias, saved[0])
            ctx.route, ctx.options = route, options
        return out

    @staticmethod
    def backward(ctx, dout):
        *tensors, gu = ctx.saved_tensors
        return (*_backward(ctx, dout, tensors, (gu, None, None))[:6], None, None)


class MoEExpertsLoRAFunction(torch.autograd.Function):
    """MoEExpertsFunction with peft's LoRA on gate_up and/or down as two more grouped GEMMs on the same rows (the
    adapter's x A^T and B fused into the base kernels' loops and epilogues, module docstring): also saves x A^T and
    h A^T (N, r each), and the backward adds the factors' gradients, four grouped GEMMs of rank r."""

    @staticmethod
    def forward(ctx, x, weights, gate_up, down, gate_up_bias, down_bias, a1, b1, a2, b2, route, options, scalings):
        save = any(ctx.needs_input_grad[:10])
        lora = _loras(a1, b1, a2, b2, scalings)
        out, saved = moe_experts_fwd(
            x, route, weights, gate_up, down, gate_up_bias, down_bias, save=save, lora=lora, **options
        )
        if save:
            ctx.save_for_backward(x, weights, gate_up, down, gate_up_bias, down_bias, a1, b1, a2, b2, *saved)
            ctx.route, ctx.options, ctx.scalings = route, options, scalings
        return out

    @staticmethod
    def backward(ctx, dout):
        saved = ctx.saved_tensors
        tensors, factors = saved[:6], saved[6:10]
        lora = _loras(*factors, ctx.scalings)
        grads = _backward(ctx, dout, tensors, tuple(saved[10:]), lora, ctx.needs_input_grad[6:10])
        return (*grads, None, None, None)


def moe_experts(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    *,
    transposed: bool = False,
    interleaved: bool = False,
    act: str = "silu",
    alpha: float = GPT_OSS_ALPHA,
    limit: float = GPT_OSS_LIMIT,
    gate_up_lora: ExpertLoRA | None = None,
    down_lora: ExpertLoRA | None = None,
) -> torch.Tensor:
    """The routed experts' output (T, H) in x's dtype (see the module docstring for the math and layouts), with
    peft's LoRA on gate_up and/or down when given (ExpertLoRA: never the (E, out, in) delta).

    CUDA tensors run the Triton grouped GEMMs, CPU tensors the reference (`kernels._dispatch`)."""
    _check_args(x, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, transposed, act)
    _check_loras(gate_up_proj, down_proj, transposed, gate_up_lora, down_lora)
    loras = (gate_up_lora, down_lora)
    factors = [t for lora in loras if lora is not None for t in (lora.lora_A, lora.lora_B)]
    tensors = (x, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, *factors)
    if not use_triton(*tensors) or x.dtype not in _DTYPES or top_k_index.numel() == 0:
        return moe_experts_ref(
            x,
            top_k_index,
            top_k_weights,
            gate_up_proj,
            down_proj,
            gate_up_bias,
            down_bias,
            transposed=transposed,
            interleaved=interleaved,
            act=act,
            alpha=alpha,
            limit=limit,
            gate_up_lora=gate_up_lora,
            down_lora=down_lora,
        )
    tiles = (GPU_TILES_F32 if x.dtype == torch.float32 else GPU_TILES) if x.is_cuda else CPU_TILES
    route = moe_route(top_k_index, gate_up_proj.shape[0], tiles.block_m)
    options = dict(
        layout=Layout.of(gate_up_proj, down_proj, transposed, interleaved),
        act=act,
        alpha=float(alpha),
        limit=float(limit),
        tiles=tiles,
    )
    args = (_unit_col(x), top_k_weights.contiguous(), gate_up_proj, down_proj, _unit_col(gate_up_bias))
    args += (_unit_col(down_bias),)
    if gate_up_lora is None and down_lora is None:
        return MoEExpertsFunction.apply(*args, route, options)
    factors = tuple(t for lora in loras for t in ((None, None) if lora is None else (lora.lora_A, lora.lora_B)))
    scalings = tuple(0.0 if lora is None else float(lora.scaling) for lora in loras)
    return MoEExpertsLoRAFunction.apply(*args, *factors, route, options, scalings)


def moe_experts_grouped_mm(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    *,
    transposed: bool = False,
    interleaved: bool = False,
    act: str = "silu",
    alpha: float = GPT_OSS_ALPHA,
    limit: float = GPT_OSS_LIMIT,
) -> torch.Tensor:
    """The same op through `torch._grouped_mm` (transformers 5's "grouped_mm" experts, torchtitan's MoE): the rows
    gathered into expert order, two grouped GEMMs, the activation and the weighting in PyTorch, `index_add` back.
    Differentiable by autograd. Needs H, I and 2I times the element size to be multiples of 16 bytes."""
    _check_args(x, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, transposed, act)
    if not hasattr(torch, "_grouped_mm"):
        raise RuntimeError(f"moe_experts_grouped_mm: this torch ({torch.__version__}) has no torch._grouped_mm")
    t, k = top_k_index.shape
    num_experts, hidden = gate_up_proj.shape[0], x.shape[1]
    inter = down_proj.shape[1] if transposed else down_proj.shape[2]
    if (hidden * x.element_size()) % 16 or (inter * x.element_size()) % 16:
        raise ValueError(
            f"moe_experts_grouped_mm: torch._grouped_mm needs 16-byte aligned rows: hidden {hidden} and intermediate "
            f"{inter} in {x.dtype} are not"
        )
    with torch.no_grad():
        sorted_e, order = torch.sort(top_k_index.reshape(-1), stable=True)  # (N,)
        bounds = torch.arange(1, num_experts + 1, device=x.device, dtype=sorted_e.dtype)
        ends = torch.searchsorted(sorted_e, bounds).to(torch.int32)  # (E,) end row of each expert
        token = order // k  # (N,)
    w1 = gate_up_proj if transposed else gate_up_proj.transpose(1, 2)  # (E, H, 2I)
    gate_up = torch._grouped_mm(x[token], w1, offs=ends)  # (N, 2I)
    if gate_up_bias is not None:
        gate_up = gate_up + gate_up_bias[sorted_e]
    h = expert_act(*split_gate_up(gate_up, interleaved), act, alpha, limit)  # (N, I)
    w2 = down_proj if transposed else down_proj.transpose(1, 2)  # (E, I, H)
    y = torch._grouped_mm(h, w2, offs=ends)  # (N, H)
    if down_bias is not None:
        y = y + down_bias[sorted_e]
    y = y * top_k_weights.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add(0, token, y.to(x.dtype))
