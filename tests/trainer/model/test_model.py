"""The Llama-family model against transformers (a test-only oracle), and its own invariants.

Tolerances: fp32 logits/loss/gradients against transformers within 1e-5 absolute (observed: bitwise or
~1e-7); bf16 by the project rule (tests/tolerance.py): our error against the fp32 reference is at most 2x
transformers' own bf16 error. Packing/padding invariants in fp32 within 1e-5 (only the summation order of
the masked softmax differs). Kernels on vs off: same loss within 1e-5 in fp32 on the reference path.
Tiny configs (hidden 64, 2 layers, vocab 300) keep the file well under a minute on two CPU cores.
"""

import json
import math
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import kernels
from tests.tolerance import assert_lowp_close
from trainer.build import (
    PRESETS,
    build_preset,
    is_preset,
    load_pretrained,
    load_state_dict_into,
    load_tokenizer,
    save_pretrained,
)
from trainer.checkpoint_hf import CheckpointError, parse_size
from trainer.model.attention import KVCache
from trainer.model.causal_lm import (
    CausalLM,
    HostLabels,
    ModelConfig,
    ModelError,
    apply_liger_kernel,
    generate,
    rope_inv_freq,
)

transformers = pytest.importorskip("transformers")

V, T = 300, 12
BASE = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
ARCHS = {
    "llama": lambda **kw: transformers.LlamaConfig(**{**BASE, **kw}),
    "llama-tied-bias": lambda **kw: transformers.LlamaConfig(
        **{**BASE, "tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True, **kw}
    ),
    "qwen2": lambda **kw: transformers.Qwen2Config(**{**BASE, "tie_word_embeddings": True, **kw}),
    "qwen3": lambda **kw: transformers.Qwen3Config(**{**BASE, "head_dim": 32, "attention_bias": True, **kw}),
    # a window (5) shorter than the sequence (12): honoured, compared with transformers' sliding mask
    "mistral": lambda **kw: transformers.MistralConfig(**{**BASE, "sliding_window": 5, **kw}),
    # Qwen3.5: a gated full-attention layer (a quarter of its 32 channels rotate; zero-centred norms) and a Gated
    # DeltaNet layer (trainer/model/gated_deltanet.py)
    "qwen3_5_text": lambda **kw: transformers.Qwen3_5TextConfig(
        **{**BASE, "head_dim": 32, "layer_types": ["full_attention", "linear_attention"], **LINEAR, **kw}
    ),
}
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8)


def require_kernels(*names):
    missing = [name for name in names if not hasattr(kernels, name)]
    if missing:
        pytest.skip(f"kernels not merged into this branch yet: {', '.join(missing)}")


def hf_model(arch="llama", seed=0, **kw):
    """A transformers model with every parameter random (biases and norm weights too), fp32, eval mode."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(ARCHS[arch](**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    return model


def saved(model, path, **kw):
    model.save_pretrained(path, **kw)
    return path


def batch(seed=1, b=2, t=T):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (b, t), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100  # a prompt that is not a target
    return ids, labels


def per_token_loss(logits, ids):
    """(B, T-1) cross-entropy of predicting ids[:, 1:] from logits[:, :-1]."""
    return F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")


# ------------------------------------------------------------------------------------------------------------
# transformers -> ours
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", list(ARCHS))
def test_loads_transformers_checkpoint_same_logits_loss_grads_fp32(arch, tmp_path):
    hf = hf_model(arch)
    ours = load_pretrained(saved(hf, tmp_path), use_kernels=False).eval()
    assert ours.config.model_type == hf.config.model_type
    assert set(ours.state_dict()) == set(hf.state_dict())
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == bool(hf.config.tie_word_embeddings)
    ids, labels = batch()
    ref, out = hf(ids, labels=labels), ours(ids, labels=labels)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=0)
    ref.loss.backward()
    out.loss.backward()
    hf_params, our_params = dict(hf.named_parameters()), dict(ours.named_parameters())
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.norm.weight",
    ]
    names += [
        n
        for n in (
            "lm_head.weight",
            "model.layers.0.self_attn.k_proj.bias",
            "model.layers.1.self_attn.q_norm.weight",
            "model.layers.0.self_attn.o_proj.bias",
            "model.layers.0.mlp.up_proj.bias",
            "model.layers.1.linear_attn.in_proj_qkv.weight",
            "model.layers.1.linear_attn.conv1d.weight",
            "model.layers.1.linear_attn.A_log",
            "model.layers.1.linear_attn.dt_bias",
            "model.layers.1.linear_attn.in_proj_z.weight",
            "model.layers.1.linear_attn.norm.weight",
        )
        if n in our_params
    ]
    for name in names:
        torch.testing.assert_close(our_params[name].grad, hf_params[name].grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_within_twice_transformers_bf16_error(arch, tmp_path):
    hf = hf_model(arch)
    path = saved(hf, tmp_path)
    ids, labels = batch()
    ref32 = hf(ids, labels=labels)
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ref16 = hf16(ids, labels=labels)
    ours = load_pretrained(path, dtype="bfloat16", use_kernels=False).eval()
    assert ours.lm_head.weight.dtype == torch.bfloat16 and ours.model.rotary_emb.inv_freq.dtype == torch.float32
    out = ours(ids, labels=labels)
    assert_lowp_close(out.logits, ref32.logits, ref16.logits, torch.bfloat16, name="logits")
    assert_lowp_close(out.loss, ref32.loss, ref16.loss, torch.bfloat16, name="loss")


@pytest.mark.parametrize(
    "scaling",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        {"type": "linear", "factor": 2.0},  # the legacy key
    ],
)
def test_rope_scaling_matches_transformers(scaling, tmp_path):
    hf = hf_model("llama", rope_scaling=dict(scaling), rope_theta=500000.0)
    ours = load_pretrained(saved(hf, tmp_path), use_kernels=False).eval()
    assert ours.config.rope_scaling["rope_type"] == scaling.get("rope_type", scaling.get("type"))
    torch.testing.assert_close(ours.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq, atol=0, rtol=0)
    ids, _ = batch(t=40)  # positions well past the original 16
    torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)
    assert "rope_parameters" in json.loads((tmp_path / "config.json").read_text())  # transformers 5's spelling
    save_pretrained(ours, tmp_path / "ours")  # writes rope_parameters and the older rope_scaling + rope_theta
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    torch.testing.assert_close(again.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq, atol=0, rtol=0)
    assert load_pretrained(tmp_path / "ours").config.rope_scaling == ours.config.rope_scaling


def test_qwen_sliding_window_layers_match_transformers(tmp_path):
    hf = hf_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    ours = load_pretrained(saved(hf, tmp_path), use_kernels=False).eval()
    assert ours.config.layer_windows == (None, 4)
    ids, _ = batch()
    torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------------------
# ours -> transformers, sharding
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "llama-tied-bias", "qwen2", "qwen3", "mistral", "qwen3_5_text"])
def test_save_then_transformers_loads_same_logits(arch, tmp_path):
    hf = hf_model(arch)
    ours = load_pretrained(saved(hf, tmp_path / "a"), use_kernels=False).eval()
    save_pretrained(ours, tmp_path / "b")
    files = sorted(p.name for p in (tmp_path / "b").iterdir())
    assert files == ["config.json", "model.safetensors"]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "b" / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert ("lm_head.weight" in f.keys()) == (not ours.config.tie_word_embeddings)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b", dtype=torch.float32).eval()
    assert type(back) is type(hf)
    ids, _ = batch()
    torch.testing.assert_close(back(ids).logits, ours(ids).logits, atol=1e-5, rtol=0)


def test_a_multimodal_qwen3_5_checkpoint_trains_its_text_model(tmp_path):
    """A released Qwen3.5 checkpoint is `qwen3_5`: a vision tower beside the text model, whose keys sit under
    model.language_model. Ours reads its text model as transformers' AutoModelForCausalLM does (its logits), says the
    vision tower is left, and writes a qwen3_5_text model that transformers loads with the same logits."""
    from trainer.cli import model_line

    text = ARCHS["qwen3_5_text"]().to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    config = transformers.AutoConfig.for_model("qwen3_5", text_config=text, vision_config=vision)
    torch.manual_seed(0)
    full = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in full.named_parameters():
            p.copy_((1 if name.endswith("norm.weight") else 0) + 0.05 * torch.randn_like(p))
    full.save_pretrained(tmp_path / "mm")
    ours = load_pretrained(tmp_path / "mm", use_kernels=False).eval()
    assert ours.config.model_type == "qwen3_5_text" and ours.config.text_of == "qwen3_5"
    assert model_line(ours).endswith(
        "of the qwen3_5 checkpoint its text model only: the vision tower is neither trained nor saved"
    )
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mm", dtype=torch.float32).eval()
    ids, _ = batch()
    torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours(ids).logits, full(input_ids=ids).logits, atol=1e-5, rtol=0)
    save_pretrained(ours, tmp_path / "text")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text", dtype=torch.float32).eval()
    assert type(back).__name__ == "Qwen3_5ForCausalLM"
    torch.testing.assert_close(back(ids).logits, ours(ids).logits, atol=1e-5, rtol=0)
    load_state_dict_into(ours, tmp_path / "text")  # a resume from what it wrote reads the text model's keys
    with pytest.raises(ModelError, match=r"config.json: missing key 'text_config' \(a qwen3_5 config's text model\)"):
        ModelConfig.from_hf({"model_type": "qwen3_5"})


def test_sharded_both_directions(tmp_path):
    hf = hf_model("llama")
    hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ours = load_pretrained(tmp_path / "hf", use_kernels=False).eval()
    ids, _ = batch()
    ref = hf(ids).logits
    torch.testing.assert_close(ours(ids).logits, ref, atol=1e-5, rtol=0)

    save_pretrained(ours, tmp_path / "ours", max_shard_size="100KB")
    shards = sorted(p.name for p in (tmp_path / "ours").glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(dict(ours.named_parameters()))
    assert index["metadata"]["total_size"] == 4 * ours.num_parameters()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    torch.testing.assert_close(back(ids).logits, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        load_pretrained(tmp_path / "ours", use_kernels=False)(ids).logits, ref, atol=1e-5, rtol=0
    )

    # saving again unsharded into the same directory removes the stale shards and index
    save_pretrained(ours, tmp_path / "ours", max_shard_size=10**9, dtype=torch.bfloat16)
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == ["config.json", "model.safetensors"]
    assert load_pretrained(tmp_path / "ours").lm_head.weight.dtype == torch.bfloat16  # the config's dtype


def test_load_state_dict_into_an_existing_model(tmp_path):
    model = _tiny("llama-tied-bias")
    save_pretrained(model, tmp_path / "a")
    fresh = _tiny("llama-tied-bias")
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    fresh.to(torch.bfloat16)
    load_state_dict_into(fresh, tmp_path / "a")
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight and fresh.lm_head.weight.dtype == torch.bfloat16
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        torch.testing.assert_close(b, a.to(torch.bfloat16), atol=0, rtol=0, msg=name)
    with pytest.raises(ModelError, match="shape mismatches"):
        load_state_dict_into(_tiny("qwen3"), tmp_path / "a")
    with pytest.raises(ModelError, match="max_shard_size"):
        save_pretrained(model, tmp_path / "b", max_shard_size="lots")


def test_parse_size():
    assert parse_size("500MB") == 500 * 10**6 and parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size(1234) == 1234 and parse_size("100kb") == 100_000
    for bad in ("5 parsecs", 0, "-1GB", "GB"):
        with pytest.raises(CheckpointError, match="max_shard_size"):
            parse_size(bad)


# ------------------------------------------------------------------------------------------------------------
# Packing and padding
# ------------------------------------------------------------------------------------------------------------
def _packed_row(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, V, (n,), generator=g) for n in lengths]
    ids = torch.cat(docs)[None]  # (1, sum)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]  # restarts at each document
    return docs, ids, position_ids


@pytest.mark.parametrize(
    "arch,backend", [("llama", "sdpa"), ("mistral", "sdpa"), ("qwen3", "flex"), ("qwen3_5_text", "flex")]
)
def test_packed_documents_never_attend_to_each_other(arch, backend, tmp_path):
    ours = load_pretrained(saved(hf_model(arch), tmp_path), use_kernels=False).eval()
    ours.attn_backend = backend  # flex runs eagerly on CPU: the same mask logic CUDA compiles
    docs, ids, position_ids = _packed_row([7, 3, 9])
    labels = ids.clone()
    labels[position_ids == 0] = -100  # a document's first token is not a target of the previous document
    # flex has no backward on CPU (forward equality is the claim here) and warns that eager flex is unfused
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        packed = ours(ids, position_ids=position_ids).logits[0]  # (19, V)
        alone = [ours(doc[None]).logits[0] for doc in docs]
        packed_loss = ours(ids, position_ids=position_ids, labels=labels).loss
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=0)
    separate = torch.cat([per_token_loss(logits[None], doc[None])[0] for logits, doc in zip(alone, docs)])
    torch.testing.assert_close(packed_loss, separate.mean(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_packed_row_trains_each_sequence_as_if_alone_through_gated_deltanet(backend, tmp_path):
    """Qwen3.5 packed (padding_free): the Gated DeltaNet's convolution and recurrence restart at every document, so
    the packed row's summed loss and every gradient are those of the documents run one by one (fp32); a document
    longer than the recurrence's 64-token chunks included. With our Triton kernels through the interpreter too."""
    ours = load_pretrained(saved(hf_model("qwen3_5_text"), tmp_path), use_kernels=backend == "triton")
    docs, ids, position_ids = _packed_row([7, 3, 70])
    labels = ids.masked_fill(position_ids == 0, -100)
    with kernels.backend("triton" if backend == "triton" else "auto"):
        ours(ids, position_ids=position_ids, labels=labels, num_items=1).loss.backward()
        packed = {name: p.grad.clone() for name, p in ours.named_parameters()}
        ours.zero_grad()
        for doc in docs:
            ours(doc[None], labels=doc[None], num_items=1).loss.backward()
    for name, p in ours.named_parameters():
        scale = p.grad.abs().max().item()
        torch.testing.assert_close(packed[name], p.grad, atol=1e-5 * scale, rtol=0, msg=name)


@pytest.mark.parametrize("arch", ["mistral", "qwen3_5_text"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_rows_match_unpadded(side, arch, tmp_path):
    ours = load_pretrained(saved(hf_model(arch), tmp_path), use_kernels=False).eval()
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, V, (n,), generator=g) for n in (10, 6)]
    ids = torch.zeros(2, 10, dtype=torch.long)
    mask = torch.zeros(2, 10, dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(0, len(r)) if side == "right" else slice(10 - len(r), 10)
        ids[i, sl], mask[i, sl] = r, 1
    logits = ours(ids, attention_mask=mask).logits
    assert torch.isfinite(logits).all()  # padding queries see no valid key: no NaN
    for i, r in enumerate(rows):
        real = logits[i][mask[i].bool()]
        torch.testing.assert_close(real, ours(r[None]).logits[0], atol=1e-5, rtol=0)
    # losses with -100 on padding (and on a row's first token, which has no predecessor) equal the mean
    # over the rows' own predictions
    labels = ids.masked_fill(mask == 0, -100)
    labels[torch.arange(2), mask.argmax(1)] = -100
    expected = torch.cat([per_token_loss(ours(r[None]).logits, r[None])[0] for r in rows]).mean()
    torch.testing.assert_close(ours(ids, attention_mask=mask, labels=labels).loss, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3_5_text"])
def test_right_padding_matches_transformers(arch, tmp_path):
    hf = hf_model(arch)
    ours = load_pretrained(saved(hf, tmp_path), use_kernels=False).eval()
    ids, labels = batch()
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    labels = labels.masked_fill(mask == 0, -100)
    ref, out = hf(ids, attention_mask=mask, labels=labels), ours(ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out.logits[mask.bool()], ref.logits[mask.bool()], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------------------
# Loss options, checkpointing, NEFTune
# ------------------------------------------------------------------------------------------------------------
def _tiny(arch="qwen3", use_kernels=False, tmp_path=None):
    model = CausalLM(ModelConfig.from_hf(ARCHS[arch]().to_dict()), use_kernels=use_kernels)
    model.init_weights(seed=0)
    return model


def test_num_items_smoothing_and_z_loss_semantics():
    model = _tiny().eval()
    ids, labels = batch()
    n = int((labels[:, 1:] != -100).sum())
    out = model(ids, labels=labels)
    per_token = F.cross_entropy(out.logits[:, :-1].float().transpose(1, 2), labels[:, 1:], reduction="none")
    torch.testing.assert_close(out.loss, per_token.sum() / n)
    torch.testing.assert_close(model(ids, labels=labels, num_items=2 * n).loss, per_token.sum() / (2 * n))
    torch.testing.assert_close(model(ids, labels=labels, num_items=torch.tensor(2 * n)).loss, per_token.sum() / (2 * n))
    model.label_smoothing, model.z_loss = 0.1, 1e-3
    flat, y = out.logits[:, :-1].float().reshape(-1, V), labels[:, 1:].reshape(-1)
    keep = y != -100
    smooth = F.cross_entropy(flat, y, label_smoothing=0.1, reduction="sum")
    z = 1e-3 * (torch.logsumexp(flat, -1)[keep] ** 2).sum()
    torch.testing.assert_close(model(ids, labels=labels).loss, (smooth + z) / n)
    nothing = model(ids, labels=torch.full_like(ids, -100)).loss
    assert nothing.item() == 0.0  # not NaN


def _on_off(arch="llama-tied-bias", config=None):
    """The same weights twice: use_kernels=False and use_kernels=True."""
    off = CausalLM(config, use_kernels=False) if config is not None else _tiny(arch, use_kernels=False)
    off.init_weights(seed=1)
    on = CausalLM(off.config, use_kernels=True)
    on.load_state_dict(off.state_dict())
    assert list(on.state_dict()) == list(off.state_dict())
    return off, on


def _assert_same_grads(off, on, atol=1e-5):
    for (name, a), b in zip(off.named_parameters(), on.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=atol, rtol=1e-4, msg=name)


def _logits_and_grads(model, ids, probe):
    logits = model(ids).logits
    (logits.float() * probe).sum().backward()  # a fixed random direction: every logit's gradient matters
    return logits


def test_kernels_on_and_off_same_logits_and_grads():
    require_kernels("rms_norm")
    off, on = _on_off("qwen3")  # q/k norms too
    ids, _ = batch()
    probe = torch.randn(ids.shape[0], ids.shape[1], V, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits_and_grads(on, ids, probe), _logits_and_grads(off, ids, probe), atol=1e-5, rtol=0)
    _assert_same_grads(off, on)


def test_kernels_on_and_off_same_loss_and_grads():
    require_kernels("rms_norm", "fused_linear_cross_entropy")
    off, on = _on_off()
    ids, labels = batch()
    for ls, z, num_items in [(0.0, 0.0, None), (0.1, 1e-3, 40), (0.0, 0.0, torch.tensor(40.0))]:
        for m in (off, on):
            m.zero_grad()
            m.label_smoothing, m.z_loss = ls, z
        lo, lk = off(ids, labels=labels, num_items=num_items), on(ids, labels=labels, num_items=num_items)
        assert lk.logits is None and lo.logits is not None  # the fused loss never forms the logits
        torch.testing.assert_close(lk.loss, lo.loss, atol=1e-5, rtol=1e-5)
        lo.loss.backward()
        lk.loss.backward()
        _assert_same_grads(off, on)
    nothing = on(ids, labels=torch.full_like(ids, -100)).loss
    assert nothing.item() == 0.0


@pytest.mark.parametrize("down", ["plain", "hooked", "biased"])
def test_mlp_recomputes_its_act_in_backward_bit_for_bit(monkeypatch, down):
    """With our kernels down_proj keeps no silu(gate) * up for backward: act dies with the forward and every
    gradient is bit for bit the one without the recompute. A plain down_proj runs kernels.swiglu_linear (its SwiGLU
    backward writes act again: no extra forward pass); a wrapped, hooked or biased one
    trainer.model.causal_lm._down_recomputing_act (one more kernels.swiglu in backward). Under other saved-tensor hooks
    (activation checkpointing's) the plain path runs. Triton forced (the interpreter): CPU tensors would run the
    reference."""
    import gc
    import importlib
    import weakref

    import trainer.model.causal_lm as model_mod

    require_kernels("swiglu", "swiglu_linear")
    swiglu_mod = importlib.import_module("kernels.swiglu")
    _, on = _on_off("llama-tied-bias" if down == "biased" else "llama")
    mlp = on.model.layers[0].mlp
    assert (mlp.down_proj.bias is not None) == (down == "biased")
    if down == "hooked":
        mlp.down_proj.register_forward_hook(lambda m, args, out: None)
    x = torch.randn(2, 5, on.config.hidden_size, generator=torch.Generator().manual_seed(0), requires_grad=True)
    swiglu_fwd, acts = swiglu_mod.swiglu_fwd, []

    def spy(gate, up, act="silu"):
        acts.append(swiglu_fwd(gate, up, act))
        return acts[-1]

    monkeypatch.setattr(swiglu_mod, "swiglu_fwd", spy)  # every act any path makes (kernels.swiglu launches it too)

    def run(recompute):
        monkeypatch.setattr(model_mod, "_recompute_allowed", lambda: recompute)
        mlp.zero_grad()
        x.grad, acts[:] = None, []
        with kernels.backend("triton"):
            out = mlp(x)
            act = weakref.ref(acts.pop())
            gc.collect()
            kept = act() is not None
            node = type(out.grad_fn).__name__
            out.sum().backward()
        return kept, len(acts), node, [out, x.grad, *(p.grad for p in mlp.parameters())]

    kept, calls, _, plain = run(False)
    assert kept and calls == 0
    kept, calls, node, recomputed = run(True)
    assert not kept  # act died with the forward
    if down == "plain":
        assert node == "SwiGLULinearFunctionBackward" and calls == 0  # rebuilt by the SwiGLU backward kernel
    else:
        assert calls == 1  # backward made it again, once
    for a, b in zip(plain, recomputed):
        assert torch.equal(a, b)
    monkeypatch.undo()
    assert model_mod._recompute_allowed()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert not model_mod._recompute_allowed()
    with torch.no_grad():
        assert not model_mod._recompute_allowed()


@pytest.mark.parametrize("use_kernels", [False, True])
def test_loss_under_fp16_autocast_is_fp32_and_survives_loss_scaling(use_kernels):
    # GradScaler multiplies the loss by 65536: an fp16 loss (or an fp16 loss matmul) would overflow
    if use_kernels:
        require_kernels("rms_norm", "fused_linear_cross_entropy")
    model = _tiny("llama", use_kernels=use_kernels)
    ids, labels = batch()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(ids, labels=labels).loss
    assert loss.dtype == torch.float32
    (loss * 65536.0).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


INTERPRETER_CONFIG = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    model_type="qwen3",
)


def test_triton_rms_norm_through_the_interpreter():
    require_kernels("rms_norm")
    off, on = _on_off(config=ModelConfig(**INTERPRETER_CONFIG))
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    probe = torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(1))
    ref = _logits_and_grads(off, ids, probe)
    with kernels.backend("triton"):
        out = _logits_and_grads(on, ids, probe)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    _assert_same_grads(off, on)


def test_triton_loss_through_the_interpreter():
    require_kernels("rms_norm", "fused_linear_cross_entropy")
    off, on = _on_off(config=ModelConfig(**INTERPRETER_CONFIG))
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    ref = off(ids, labels=ids)
    with kernels.backend("triton"):
        out = on(ids, labels=ids)
        out.loss.backward()
    ref.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)
    _assert_same_grads(off, on)


@pytest.mark.parametrize("arch", ["llama-tied-bias", "qwen3", "qwen3_5_text"])
def test_kernels_through_the_interpreter_match_transformers(arch, tmp_path):
    """use_kernels with every Triton kernel (the interpreter): each residual add fused with the norm after it
    (kernels.fused_add_rms_norm: the attention's add with post_attention_layernorm, the MLP's with the next layer's
    input_layernorm and the final norm), logits and every parameter's gradient those of transformers in fp32."""
    require_kernels("fused_add_rms_norm", "rope", "swiglu")
    hf = hf_model(arch)
    ours = load_pretrained(saved(hf, tmp_path), use_kernels=True).eval()
    ids, _ = batch()
    probe = torch.randn(ids.shape[0], ids.shape[1], V, generator=torch.Generator().manual_seed(0))
    ref = _logits_and_grads(hf, ids, probe)
    with kernels.backend("triton"):
        logits = ours(ids).logits
        seen, stack = set(), [logits.grad_fn]
        while stack:  # the autograd graph
            node = stack.pop()
            if node is not None and node not in seen:
                seen.add(node)
                stack.extend(n for n, _ in node.next_functions)
        nodes = [type(node).__name__ for node in seen]
        (logits.float() * probe).sum().backward()
    # every residual add fused: the attention's in each layer, the MLP's in the next layer's norm or the final one
    assert nodes.count("FusedAddRMSNormFunctionBackward") == 2 * hf.config.num_hidden_layers
    assert arch == "qwen3_5_text" or "AddBackward0" not in nodes  # (a Gated DeltaNet adds its dt_bias)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        # the probe's gradients reach ~100: fp32 noise relative to each gradient's largest value (observed <= 6e-7;
        # <= 4e-6 through a Gated DeltaNet, whose chunked recurrence sums in another order than transformers', the
        # same with our kernels off)
        want = hf_params[name].grad
        noise = 1e-5 if arch == "qwen3_5_text" else 2e-6
        torch.testing.assert_close(p.grad, want, atol=noise * want.abs().max().item(), rtol=0, msg=name)


def test_rope_impls_agree_through_the_interpreter():
    """Attention's rotation by impl: kernels.rope (Triton, through the interpreter) and liger-kernel's
    LigerRopeFunction (which rotates in place) against plain apply_rope: values and the gradients of q and k,
    on (B, T, H, D) projection outputs and the model's own cos/sin for packed positions."""
    require_kernels("rope")
    pytest.importorskip("liger_kernel")
    model = _tiny("llama")  # 4 heads, 2 kv heads, head_dim 16
    attn = model.model.layers[0].self_attn
    B, H, Hkv, D = 2, 4, 2, 16
    packed = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4], list(range(3, 3 + T))])  # (B, T) per row
    g = torch.Generator().manual_seed(0)
    q_src, k_src = torch.randn(B, T, H * D, generator=g), torch.randn(B, T, Hkv * D, generator=g)
    dq, dk = torch.randn(B, T, H, D, generator=g), torch.randn(B, T, Hkv, D, generator=g)
    for position_ids in (packed, torch.arange(T)[None]):  # cos/sin (B, T, D), and the default (1, T, D)
        cos, sin = model.model.rotary_emb(position_ids)  # fp32
        results = {}
        for impl in ("torch", "kernels", "liger"):
            model._set_impl(impl)
            assert attn.impl == impl
            qs, ks = q_src.clone().requires_grad_(), k_src.clone().requires_grad_()
            # Fresh projection outputs, as q_proj/k_proj give them (liger writes into these buffers).
            q, k = (qs * 1.0).view(B, T, H, D), (ks * 1.0).view(B, T, Hkv, D)
            with kernels.backend("triton"):
                q_rot, k_rot = attn._rope(q, k, cos, sin)
                grads = torch.autograd.grad((q_rot, k_rot), (qs, ks), (dq, dk))
            assert q_rot.shape == (B, T, H, D) and k_rot.shape == (B, T, Hkv, D)
            results[impl] = (q_rot.detach(), k_rot.detach(), *grads)
        for impl in ("kernels", "liger"):
            for got, want, name in zip(results[impl], results["torch"], ("q_rot", "k_rot", "dq", "dk")):
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, msg=f"{impl} {name} cos {tuple(cos.shape)}")


def test_liger_mode_is_the_same_switch(monkeypatch):
    model = _tiny()
    apply_liger_kernel(model)
    assert model.impl == "liger" and not model.use_kernels
    assert {m.impl for m in model.modules() if hasattr(m, "impl")} == {"liger"}
    model.use_kernels = False
    assert {m.impl for m in model.modules() if hasattr(m, "impl")} == {"torch"}
    monkeypatch.setitem(__import__("sys").modules, "liger_kernel", None)  # as if not installed
    with pytest.raises(ModelError, match="liger-kernel is not installed"):
        apply_liger_kernel(model)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5_text"])
def test_gradient_checkpointing_same_gradients(arch):
    model = _tiny(arch).train()
    ids, labels = batch()
    grads = []
    for enabled in (False, True):
        model.zero_grad()
        model.set_gradient_checkpointing(enabled)
        model(ids, labels=labels).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=0, rtol=0)
    with pytest.raises(ModelError, match="use_reentrant"):
        model.set_gradient_checkpointing(True, use_reentrant=True)


@pytest.mark.parametrize("mode", ["torch", "kernels", "triton"])
def test_neftune_only_in_training_bounded_and_not_on_padding(mode):
    require_kernels("neftune_noise")
    model = _tiny(use_kernels=mode != "torch")
    model.neftune_noise_alpha = 5.0
    seen = []
    model.model.layers[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
    ids = torch.randint(0, V, (1, 16))
    mask = torch.ones_like(ids)
    mask[0, 13:] = 0
    position_ids = torch.tensor([list(range(4)) + list(range(12))])  # two documents: 4 and 9 real tokens
    clean = model.model.embed_tokens(ids).detach()
    model.eval()
    model(ids, attention_mask=mask, position_ids=position_ids)
    assert torch.equal(seen[-1], clean)  # eval: no noise
    model.train()
    with kernels.backend("triton" if mode == "triton" else "reference"):
        model(ids, attention_mask=mask, position_ids=position_ids)
    noise = (seen[-1] - clean)[0]  # (16, C)
    C = clean.shape[-1]
    assert noise[13:].abs().max() == 0  # padding untouched
    for sl, length in ((slice(0, 4), 4), (slice(4, 13), 9)):
        bound = 5.0 / math.sqrt(length * C)
        assert noise[sl].abs().max() <= bound * (1 + 1e-5)
        assert noise[sl].abs().max() > 0.8 * bound  # uniform over the full range, its own length's scale


# ------------------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------------------
def test_bad_checkpoints_give_one_clear_error(tmp_path):
    with pytest.raises(ModelError, match="config.json: not found"):
        load_pretrained(tmp_path)
    hf = hf_model("llama")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    shard = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelError, match=f"{shard.name}: shard listed"):
        load_pretrained(tmp_path / "sharded")
    path = saved(hf, tmp_path / "shapes")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(
        ModelError, match=r"6 shape mismatches: model.layers.0.mlp.down_proj.weight \[64, 128\] vs model \[64, 96\]"
    ):
        load_pretrained(path)
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ModelError, match=r"missing 9 keys: model.layers.2.*and 1 more"):
        load_pretrained(path)
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    with pytest.raises(ModelError, match="unexpected 9 keys: model.layers.1"):
        load_pretrained(path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="no model.safetensors or model.safetensors.index.json"):
        load_pretrained(tmp_path / "empty")


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"model_type": "gpt2"},
            "model_type 'gpt2' is not supported (supported: llama, mistral, qwen2, qwen3, qwen3_5_text, qwen3_moe, "
            "mixtral, gpt_oss, qwen3_next, qwen3_5_moe_text)",
        ),
        (
            {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}},
            "rope_scaling type 'longrope' is not supported (supported: default, linear, llama3, yarn)",
        ),
        ({"rope_parameters": {"type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported (supported: silu)"),
        ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
        ({"attention_dropout": 0.1}, "attention_dropout 0.1 is not supported"),
    ],
)
def test_bad_configs_name_the_key(change, message, tmp_path):
    config = {**ARCHS["llama"]().to_dict(), **change}
    if "rope_scaling" in change or "rope_parameters" in change:
        config.pop("rope_parameters" if "rope_scaling" in change else "rope_scaling", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="config.json: " + message.replace("(", r"\(").replace(")", r"\)")):
        load_pretrained(tmp_path)
    with pytest.raises(ModelError, match="missing key 'hidden_size'"):
        ModelConfig.from_hf({"model_type": "llama", "vocab_size": 3})


# ------------------------------------------------------------------------------------------------------------
# Presets, counting
# ------------------------------------------------------------------------------------------------------------
def test_tiny_preset_round_trips_through_ours_and_transformers(tmp_path):
    assert is_preset("tiny") and not is_preset("huge")
    model, tok = build_preset("tiny", seed=0, use_kernels=False)
    assert 5e5 <= model.num_parameters() <= 2e6
    assert model.config.vocab_size == 320 and tok.vocab_size == 259 and model.config.eos_token_id == tok.eos_token_id
    again, _ = build_preset("tiny", seed=0, use_kernels=False)
    other, _ = build_preset("tiny", seed=1, use_kernels=False)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)
    w = model.model.layers[0].mlp.up_proj.weight
    assert abs(w.std().item() - 0.02) < 2e-3 and model.model.norm.weight.eq(1).all()
    save_pretrained(model, tmp_path, tokenizer=tok)
    ids = torch.tensor([tok.encode("hello, world")])
    ref = model.eval()(ids).logits
    torch.testing.assert_close(load_pretrained(tmp_path, use_kernels=False)(ids).logits, ref, atol=0, rtol=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    torch.testing.assert_close(hf(ids).logits, ref, atol=1e-5, rtol=0)
    assert hf.num_parameters() == model.num_parameters()
    assert load_tokenizer(tmp_path).encode("héllo") == tok.encode("héllo")
    with pytest.raises(ModelError, match="preset 'huge' is unknown \\(presets: tiny\\)"):
        build_preset("huge")
    assert set(PRESETS) == {"tiny"}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3_5_text"])  # untied, tied, hybrid
def test_num_parameters_and_flops(arch, tmp_path):
    hf = hf_model(arch)
    ours = load_pretrained(saved(hf, tmp_path), use_kernels=False)
    for exclude in (False, True):
        assert ours.num_parameters(exclude_embeddings=exclude) == hf.num_parameters(exclude_embeddings=exclude)
    c = ours.config
    layers = sum(p.numel() for p in ours.model.layers.parameters())
    n = layers + c.hidden_size + c.vocab_size * c.hidden_size  # layers, final norm, head
    attention = 12 * c.num_attention_heads * c.head_dim * 256  # per softmax-attention layer
    if arch == "qwen3_5_text":  # one attention layer, one Gated DeltaNet: 18 Hv K V for its recurrence
        assert ours.flops_per_token(256) == 6 * n + attention + 18 * 4 * 16 * 8
    else:
        assert ours.flops_per_token(256) == 6 * n + c.num_hidden_layers * attention


def test_dtype_cast_keeps_rope_frequencies_fp32():
    model = _tiny("llama")
    exact = rope_inv_freq(model.config)
    model.to(torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(model.model.rotary_emb.inv_freq, exact)


# ------------------------------------------------------------------------------------------------------------
# Generation
# ------------------------------------------------------------------------------------------------------------
# mistral: llama plus a sliding window, which the cached decode must honour too; qwen3_5_text: a Gated DeltaNet
# layer, whose convolution and recurrent states the cache carries
@pytest.mark.parametrize("arch", ["mistral", "qwen3_5_text"])
def test_greedy_generate_matches_full_recompute_and_transformers(arch, tmp_path):
    hf = hf_model(arch)
    ours = load_pretrained(saved(hf, tmp_path), use_kernels=False)
    prompt = batch(b=1, t=5)[0]
    new = generate(ours, prompt[0].tolist(), 10)  # 15 tokens > the mistral window of 5
    ids = prompt
    for _ in range(10):  # no cache: the whole forward each step
        ids = torch.cat([ids, ours.eval()(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert new == ids[0, 5:].tolist()
    hf.generation_config.eos_token_id = None
    ref = hf.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(generate(ours, prompt, 10), ref)
    two = torch.cat([prompt, batch(seed=9, b=1, t=5)[0]])
    torch.testing.assert_close(
        generate(ours, two, 6), hf.generate(two, max_new_tokens=6, do_sample=False, pad_token_id=0)
    )


@pytest.mark.parametrize("arch", ["mistral", "qwen3_5_text"])
def test_left_padded_kv_cache_equals_the_masked_forward(arch):
    """KVCache.pad: prompts of different lengths left-padded in one batch, prefilled, repeated per row and decoded
    two tokens, give the logits of the uncached forward with the attention mask (positions from the mask), with a
    sliding window (mistral, 5) shorter than the rows, and through a Gated DeltaNet's states (qwen3_5_text)."""
    model = _tiny(arch).eval()
    ids, _ = batch(seed=4, b=2, t=9)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # row 1: 5 real tokens after 4 of padding
    cache = KVCache.for_model(model, 2, 12)
    cache.pad = (1 - mask).sum(-1)
    with torch.no_grad():
        first = model.decode_step(ids, cache).repeat_interleave(2, 0)  # (4, V)
        cache.repeat_rows(2)
        nxt = torch.tensor([[7], [8], [9], [10]])
        second = model.decode_step(nxt, cache)  # (4, V)
        full = torch.cat([ids.repeat_interleave(2, 0), nxt], dim=1)  # (4, 10)
        ref = model(full, attention_mask=torch.cat([mask.repeat_interleave(2, 0), torch.ones(4, 1)], 1).long())
    torch.testing.assert_close(first, ref.logits[:, -2].float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(second, ref.logits[:, -1].float(), atol=1e-5, rtol=0)


def test_generate_eos_and_sampling():
    model = _tiny("llama")
    prompt = [1, 2, 3]
    greedy = generate(model, prompt, 8)
    assert model.training  # the caller's mode is restored
    stop = greedy[3]
    assert generate(model, prompt, 8, eos_token_id=stop) == greedy[: greedy.index(stop) + 1]
    assert generate(model, prompt, 8, eos_token_id=[999, stop]) == greedy[: greedy.index(stop) + 1]

    def sample(seed, **kw):
        return generate(model, prompt, 8, temperature=1.0, generator=torch.Generator().manual_seed(seed), **kw)

    assert sample(0) == sample(0) and sample(0) != sample(1)
    assert sample(0, top_p=1e-6) == greedy  # the nucleus is the argmax alone
    with pytest.raises(ModelError, match="top_p"):
        generate(model, prompt, 2, temperature=1.0, top_p=0.0)


# ------------------------------------------------------------------------------------------------------------
# CUDA backends (not run without a GPU)
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_backends_agree_with_sdpa_on_packed_padded_input(dtype):
    model = _tiny("mistral").to("cuda", dtype).eval()
    docs, ids, position_ids = _packed_row([7, 3, 9])
    ids, position_ids = torch.cat([ids, ids.flip(1)]).cuda(), torch.cat([position_ids, position_ids]).cuda()
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0
    model.attn_backend = "sdpa"
    ref = model(ids, position_ids=position_ids, attention_mask=mask).logits[mask.bool()].float()
    backends = ["flex"] + (["flash"] if dtype == torch.bfloat16 and kernels_flash_available() else [])
    for name in backends:
        model.attn_backend = name
        out = model(ids, position_ids=position_ids, attention_mask=mask).logits[mask.bool()].float()
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out, ref, atol=tol, rtol=0, msg=name)


@pytest.mark.gpu
def test_liger_mode_matches_torch_on_cuda():
    model = _tiny("qwen3").cuda()
    ids, labels = batch()
    ids, labels = ids.cuda(), labels.cuda()
    ref = model(ids, labels=labels).loss
    apply_liger_kernel(model)
    torch.testing.assert_close(model(ids, labels=labels).loss, ref, atol=1e-4, rtol=1e-4)


def kernels_flash_available():
    from trainer.model.attention import _flash_attn

    return _flash_attn() is not None


def test_the_architecture_imports_no_process_helpers():
    # The import loop of issue 12: model.py imported parallel (for local_shard) and parallel imported model back.
    # The architecture stands alone; dist.py (processes) and parallel.py (transforms) stand on it or beside it.
    # Files are build.py's: the architecture reads and writes none (issue 12).
    code = (
        "import sys, trainer.model.causal_lm; print(sorted(m for m in sys.modules if m in "
        "('trainer.parallel.transforms', 'trainer.dist', 'trainer.build', 'trainer.checkpoint_hf', "
        "'trainer.data.tokenizer')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_parallel_knows_no_model_class():
    # parallel.py imported model.py for empty_model (the FSDP2 build); the build is build.py's now, and the
    # transforms work on any module.
    code = "import sys, trainer.parallel.transforms; print('trainer.model.causal_lm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_host_labels_holder_gives_the_same_loss_and_gradients():
    """The Trainer hands FSDP2 models their host labels in `HostLabels` (FSDP2 would move a tensor to the device);
    forward takes the tensor out: the same loss and gradients as plain labels, with and without our kernels."""
    model = CausalLM(ModelConfig(**BASE))
    model.init_weights(3)
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[:, : T // 2] = -100
    for use_kernels in (True, False):
        model.use_kernels = use_kernels
        results = []
        for given in (labels, HostLabels(labels)):
            model.zero_grad()
            loss = model(ids, labels=given).loss
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        assert torch.equal(results[0][0], results[1][0])
        assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
