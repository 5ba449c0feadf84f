"""Causal self-attention for packed and padded batches, on three backends, never across documents.

A batch row may hold several documents packed end to end; a document begins wherever `position_ids` do
not continue the previous token's by +1 (normally a restart at 0; the rule of transformers' packed-sequence
detection and of `kernels.neftune_noise`), and `attention_mask` (1 = token, 0 = padding) marks padding. Every backend
applies the same rule: query i may attend key j iff j <= i (index order), both
lie in the same document, key j is not padding, and, for sliding-window layers, i - j < window (Hugging
Face's convention: a window of W sees W keys including itself).

Backends, chosen per forward by `make_plan` (`backend="auto"`):
- "flash" (CUDA, fp16/bf16, `flash_attn` importable): `flash_attn_varlen_func` on the unpadded tokens
  with `cu_seqlens` at document boundaries; padding never enters the kernel. Building the index costs
  host syncs (`nonzero`, once per forward), which every varlen implementation pays.
- "flex" (CUDA otherwise, when there are documents, padding or a sliding window to honour):
  `torch.nn.attention.flex_attention` (compiled) with a `BlockMask` from the document ids; no (T, T) mask
  is materialised and no host sync happens. Also runs eagerly on CPU (forward only), which is how its mask
  logic is tested here.
- "sdpa" (CPU; and CUDA for plain causal rows): `F.scaled_dot_product_attention` with `is_causal=True`, per
  document: no (T, T) mask is ever built, so memory is linear in T (PyTorch's CPU and CUDA kernels work in
  tiles; a 110,000-token packed row needs no 12 GB mask). Rows with nothing to separate (one document each,
  padding only after the last real token, which causal order already hides) run as one batched call; otherwise
  the real tokens are split at document boundaries, as for the varlen kernel, and each document attends alone.
  A window shorter than a document runs in blocks of `window` queries against their 2 * window - 1 keys.
  (Padding inside a document, which our batching never makes, is dropped before the window is counted on flash
  and on sdpa alike: there a window spans `window` real tokens.)
Attention sinks (gpt_oss: `attend(..., sinks)`, a learned logit per head in every softmax's denominator, with no value:
out_i = sum_j exp(s_ij) v_j / (exp(sink_h) + sum_j exp(s_ij)), transformers' eager_attention_forward), exact and with
gradients to the sinks where each backend runs them:
- sdpa (CPU, and CUDA for plain causal rows): inside SDPA itself (`sdpa`): the sink is one more key before all others,
  seen by every query, scored sink_h through SINK_PAD extra channels of q and k, its value zero; the causal case stays
  mask-free (one zero query first, its row dropped), masks gain a first column of True. So every rule above (documents,
  padding, windows, the KV cache's decoding) holds with sinks as without; tested against transformers' explicit
  softmax, gradients included (tests/trainer/model/test_attention.py). Costs one copy of q, k and v with 8 more
  channels per layer.
- flex (CUDA): the output without sinks times sigmoid(lse - sink_h) (flex's differentiable log-sum-exp,
  `return_aux=AuxRequest(lse=True)`). Its forward is tested here eagerly on CPU; its backward (CUDA only) is not yet
  run by a test.
- flash: flash-attn's kernel has no sink term: `make_plan(sinks=True)` never picks it under "auto" (CUDA then takes
  flex, or sdpa for plain causal rows), and refuses it when asked for (AttentionError), never dropping the sinks.
GQA: key/value heads are shared by `n_heads // n_kv_heads` query heads (`enable_gqa`, no copies).
Outputs at padding positions are not defined (they are never read: padding is no target and no real query
attends to it): zeros on flash and on sdpa's per-document path, whatever the backend computes otherwise.

Shapes: q (B, T, H, D), k and v (B, T, Hkv, D), output (B, T, H, D).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import (
    _DEFAULT_SPARSE_BLOCK_SIZE,
    AuxRequest,
    BlockMask,
    _create_sparse_block_from_block_mask,
    flex_attention,
)

BACKENDS = ("auto", "sdpa", "flex", "flash")


class AttentionError(ValueError):
    """An attention backend that was asked for and cannot run, in one line."""


SINKS_ON_FLASH = (
    "attention backend 'flash' cannot add attention sinks (gpt_oss: flash-attn's varlen kernel has no sink term); "
    "use sdpa or flex (backend auto picks flex on CUDA)"
)


def _flash_attn():
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # not installed, or built for another torch/CUDA: fall back, say so only when forced
        return None
    return flash_attn_varlen_func


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Per-token document index within its row: how many documents start up to and including the token."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)  # (B, T); t = 0 always starts one
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts.cumsum(-1)  # (B, T)


def flex_mask_mod(window: int | None, doc: torch.Tensor | None, valid: torch.Tensor | None):
    """flex attention's mask function: causal, within `window` keys when given, within the query's document (doc:
    (B, T) ids) and to real keys only (valid: (B, T) bool). Broadcasts over index tensors as well as vmap's scalars."""

    def mask_mod(b, h, qi, ki):
        ok = ki <= qi
        if window is not None:
            ok = ok & (qi - ki < window)
        if doc is not None:
            ok = ok & (doc[b, qi] == doc[b, ki])
        if valid is not None:
            ok = ok & valid[b, ki]
        return ok

    return mask_mod


# (query, key) pairs a block mask evaluates at once: ~10 bytes each (the bool mask and the int64 index arithmetic of
# the mask function), so a slab stays near 170 MB however long the rows are.
MASK_PAIRS = 1 << 24


def block_mask(mask_mod, rows: int, seq_len: int, device, block: int = _DEFAULT_SPARSE_BLOCK_SIZE) -> BlockMask:
    """torch's `create_block_mask(mask_mod, rows, None, seq_len, seq_len, device)`, the same BlockMask, without the
    dense (rows, T, T) mask it evaluates first: the mask function runs on slabs of whole query blocks against every
    key (MASK_PAIRS pairs at most, one block at least), each slab reduced to its blocks' counts at once, so the
    transient is (rows, slab, T) instead of (rows, T, T) (~10 B a pair: 104 GB at 101,888 tokens, a slab of 128
    queries 130 MB). `mask_mod(b, h, q, k)` must broadcast over index tensors (b (rows, 1, 1), q (1, Q, 1), k (1, 1,
    T)), as ours do; torch calls it under vmap, one index at a time. Blocks past the end count as masked, as torch's
    padding makes them."""
    n_blocks = -(-seq_len // block)
    slab = max(1, MASK_PAIRS // (block * block * n_blocks))  # query blocks a slab
    b = torch.arange(rows, device=device)[:, None, None]  # (rows, 1, 1)
    keys = torch.arange(seq_len, device=device)[None, None, :]  # (1, 1, T)
    counts = []
    for first in range(0, n_blocks, slab):
        stop = min(first + slab, n_blocks)
        queries = torch.arange(first * block, min(stop * block, seq_len), device=device)  # (Q,)
        mask = mask_mod(b, 0, queries[None, :, None], keys).expand(rows, len(queries), seq_len)  # (rows, Q, T)
        mask = F.pad(mask, (0, n_blocks * block - seq_len, 0, (stop - first) * block - len(queries)))
        counts.append(mask.view(rows, stop - first, block, n_blocks, block).sum(dim=(2, 4)))  # (rows, slab, blocks)
    count = torch.cat(counts, dim=1)[:, None]  # (rows, 1, blocks, blocks)
    full = count == block * block
    partial = (count > 0) & ~full
    return _create_sparse_block_from_block_mask(
        (partial.to(torch.int8), full.to(torch.int8)), mask_mod, (seq_len, seq_len), block, block
    )


@dataclass
class AttentionPlan:
    """Everything the layers need to attend correctly, built once per forward and shared by all layers."""

    backend: str
    batch: int
    seq_len: int
    device: torch.device
    doc_ids: torch.Tensor | None  # (B, T) or None: one document per row
    key_valid: torch.Tensor | None  # (B, T) bool or None: no padding
    flash_index: tuple | None = None  # (token indices, cu_seqlens, max_seqlen) for the varlen kernel
    # sdpa, and any backend for linear-attention layers (`recur`): (token indices or None, document boundaries) of the
    # flattened (B * T) tokens, as python ints; None: the rows have nothing to separate and run in one batched call
    documents: tuple[torch.Tensor | None, list[int]] | None = None
    _masks: dict = field(default_factory=dict)  # window -> flex BlockMask
    _cu_seqlens: torch.Tensor | None = None  # `documents`' boundaries as the linear-attention layers take them

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`sinks` (H,): each head's sink logit (gpt_oss), or None."""
        window = _effective(window, self.seq_len)
        if self.backend == "flash":
            if sinks is not None:  # make_plan(sinks=True) never plans it: never drop the sinks silently
                raise AttentionError(SINKS_ON_FLASH)
            return self._flash(q, k, v, window)
        if self.backend == "sdpa":
            return self._sdpa(q, k, v, window, sinks)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        gqa, mask = q.shape[2] != k.shape[2], self._masks[window]
        if sinks is None:
            out = _flex_fn(q.is_cuda)(qt, kt, vt, block_mask=mask, enable_gqa=gqa)
        else:
            out, aux = _flex_fn(q.is_cuda)(qt, kt, vt, block_mask=mask, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
            out = out * torch.sigmoid(aux.lse - sinks.to(aux.lse.dtype)[:, None])[..., None].to(
                out.dtype
            )  # (B, H, T, D)
        return out.transpose(1, 2)  # (B, T, H, D)

    def recur(self, layer, x: torch.Tensor) -> torch.Tensor:
        """A linear-attention layer (`layer(x, cu_seqlens=...)`, trainer/model/gated_deltanet.py) over x (B, T, C), each
        document alone: the rows' real tokens flattened into one packed row whose recurrence and convolution restart
        at every document boundary (`cu_seqlens`), padding left out (its outputs zero); in one batched call when
        there is nothing to separate."""
        if self.documents is None:
            return layer(x)
        index, bounds = self.documents
        B, T, C = x.shape
        flat = x.reshape(B * T, C)
        if index is not None:
            flat = flat.index_select(0, index)  # (N, C) real tokens only
        if self._cu_seqlens is None:  # once per forward, shared by every linear-attention layer
            self._cu_seqlens = torch.tensor(bounds)
        out = layer(flat[None], cu_seqlens=self._cu_seqlens)[0]  # (N, C)
        if index is not None:
            out = out.new_zeros(B * T, C).index_copy(0, index, out)
        return out.view(B, T, C)

    def build_masks(self, windows) -> None:
        # Built eagerly, outside the layers, so that a per-block torch.compile sees only tensor reads.
        if self.backend == "flex":
            for window in {_effective(w, self.seq_len) for w in windows}:
                self._masks[window] = self._flex_mask(window)

    def _sdpa(self, q, k, v, window, sinks):
        if self.documents is None:
            return causal_attention(q, k, v, window, sinks)
        return _per_document(q, k, v, window, sinks, *self.documents)

    def _flex_mask(self, window):
        doc, valid = self.doc_ids, self.key_valid
        rows = self.batch if (doc is not None or valid is not None) else 1  # 1: one mask for all rows
        return block_mask(flex_mask_mod(window, doc, valid), rows, self.seq_len, self.device)

    def _flash(self, q, k, v, window):
        fn = _flash_attn()
        B, T, H, D = q.shape
        index, cu_seqlens, max_seqlen = self.flash_index
        qf = q.reshape(B * T, H, D).index_select(0, index)  # (N, H, D) real tokens only
        kf = k.reshape(B * T, k.shape[2], D).index_select(0, index)  # (N, Hkv, D)
        vf = v.reshape(B * T, v.shape[2], D).index_select(0, index)  # (N, Hkv, D)
        # flash-attn's window (left, right) counts keys besides the query itself: HF's W -> (W - 1, 0)
        out = fn(
            qf,
            kf,
            vf,
            cu_seqlens,
            cu_seqlens,
            max_seqlen,
            max_seqlen,
            causal=True,
            window_size=(-1, -1) if window is None else (window - 1, 0),
        )  # (N, H, D)
        full = out.new_zeros(B * T, H, D)
        full.index_copy_(0, index, out)
        return full.view(B, T, H, D)


# Eager inside a per-block torch.compile: the loop follows the batch's document lengths (python ints), which a
# compiled graph would specialise on, recompiling for every new packing.
@torch.compiler.disable
def _per_document(q, k, v, window, sinks, index, bounds):
    """`causal_attention` of each document of the flattened tokens on its own: documents are (start, end) of
    consecutive `bounds` in the (B * T) tokens, or in those `index` keeps (padding dropped, its outputs zero)."""
    B, T, H, D = q.shape
    qf, kf, vf = (x.reshape(B * T, x.shape[2], D) for x in (q, k, v))  # (B * T, heads, D)
    if index is not None:
        qf, kf, vf = (x.index_select(0, index) for x in (qf, kf, vf))  # (N, heads, D)
    out = torch.cat(
        [
            causal_attention(qf[None, s:e], kf[None, s:e], vf[None, s:e], window, sinks)[0]
            for s, e in zip(bounds[:-1], bounds[1:])
        ]
    )  # (N, H, D)
    if index is not None:
        out = out.new_zeros(B * T, H, D).index_copy(0, index, out)
    return out.view(B, T, H, D)


_compiled_flex = None


def _flex_fn(on_cuda: bool):
    global _compiled_flex
    if not on_cuda:
        return flex_attention  # eager (unfused, materialises scores): for testing the mask logic on CPU
    if _compiled_flex is None:
        # uncompiled flex materialises the full score matrix; compiled it is a fused kernel. Default dynamism:
        # the second distinct sequence length compiles a dynamic-shape kernel instead of one per length
        # (dynamic batching changes T every step and would exhaust the recompile limit).
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def _effective(window: int | None, seq_len: int) -> int | None:
    # a window that covers the whole row is plain causal attention: share its mask (or is_causal path)
    return None if window is None or window >= seq_len else window


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal attention of (B, L, H, D) queries over (B, L, Hkv, D) keys/values within `window`, in memory linear in
    L: SDPA's `is_causal` (tiled kernels, no mask tensor), or with a window shorter than L, blocks of `window`
    queries each against its own 2 * window - 1 keys (a (window, 2 * window - 1) mask per block). `sinks` (H,) or
    None: each head's sink logit (`sdpa`)."""
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, L, D)
    gqa, L = q.shape[2] != k.shape[2], q.shape[1]
    if window is None or window >= L:
        out = sdpa(qt, kt, vt, sinks, is_causal=True, enable_gqa=gqa)
    else:
        blocks = []
        for start in range(0, L, window):
            end, first_key = min(start + window, L), max(0, start - window + 1)
            mask = causal_mask(end - start, end - first_key, window, q.device)  # (block, keys)
            blocks.append(
                sdpa(
                    qt[:, :, start:end],
                    kt[:, :, first_key:end],
                    vt[:, :, first_key:end],
                    sinks,
                    attn_mask=mask,
                    enable_gqa=gqa,
                )
            )
        out = torch.cat(blocks, dim=2)
    return out.transpose(1, 2)  # (B, L, H, D)


SINK_PAD = 8  # channels appended to q and k for the sink key: keeps the head size a multiple of 8 (CUDA's kernels)


def sdpa(
    qt: torch.Tensor,
    kt: torch.Tensor,
    vt: torch.Tensor,
    sinks: torch.Tensor | None,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention` of (B, H, Lq, D) queries over (B, Hkv, Lk, D) keys/values (scale D^-1/2), and
    with `sinks` (H,) each head's softmax also holds its sink logit in its denominator, with no value (gpt_oss):

        out_i = sum_j exp(s_ij) v_j / (exp(sink_h) + sum_j exp(s_ij))

    computed by SDPA itself, exactly and differentiably (gradients reach the sinks through SDPA's own backward), as
    one more key before all others that every query sees: q gains SINK_PAD channels [sink_h / scale, 0, ...], every
    key zeros there, the sink key [0 ... 0, 1, 0, ...] (so its score is scale x sink_h / scale = sink_h: exact when
    the scale is a power of two, head sizes 4, 16, 64, 256; otherwise within one rounding) and its value zero. The
    causal case stays mask-free: one zero query is put first too, so that `is_causal` on the square (L + 1) problem
    lets query i see the sink and keys 0..i; its output row is dropped. A mask gains a first column of True."""
    if sinks is None:
        return F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa
        )
    B, H, Lq, D = qt.shape
    Bk, Hkv, _, _ = kt.shape
    scale = D**-0.5
    logit = (
        (sinks.to(torch.promote_types(sinks.dtype, torch.float32)) / scale)
        .to(qt.dtype)
        .view(1, H, 1, 1)
        .expand(B, H, Lq, 1)
    )  # (B, H, Lq, 1)
    qs = torch.cat([qt, logit, qt.new_zeros(B, H, Lq, SINK_PAD - 1)], dim=-1)  # (B, H, Lq, D + PAD)
    ks = F.pad(kt, (0, SINK_PAD))  # (B, Hkv, Lk, D + PAD)
    sink_key = kt.new_zeros(D + SINK_PAD)
    sink_key[D] = 1
    ks = torch.cat([sink_key.expand(Bk, Hkv, 1, D + SINK_PAD), ks], dim=2)  # (B, Hkv, 1 + Lk, D + PAD)
    vs = F.pad(vt, (0, 0, 1, 0))  # (B, Hkv, 1 + Lk, Dv): the sink's value is zero
    if is_causal:
        qs = F.pad(qs, (0, 0, 1, 0))  # (B, H, 1 + Lq, D + PAD): a zero query first, its row dropped
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=enable_gqa)
        return out[:, :, 1:]  # (B, H, Lq, Dv)
    if attn_mask is not None:
        attn_mask = F.pad(attn_mask, (1, 0), value=True)  # (..., Lq, 1 + Lk): every query sees the sink
    return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa)


def causal_mask(q_len: int, k_len: int, window: int | None, device) -> torch.Tensor:
    """(q_len, k_len) bool: the last q_len positions of a k_len sequence attend causally, within `window`."""
    qi = torch.arange(k_len - q_len, k_len, device=device)[:, None]  # (Tq, 1) absolute query index
    ki = torch.arange(k_len, device=device)[None, :]  # (1, Tk)
    allowed = ki <= qi
    if window is not None:
        allowed = allowed & (qi - ki < window)
    return allowed  # (Tq, Tk)


def make_plan(
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    batch: int,
    seq_len: int,
    device: torch.device,
    dtype: torch.dtype,
    windows=(None,),
    backend: str = "auto",
    recurrent: bool = False,
    sinks: bool = False,
) -> AttentionPlan:
    """Resolve the backend and precompute what it needs to keep documents and padding apart (with `recurrent`, also
    what linear-attention layers need: `AttentionPlan.recur`). `sinks`: the layers add attention sinks, which flash
    cannot (auto never picks it then; asked for, it is refused)."""
    if backend not in BACKENDS:
        raise AttentionError(f"attention backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "auto":
        plain_causal = (
            position_ids is None and attention_mask is None and all(_effective(w, seq_len) is None for w in windows)
        )
        if device.type != "cuda":
            backend = "sdpa"
        elif _flash_attn() is not None and dtype in (torch.float16, torch.bfloat16) and not sinks:
            backend = "flash"
        else:  # nothing to separate: SDPA's is_causal runs PyTorch's own flash kernel, faster than flex
            backend = "sdpa" if plain_causal else "flex"
    if backend == "flash":
        if sinks:
            raise AttentionError(SINKS_ON_FLASH)
        if _flash_attn() is None:
            raise AttentionError(
                "attention backend 'flash' needs flash-attn (pip install flash-attn --no-build-isolation)"
            )
        if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
            raise AttentionError(
                f"attention backend 'flash' needs fp16/bf16 CUDA tensors, got {dtype} on {device.type}"
            )
    doc = document_ids(position_ids) if position_ids is not None else None
    valid = attention_mask.to(device=device, dtype=torch.bool) if attention_mask is not None else None
    plan = AttentionPlan(backend, batch, seq_len, device, doc, valid)
    if backend == "flash":
        plan.flash_index = _varlen_index(doc, valid, batch, seq_len, device)
    if backend == "sdpa" or recurrent:
        plan.documents = _sdpa_documents(doc, valid, batch, seq_len, device)
    plan.build_masks(windows)
    return plan


def _sdpa_documents(doc, valid, B, seq_len, device):
    """What the sdpa path separates (host syncs, as every varlen path pays): None when every row is one document
    whose padding, if any, follows its last real token (causal order hides it); else (token indices without the
    padding, or None when there is none, and the boundaries of each (row, document) in those tokens)."""
    if valid is not None and bool((valid[:, 1:] <= valid[:, :-1]).all()):
        valid = None  # padding only at the ends of rows
    if doc is not None and bool((doc == 1).all()):
        doc = None  # one document per row
    if doc is None and valid is None:
        return None
    index, cu, _ = _varlen_index(doc, valid, B, seq_len, device)
    return (index if valid is not None else None), cu.tolist()


def _varlen_index(doc, valid, B, seq_len, device):
    # A segment is one (row, document) pair; padding tokens are dropped before segmenting, so a document
    # split by stray padding stays one sequence whose keys simply omit the padding.
    rows = torch.arange(B, device=device)[:, None].expand(B, seq_len)  # (B, T)
    segment = rows * (seq_len + 1) + (doc if doc is not None else 0)  # (B, T) unique per (row, document)
    segment = segment.reshape(-1)
    if valid is not None:
        index = valid.reshape(-1).nonzero().squeeze(1)  # (N,) a host sync, as in every varlen path
    else:
        index = torch.arange(B * seq_len, device=device)
    segment = segment.index_select(0, index)  # (N,)
    starts = torch.ones_like(segment, dtype=torch.bool)
    starts[1:] = segment[1:] != segment[:-1]
    cu = torch.cat([starts.nonzero().squeeze(1), torch.tensor([segment.numel()], device=device)])
    # max_seqlen only sizes the launch grid: the row length is a valid upper bound that needs no sync
    return index, cu.to(torch.int32), seq_len


class KVCache:
    """Keys and values of every layer for incremental decoding, preallocated to the final length.

    `slot(i)` is what layer i attends through: it appends the new keys/values at `length` and attends the
    new queries causally over everything cached (absolute index order, sliding window honoured). The
    caller advances `length` once all layers have run.

    Left-padded rows (prompts of different lengths): set `pad` (B,) to each row's count of leading padding
    positions. Keys there are then hidden from every query, and `positions` starts each row's RoPE positions at
    its first real token (as `attention_mask.cumsum(-1) - 1` does without a cache). A padding query attends to
    itself alone, so that no softmax row is empty (its output is never read). With `pad` None (no padding) the
    prompt runs SDPA's mask-free causal path; with padding the prompt's attention takes a (B, 1, T, T) bool mask
    (B T^2 bytes: 0.27 GB for 64 prompts of 2048 tokens), each decode step a (B, 1, 1, S) one.
    `repeat_rows(n)` repeats every row n times (row r -> rows r n .. r n + n - 1): a prompt prefilled once then
    serves n continuations.
    Linear-attention layers (`linear_layers`: Qwen3.5's Gated DeltaNet) hold no keys and values but their state,
    whatever the length: the last inputs of their causal convolution and the recurrent state (`states[layer]`, set
    by the layer's first call: `_CacheSlot.recur`).
    """

    def __init__(
        self,
        n_layers: int,
        batch: int,
        max_len: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        linear_layers: frozenset[int] = frozenset(),
    ):
        shape = (batch, max_len, n_kv_heads, head_dim)  # (B, S, Hkv, D)
        attends = [i not in linear_layers for i in range(n_layers)]
        self.keys = [torch.empty(shape, dtype=dtype, device=device) if a else None for a in attends]
        self.values = [torch.empty(shape, dtype=dtype, device=device) if a else None for a in attends]
        self.states: dict[int, tuple[torch.Tensor, ...]] = {}  # linear layer -> its state tensors, batch first
        self.length = 0
        self.pad: torch.Tensor | None = None  # (B,) leading padding positions per row, None: no padding

    @classmethod
    def for_model(cls, model, batch: int, length: int) -> KVCache:
        """An empty cache for every layer of `model` (a CausalLM): `batch` rows of up to `length` positions, in its
        LM head's dtype and on its device."""
        c, head = model.config, model.lm_head.weight
        linear = frozenset(i for i, kind in enumerate(c.layer_types) if kind == "linear_attention")
        return cls(
            c.num_hidden_layers, batch, length, c.num_key_value_heads, c.head_dim, head.dtype, head.device, linear
        )

    def slot(self, layer: int) -> _CacheSlot:
        return _CacheSlot(self, layer)

    def positions(self, t: int, device) -> torch.Tensor:
        """RoPE positions of the next t tokens: (1, t), or (B, t) counted from each row's first real token."""
        pos = torch.arange(self.length, self.length + t, device=device)[None]  # (1, t)
        return pos if self.pad is None else (pos - self.pad[:, None]).clamp(min=0)  # (B, t)

    def repeat_rows(self, n: int) -> None:
        """Repeat every row n times in place (row r -> rows r n .. r n + n - 1), padding included."""
        self.keys = [None if k is None else k.repeat_interleave(n, dim=0) for k in self.keys]  # (B n, S, Hkv, D)
        self.values = [None if v is None else v.repeat_interleave(n, dim=0) for v in self.values]
        self.states = {i: tuple(t.repeat_interleave(n, dim=0) for t in state) for i, state in self.states.items()}
        if self.pad is not None:
            self.pad = self.pad.repeat_interleave(n)


@dataclass
class _CacheSlot:
    cache: KVCache
    layer: int

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        start, end = self.cache.length, self.cache.length + q.shape[1]
        keys, values = self.cache.keys[self.layer], self.cache.values[self.layer]
        if end > keys.shape[1]:
            raise AttentionError(f"KV cache holds {keys.shape[1]} positions, {end} needed")
        keys[:, start:end] = k
        values[:, start:end] = v
        pad = self.cache.pad
        if start == 0 and pad is None:  # the prompt: causal over itself, no (T, T) mask
            return causal_attention(q, keys[:, :end], values[:, :end], window, sinks)
        kt, vt = keys[:, :end].transpose(1, 2), values[:, :end].transpose(1, 2)  # (B, Hkv, S, D)
        mask = causal_mask(q.shape[1], end, window, q.device)  # (Tq, S)
        if pad is not None:
            ki = torch.arange(end, device=q.device)  # (S,)
            own = ki[None, :] == torch.arange(start, end, device=q.device)[:, None]  # (Tq, S) the query itself
            mask = mask & ((ki[None, None, :] >= pad[:, None, None]) | own)  # (B, Tq, S)
            mask = mask[:, None]  # (B, 1, Tq, S)
        out = sdpa(
            q.transpose(1, 2), kt, vt, sinks, attn_mask=mask, enable_gqa=q.shape[2] != k.shape[2]
        )  # (B, H, Tq, D)
        return out.transpose(1, 2)  # (B, Tq, H, D)

    def recur(self, layer, x: torch.Tensor) -> torch.Tensor:
        """A linear-attention layer over the next t tokens x (B, t, C), from and into this layer's state
        (`layer.decode`); left padding (`cache.pad`) zeroed before it, as transformers zeroes it: zero inputs before
        the first real token leave the state zero, as if the row started there."""
        start = self.cache.length
        pad = self.cache.pad
        mask = None
        if pad is not None and start < int(pad.max()):  # some of these positions are padding
            mask = torch.arange(start, start + x.shape[1], device=x.device)[None] >= pad[:, None]  # (B, t)
        out, self.cache.states[self.layer] = layer.decode(x, self.cache.states.get(self.layer), mask)
        return out
