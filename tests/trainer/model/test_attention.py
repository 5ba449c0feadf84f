"""The sdpa path of trainer/model/attention.py: per-document attention without a (T, T) mask (issue 21 item 14).

The reference is the dense-mask path it replaced: one boolean (B, 1, T, T) mask from the document ids, the
padding and the window (`dense_reference`). Outputs at real tokens and every gradient must agree with it to fp32
tolerance; the largest tensor any op allocates must grow linearly with the row, not quadratically."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.model import attention
from trainer.model.attention import causal_mask, document_ids, flex_mask_mod, make_plan
from trainer.model.causal_lm import CausalLM, ModelConfig


def dense_reference(q, k, v, position_ids, attention_mask, window):
    """The former sdpa path: query i attends key j iff j <= i, same document, key j real, i - j < window; a
    padding query attends to itself."""
    B, T = q.shape[:2]
    allowed = causal_mask(T, T, window, q.device)[None]  # (1, T, T)
    if position_ids is not None:
        doc = document_ids(position_ids)
        allowed = allowed & (doc[:, :, None] == doc[:, None, :])
    if attention_mask is not None:
        valid = attention_mask.bool()
        allowed = allowed & valid[:, None, :]
        allowed = allowed | (torch.eye(T, dtype=torch.bool) & ~valid[:, :, None])
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=allowed[:, None],
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def _packed(lengths):
    return torch.cat([torch.arange(n) for n in lengths])[None]  # (1, T)


def _case(name):
    """(position_ids, attention_mask, window) of a batch layout, T = 24."""
    if name == "packed":  # padding_free: documents of 7, 3, 9 and 5 tokens
        return _packed([7, 3, 9, 5]), None, None
    if name == "packed_window":  # a window shorter than the long documents
        return _packed([11, 3, 10]), None, 4
    if name == "packed_padded":  # pad_to_multiple_of: the padding is one more document
        return _packed([9, 8, 7]), torch.tensor([[1] * 17 + [0] * 7]), None
    if name == "right_padded":  # normal batching: one document per row, padding after it
        mask = torch.tensor([[1] * 24, [1] * 15 + [0] * 9, [1] * 5 + [0] * 19])
        return torch.arange(24)[None].expand(3, 24), mask, 3
    if name == "left_padded":  # generation: positions from the mask, each pad a document of its own
        mask = torch.tensor([[0] * 6 + [1] * 18, [1] * 24])
        return (mask.cumsum(-1) - 1).clamp(min=0), mask, None
    if name == "stray_padding":  # padding inside a document: its keys are left out
        mask = torch.ones(2, 24, dtype=torch.long)
        mask[0, 5:8] = 0
        mask[1, 20:] = 0
        return _packed([12, 12]).expand(2, 24), mask, None
    if name == "plain":
        return None, None, 5
    raise AssertionError(name)


CASES = ["packed", "packed_window", "packed_padded", "right_padded", "left_padded", "stray_padding", "plain"]


@pytest.mark.parametrize("name", CASES)
def test_sdpa_equals_the_dense_mask_path(name):
    position_ids, attention_mask, window = _case(name)
    B = 1 if position_ids is None else position_ids.shape[0]
    T, H, Hkv, D = 24, 4, 2, 8
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, h, D, generator=gen, dtype=torch.float64, requires_grad=True) for h in (H, Hkv, Hkv))
    weight = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64)
    real = (attention_mask if attention_mask is not None else torch.ones(B, T)).bool()[..., None, None]
    results = []
    for attend in ("dense", "plan"):
        if attend == "dense":
            out = dense_reference(q, k, v, position_ids, attention_mask, window)
        else:
            plan = make_plan(position_ids, attention_mask, B, T, q.device, q.dtype, (window,), "sdpa")
            out = plan.attend(q, k, v, window)
        loss = (out * weight * real).sum()  # outputs at padding are never read
        results.append((out * real, *torch.autograd.grad(loss, (q, k, v))))
    for ours, ref in zip(results[1], results[0]):
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-10)


def dense_sink_reference(q, k, v, sinks, position_ids, attention_mask, window):
    """transformers' gpt_oss eager attention over `dense_reference`'s mask: the scores (masked to -inf), each head's
    sink logit as one more column, softmax, the column dropped."""
    B, T, H, D = q.shape
    allowed = causal_mask(T, T, window, q.device)[None]  # (1, T, T)
    if position_ids is not None:
        doc = document_ids(position_ids)
        allowed = allowed & (doc[:, :, None] == doc[:, None, :])
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, :]
    kt = k.transpose(1, 2).repeat_interleave(H // k.shape[2], dim=1)  # (B, H, T, D)
    vt = v.transpose(1, 2).repeat_interleave(H // k.shape[2], dim=1)
    scores = (q.transpose(1, 2) @ kt.transpose(2, 3)) * D**-0.5  # (B, H, T, T)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    logits = torch.cat([scores, sinks.view(1, H, 1, 1).expand(B, H, T, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return (probs @ vt).transpose(1, 2)  # (B, T, H, D)


@pytest.mark.parametrize("name", CASES)
def test_sinks_on_sdpa_and_flex_equal_the_explicit_softmax(name):
    """Attention sinks (gpt_oss) on the sdpa path (the sink as one more key inside SDPA: trainer/model/attention.py
    `sdpa`) against transformers' explicit softmax with the sink column, with every batch layout: outputs at real tokens
    and the gradients of q, k, v and the sinks (head size 8: the scale 8^-1/2 is no power of two). flex's forward
    (eager on CPU; its backward needs CUDA) too."""
    position_ids, attention_mask, window = _case(name)
    B = 1 if position_ids is None else position_ids.shape[0]
    T, H, Hkv, D = 24, 4, 2, 8
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, h, D, generator=gen, dtype=torch.float64, requires_grad=True) for h in (H, Hkv, Hkv))
    sinks = torch.randn(H, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64)
    real = (attention_mask if attention_mask is not None else torch.ones(B, T)).bool()[..., None, None]
    results = []
    for attend in ("dense", "plan"):
        if attend == "dense":
            out = dense_sink_reference(q, k, v, sinks, position_ids, attention_mask, window)
        else:
            plan = make_plan(position_ids, attention_mask, B, T, q.device, q.dtype, (window,), "sdpa", sinks=True)
            out = plan.attend(q, k, v, window, sinks)
        loss = (out * weight * real).sum()  # outputs at padding are never read
        results.append((out * real, *torch.autograd.grad(loss, (q, k, v, sinks))))
    for ours, ref in zip(results[1], results[0]):
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-10)
    with torch.no_grad():
        plan = make_plan(position_ids, attention_mask, B, T, q.device, q.dtype, (window,), "flex", sinks=True)
        flex = plan.attend(q.detach(), k.detach(), v.detach(), window, sinks)
    torch.testing.assert_close(flex * real, results[0][0], rtol=0, atol=1e-10)


class _LargestTensor(TorchDispatchMode):
    """The largest tensor (bytes) any aten op returns while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def _largest_in_training_step(T: int, window: int | None) -> int:
    """Forward and backward of a small model on one packed row of T tokens: one long document and short ones."""
    config = ModelConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=T,
        sliding_window=window,
        model_type="mistral" if window else "llama",
    )
    torch.manual_seed(0)
    model = CausalLM(config, use_kernels=False)
    lengths = [T // 2, T // 4, T // 8, T - T // 2 - T // 4 - T // 8]
    position_ids = _packed(lengths)
    ids = torch.randint(0, 32, (1, T))
    with _LargestTensor() as meter:
        model(
            ids, position_ids=position_ids, attention_mask=torch.ones(1, T, dtype=torch.long), labels=ids
        ).loss.backward()
    return meter.largest


@pytest.mark.parametrize("window", [None, 64])
def test_a_long_packed_row_allocates_linear_memory(window):
    """Doubling the packed row doubles the largest allocation (the dense path quadrupled it: a (T, T) mask)."""
    small, large = _largest_in_training_step(2048, window), _largest_in_training_step(4096, window)
    assert large <= 2.1 * small, (small, large)
    assert large <= 4096 * 32 * 4 * 2  # the logits (T, vocab) in fp32, twice: no (T, T) tensor of 16.8 M


def _mask_mod(rows: int, T: int, window: int | None, docs: bool, padding: bool):
    """AttentionPlan's flex mask function over random documents and padding (sorted ids: contiguous documents)."""
    g = torch.Generator().manual_seed(T + rows)
    doc = torch.sort(torch.randint(0, 4, (rows, T), generator=g), dim=1).values if docs else None
    valid = torch.rand(rows, T, generator=g) > 0.2 if padding else None
    return flex_mask_mod(window, doc, valid)


@pytest.mark.parametrize(
    "rows, T, window, docs, padding",
    [(1, 5, None, False, False), (1, 300, 100, False, False), (3, 700, None, True, True), (2, 384, 100, True, False)],
)
def test_flex_block_mask_equals_torchs_create_block_mask(monkeypatch, rows, T, window, docs, padding):
    """attention.block_mask gives create_block_mask's BlockMask field for field, in one slab and in slabs of one
    query block (MASK_PAIRS small), for lengths under, at and past a block, windows, documents and padding."""
    mask_mod = _mask_mod(rows, T, window, docs, padding)
    want = create_block_mask(mask_mod, rows, None, T, T, device="cpu")
    for pairs in (attention.MASK_PAIRS, 1):
        monkeypatch.setattr(attention, "MASK_PAIRS", pairs)
        got = attention.block_mask(mask_mod, rows, T, "cpu")
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (name, pairs)
        for name in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (name, pairs)
        assert (got.seq_lengths, got.BLOCK_SIZE) == (want.seq_lengths, want.BLOCK_SIZE)


def test_flex_block_mask_never_holds_a_T_by_T_tensor(monkeypatch):
    """torch's create_block_mask evaluates the mask over every (query, key) pair at once (the gpt-oss ladder found
    ~10 B a pair, quadratic in T); block_mask holds one slab of query blocks: at T = 2048 with slabs of one block, the
    largest tensor is a (128, 2048) slab's int64 arithmetic, 16x under torch's (2048, 2048) bool mask alone."""
    T, window = 2048, 256
    mask_mod = _mask_mod(1, T, window, docs=True, padding=False)
    with _LargestTensor() as theirs:
        create_block_mask(mask_mod, 1, None, T, T, device="cpu")
    monkeypatch.setattr(attention, "MASK_PAIRS", 128 * 128 * (T // 128))  # one query block a slab
    with _LargestTensor() as ours:
        attention.block_mask(mask_mod, 1, T, "cpu")
    assert theirs.largest >= T * T, theirs.largest
    assert ours.largest <= 128 * T * 8, ours.largest
