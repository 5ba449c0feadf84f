"""The tiled MLP (`tiled_mlp`, issue 30 item 2): each MLP runs over the tokens in tiles, checkpointed per tile, so
no (tokens, intermediate) tensor larger than a tile's exists in forward or backward; outputs and input gradients
equal the untiled ones within fp32 rounding, and weight gradients within the rounding bound of summing the
per-token contributions in another order."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kernels
from trainer.model.causal_lm import CausalLM, ModelConfig

C, INNER, TOKENS, TILE = 64, 128, 2 * 23, 10  # 46 tokens: 4 tiles of 10 and one of 6
CONFIG = ModelConfig(
    vocab_size=96,
    hidden_size=C,
    intermediate_size=INNER,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def mlp_and_input(use_kernels, dtype=torch.float32):
    model = CausalLM(CONFIG, use_kernels=use_kernels)
    model.init_weights(seed=0)
    mlp = model.model.layers[0].mlp.to(dtype)
    x = torch.randn(2, TOKENS // 2, C, generator=torch.Generator().manual_seed(1), dtype=dtype)
    return mlp, x


def run(mlp, x, tile):
    mlp.tile_tokens = tile
    mlp.zero_grad()
    x = x.clone().requires_grad_()
    probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=x.dtype)
    y = mlp(x)
    (y * probe).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in mlp.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("use_kernels", [False, True])
def test_tiled_equals_untiled_within_fp32_rounding(use_kernels):
    mlp, x = mlp_and_input(use_kernels)
    with kernels.backend("triton" if use_kernels else "reference"):
        y, dx, grads = run(mlp, x, None)
        y_t, dx_t, grads_t = run(mlp, x, TILE)
    torch.testing.assert_close(y_t, y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx_t, dx, rtol=1e-5, atol=1e-6)
    # Each weight gradient is a sum over the tokens; tiling sums the same per-token terms in another order, so the
    # two differ by at most about (tokens) x eps x sum |term| (fp64 per-token terms, one backward per token)
    terms = {name: torch.zeros_like(g, dtype=torch.float64) for name, g in grads.items()}
    mlp64 = mlp_and_input(False, torch.float64)[0]
    mlp64.load_state_dict(mlp.state_dict())
    probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float32).double()
    flat, flat_probe = x.double().reshape(TOKENS, C), probe.reshape(TOKENS, C)
    for token in range(TOKENS):
        mlp64.zero_grad()
        (mlp64(flat[token : token + 1]) * flat_probe[token]).sum().backward()
        for name, p in mlp64.named_parameters():
            terms[name] += p.grad.abs()
    eps = torch.finfo(torch.float32).eps
    for name, g in grads.items():
        bound = TOKENS * eps * terms[name] + 1e-12
        assert ((grads_t[name].double() - g.double()).abs() <= bound).all(), name


def test_bf16_tiles_keep_outputs_and_stay_within_bf16_rounding_of_the_weight_gradients():
    mlp, x = mlp_and_input(False, torch.bfloat16)
    y, dx, grads = run(mlp, x, None)
    y_t, dx_t, grads_t = run(mlp, x, TILE)
    assert torch.equal(y_t, y)
    torch.testing.assert_close(dx_t, dx, rtol=2e-2, atol=1e-2)
    for name, g in grads.items():
        torch.testing.assert_close(grads_t[name], g, rtol=5e-2, atol=5e-2, msg=name)


class LargestIntermediate(TorchDispatchMode):
    """The most rows any op's output with `INNER` columns had (a weight's shape aside): the (tokens, intermediate)
    tensors' size."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            # (C, INNER) is down_proj's weight (and its copies), not an activation
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == INNER and tuple(t.shape) != (C, INNER):
                self.rows = max(self.rows, t.shape[:-1].numel())
        return out


@pytest.mark.parametrize("use_kernels", [False, True])
def test_no_intermediate_larger_than_a_tile_in_forward_or_backward(use_kernels):
    mlp, x = mlp_and_input(use_kernels)
    x.requires_grad_()
    with kernels.backend("triton" if use_kernels else "reference"):
        for tile, most in ((None, TOKENS), (TILE, TILE)):
            mlp.tile_tokens = tile
            with LargestIntermediate() as forward:
                y = mlp(x)
            with LargestIntermediate() as backward:
                y.sum().backward()
            assert (forward.rows, backward.rows) == (most, most)


def test_the_model_switch_sets_tiles_of_hidden_size_tokens():
    model = CausalLM(CONFIG, tiled_mlp=True)
    assert model.tiled_mlp and {m.mlp.tile_tokens for m in model.model.layers} == {C}
    model.tiled_mlp = False
    assert not model.tiled_mlp and {m.mlp.tile_tokens for m in model.model.layers} == {None}


def test_a_lora_wrapped_mlp_tiles_too():
    """peft's LoRA layers on gate/up/down (dropout 0: each tile's recompute draws nothing): the same outputs and
    gradients, adapters included, within fp32 rounding."""
    from trainer.config.args import TrainingArguments
    from trainer.model.lora import apply_lora

    model = CausalLM(CONFIG, use_kernels=False)
    model.init_weights(seed=0)
    apply_lora(model, TrainingArguments(use_peft=True, lora_r=4, lora_dropout=0.0, lora_target_modules="all-linear"))
    mlp = model.model.layers[0].mlp
    assert any("lora_A" in name for name, _ in mlp.named_parameters())
    x = torch.randn(2, TOKENS // 2, C, generator=torch.Generator().manual_seed(1))
    for p in mlp.parameters():  # B starts at zero: move it so the adapters' path carries gradient to A
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(3))
    y, dx, grads = run(mlp, x, None)
    y_t, dx_t, grads_t = run(mlp, x, TILE)
    torch.testing.assert_close(y_t, y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx_t, dx, rtol=1e-5, atol=1e-6)
    assert grads.keys() == grads_t.keys() and any("lora_A" in name for name in grads)  # the frozen base: no grads
    for name, g in grads.items():
        torch.testing.assert_close(grads_t[name], g, rtol=1e-4, atol=1e-6, msg=name)
