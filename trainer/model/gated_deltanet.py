"""Gated DeltaNet: the linear-attention layer of Qwen3.5 and Qwen3-Next (three of every four decoder layers), in our
model's terms (issue 45). Its parameters carry transformers' names and shapes (`Qwen3_5GatedDeltaNet`), so a
checkpoint's `model.layers.{i}.linear_attn.*` load as they are:

    in_proj_qkv: C -> 2 Hk K + Hv V       q, k, v for every head, through the causal conv below
    in_proj_z:   C -> Hv V                the output gate
    in_proj_b, in_proj_a: C -> Hv         beta = sigmoid(b); decay g = -exp(A_log) softplus(a + dt_bias)
    conv1d:      depthwise, W taps        causal over the tokens, then SiLU (`kernels.causal_conv1d`: Triton on CUDA)
    norm:        RMSNorm(V) gated         norm(o) * silu(z) per head (`kernels.gated_rms_norm` with our kernels,
                                          else `gated_rms_norm_plain`: transformers' casts)
    out_proj:    Hv V -> C
Qwen3-Next's layer (`Qwen3NextGatedDeltaNet`, `fused_projections`) computes the same four from two projections whose
rows are grouped by key head, each group [q (K) | k (K) | v (r V) | z (r V)] and [b (r) | a (r)], r = Hv / Hk:

    in_proj_qkvz: C -> Hk (2 K + 2 r V)   regrouped into Qwen3.5's [all q | all k | all v] before the conv, and z
    in_proj_ba:   C -> Hk 2 r             regrouped into b and a, each (Hv,)

The recurrence is `kernels.chunk_gated_delta_rule` with q and k l2-normalised (Qwen3.5's `use_qk_l2norm_in_kernel`):
flash-linear-attention's kernels on a GPU where fla-core is installed, the chunked reference otherwise (and always with
our kernels off; one decoded token at a time, the token-by-token rule). Packed rows are exact: with `cu_seqlens` the
convolution and the recurrence restart at every sequence boundary, so a packed batch gives each sequence's outputs and
gradients as if it ran alone (what transformers' pure-PyTorch fallback does not do: it passes the boundaries to
neither). `decode` carries the convolution's last inputs and the recurrent state from call to call (KVCache's
`states`: trainer/model/attention.py).
With our kernels the convolution + SiLU and the gated norm are ours in Triton (`kernels.causal_conv1d`,
`kernels.gated_rms_norm`); the decay and beta gating and the q/k L2 norm run in PyTorch (or inside fla's op).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels.causal_conv1d import causal_conv1d_ref
from kernels.gated_delta_rule import chunk_gated_delta_rule_ref, gated_delta_rule_ref


def gated_rms_norm_plain(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) * silu(gate) over the last dim, cast as transformers' Qwen3_5RMSNormGated casts: the
    statistics in fp32, the normalised rows back to x's dtype before the weight, the gate's SiLU in fp32, the product
    in x's dtype."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(gate.float())).to(dtype)


class GatedRMSNorm(nn.Module):
    """The gated norm with its weight (transformers' `norm.weight` of a Gated DeltaNet layer): `kernels.gated_rms_norm`
    (fp32 to one final cast) when `impl` is "kernels" (set model-wide by CausalLM), else `gated_rms_norm_plain`
    (liger-kernel has none)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.impl = "kernels"

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.impl == "kernels":
            return kernels.gated_rms_norm(x, gate, self.weight, self.eps)
        return gated_rms_norm_plain(x, gate, self.weight, self.eps)


class CausalConv1d(nn.Module):
    """The depthwise causal convolution + SiLU with nn.Conv1d's parameter (a (D, 1, W) `weight`, no bias: a
    checkpoint's `linear_attn.conv1d.weight`): `kernels.causal_conv1d` when `impl` is "kernels", else its reference.
    The weight is read inside this module's own forward, so an engine that gathers a module's parameters around its
    forward (DeepSpeed ZeRO-3) holds it there."""

    def __init__(self, dim: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, 1, width))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)  # nn.Conv1d's own init (CausalLM.init_weights draws its own)
        self.impl = "kernels"

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        conv = kernels.causal_conv1d if self.impl == "kernels" else causal_conv1d_ref
        return conv(x, self.weight.squeeze(1), None, "silu", cu_seqlens)


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        eps: float,
        fused_projections: bool = False,
    ):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"GatedDeltaNet: linear_num_value_heads ({num_v_heads}) must be a multiple of linear_num_key_heads "
                f"({num_k_heads})"
            )
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        conv_dim = 2 * self.key_dim + self.value_dim
        self.fused_projections = fused_projections
        if fused_projections:  # Qwen3-Next's layout (the module docstring)
            self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.conv_dim, self.conv_kernel = conv_dim, conv_kernel
        self.conv1d = CausalConv1d(conv_dim, conv_kernel)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.impl = "kernels"  # the recurrence: kernels.chunk_gated_delta_rule, else its reference (CausalLM sets it)

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C). `cu_seqlens`: the sequences packed into a row (B = 1); `attention_mask` (B, T):
        padding zeroed before the projections, as transformers does."""
        return self._mix(x, cu_seqlens, attention_mask, None)[0]

    def decode(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None, attention_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """(output, state after x) for the next tokens x (B, t, C) of rows whose state so far is `state`: the last
        W - 1 inputs of the convolution (B, W - 1, D) and the recurrent state (B, Hv, K, V) in fp32; None before the
        first token (zeros: the convolution's left padding, an empty memory). Equal to `forward` over the whole rows
        (the state carries everything the rows' earlier tokens contribute)."""
        if state is None:
            conv = x.new_zeros(x.shape[0], self.conv_kernel - 1, self.conv_dim)
            memory = x.new_zeros(x.shape[0], self.num_v_heads, self.head_k_dim, self.head_v_dim, dtype=torch.float32)
            state = conv, memory
        return self._mix(x, None, attention_mask, state)

    def _mix(self, x, cu_seqlens, attention_mask, state):
        if attention_mask is not None:
            x = (x * attention_mask[:, :, None]).to(x.dtype)
        B, T, _ = x.shape
        mixed, z, b, a = self._projections(x)  # (B, T, D) before the convolution, (B, T, Hv, V), (B, T, Hv) twice
        if state is None:
            qkv = self.conv1d(mixed, cu_seqlens)
        else:  # the convolution over the state's last inputs and these; its new state the last W - 1 of them
            window = torch.cat([state[0], mixed], dim=1)  # (B, W - 1 + T, D)
            qkv = self.conv1d(window)[:, -T:]
            conv_state = window[:, window.shape[1] - state[0].shape[1] :]
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(B, T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(B, T, self.num_v_heads, self.head_v_dim)
        beta = b.sigmoid()  # (B, T, Hv)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # (B, T, Hv), <= 0
        # one token at a time when decoding (the chunked form's setup costs more than one step of the recurrence)
        if state is not None and T == 1:
            rule = gated_delta_rule_ref
        else:  # fla's kernels on a GPU with our kernels on (where installed), else the chunked reference
            rule = kernels.chunk_gated_delta_rule if self.impl == "kernels" else chunk_gated_delta_rule_ref
        o, memory = rule(
            q,
            k,
            v,
            g,
            beta,
            initial_state=None if state is None else state[1],
            output_final_state=state is not None,
            cu_seqlens=cu_seqlens,
            use_qk_l2norm=True,
        )
        out = self.out_proj(self.norm(o, z).reshape(B, T, self.value_dim))
        return out, (None if state is None else (conv_state, memory))

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, C) -> the convolution's input [q | k | v] (B, T, D), z (B, T, Hv, V), b and a (B, T, Hv)."""
        B, T, _ = x.shape
        if not self.fused_projections:
            z = self.in_proj_z(x).reshape(B, T, self.num_v_heads, self.head_v_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        r, K = self.num_v_heads // self.num_k_heads, self.head_k_dim
        qkvz = self.in_proj_qkvz(x).view(B, T, self.num_k_heads, 2 * K + 2 * r * self.head_v_dim)
        q, k, v, z = qkvz.split([K, K, r * self.head_v_dim, r * self.head_v_dim], dim=-1)
        mixed = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
        b, a = self.in_proj_ba(x).view(B, T, self.num_k_heads, 2 * r).split([r, r], dim=-1)
        z = z.reshape(B, T, self.num_v_heads, self.head_v_dim)
        return mixed, z, b.reshape(B, T, self.num_v_heads), a.reshape(B, T, self.num_v_heads)
