"""What a ladder step puts on meta tensors beyond the four stacks: activation offloading metered
(`MeteredOffloader`), NF4 base weights (`NF4Linear`, `nf4_bytes`), peft's LoRA r=16 (`apply_lora_r16`), FSDP2's CPU
offload on one process (`HostParameters`), and transformers, checkpointing and dropout as they run on a GPU
(`hf_through_backward`, `checkpoint_on_meta`, `cuda_dropout_on_meta`)."""

from __future__ import annotations

import contextlib
import functools
import math
import weakref

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from bench.roofline import tracing
from bench.roofline.tracing import BF16, nbytes
from trainer.model.offload import MIN_BYTES_CUDA, ActivationOffloader


def nf4_bytes(numel: int) -> int:
    """Bytes bitsandbytes stores for a weight of `numel` values in NF4 with double quantisation (QLoRA's setting,
    blocks of 64): the 4-bit codes, one uint8 absmax a block, one fp32 scale per 256 blocks, and the per-tensor
    code books (16 + 256 fp32) and offset. tests/bench/test_ladder.py holds it to the bytes of real layers quantized
    by bitsandbytes (trainer.model.quant.quantized_bytes), the Llama-3.1-8B shapes among them: 0.5159 bytes a weight
    there."""
    blocks = math.ceil(numel / 64)
    return (numel + 1) // 2 + blocks + 4 * math.ceil(blocks / 256) + 4 * (16 + 256 + 1)


class HostCopy:
    """Where an offloaded tensor's values would be on the host: the layout the offloader's
    `torch.empty_like(tensor, device="cpu")` gives it (preserve_format: the same strides when the tensor fills its
    memory exactly, else contiguous), worked out here without an allocation the trace would count."""

    def __init__(self, tensor: torch.Tensor):
        self.shape, self.dtype = tensor.shape, tensor.dtype
        dims = sorted((st, s) for s, st in zip(tensor.shape, tensor.stride()) if s != 1)
        dense, expected = True, 1
        for stride, size in dims:
            dense, expected = dense and stride == expected, expected * size
        self.stride = tensor.stride() if dense else None


class MeteredOffloader(ActivationOffloader):
    """trainer.model.offload.ActivationOffloader itself (its predicate, groups, deduplication, last group kept,
    prefetch one block ahead), its copies replaced by accounting: a group sent to the host drops its device
    reference (the storage dies unless something else holds it) and counts its bytes on the host; a tensor brought
    back is a fresh device allocation of the same layout (recorded by the trace)."""

    def __init__(self, device, param_shapes, min_bytes: int | None = None):
        super().__init__("cpu", param_shapes, MIN_BYTES_CUDA if min_bytes is None else min_bytes)
        self.device = torch.device(device)  # under fake_cuda the saved tensors say cuda:0 in the pack hook
        self.host_live = self.host_peak = 0
        self.to_device_bytes = 0

    def _to_host(self, saved) -> None:
        tensor = saved.device_tensor
        saved.host = HostCopy(tensor)
        saved.device_tensor = None
        self.offloaded_bytes += saved.nbytes
        self.host_live += saved.nbytes
        self.host_peak = max(self.host_peak, self.host_live)
        weakref.finalize(saved, self._host_freed, saved.nbytes)

    def _host_freed(self, size: int) -> None:
        self.host_live -= size

    def _from_host(self, saved, stream) -> torch.Tensor:
        host = saved.host
        self.to_device_bytes += saved.nbytes
        device = "meta" if self.device.type == "cuda" else self.device  # fake CUDA's tensors are meta tensors
        if host.stride is None:
            return torch.empty(host.shape, dtype=host.dtype, device=device)
        return torch.empty_strided(host.shape, host.stride, dtype=host.dtype, device=device)


class _NF4Matmul(torch.autograd.Function):
    """x @ W^T with W stored as NF4: dequantised to bf16 for the matmul in forward and again in backward (a
    transient of the layer's bf16 bytes each time), as bitsandbytes' MatMul4Bit does."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        return F.linear(x, layer.dequantize())

    @staticmethod
    def backward(ctx, grad):
        return grad @ ctx.layer.dequantize(), None


class NF4Linear(torch.nn.Module):
    """A frozen base linear layer as bitsandbytes stores it: `nf4_bytes` of its weight (no bias)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = nf4_bytes(linear.weight.numel())
        self.register_buffer("packed", torch.empty(packed, dtype=torch.uint8, device="meta"))

    def dequantize(self) -> torch.Tensor:
        if tracing._TRACE is not None and not tracing._TRACE.suppress:
            n = self.in_features * self.out_features
            tracing._TRACE.add("nf4_dequantize", "other_elementwise", self.packed.numel() + 2 * n)
        return torch.empty((self.out_features, self.in_features), dtype=BF16, device="meta")

    def forward(self, x):
        return _NF4Matmul.apply(x, self)


def apply_lora_r16(model: torch.nn.Module, nf4: bool, dropout: float = 0.0, adapter_dtype=None) -> None:
    """peft's LoRA (r=16, alpha 32, `dropout`) on every linear layer of the blocks (Llama's attention and MLP, a
    mixture of experts' attention, Qwen3.5's Gated DeltaNet projections as well) and on a mixture of experts' expert
    tensors, base frozen (then stored as NF4 when `nf4`); the adapters in the base's dtype as inject_adapter_in_model
    leaves them, or in `adapter_dtype` (fp32: as a PeftModel keeps them beside a bf16 base, its
    autocast_adapter_dtype)."""
    import peft

    for p in model.parameters():
        p.requires_grad_(False)
    linear = {n.rsplit(".", 1)[-1] for n, m in model.model.layers.named_modules() if isinstance(m, torch.nn.Linear)}
    # a mixture of experts' stacked expert tensors too (peft's target_parameters, ours as rank GEMMs)
    experts = [n for n, p in model.named_parameters() if p.dim() == 3 and ".mlp.experts." in n]
    targets = sorted({n.rsplit(".", 1)[-1] for n in experts})
    config = peft.LoraConfig(
        r=16,
        lora_alpha=32,
        lora_dropout=dropout,
        target_modules=sorted(linear),
        target_parameters=[f"mlp.experts.{t}" for t in targets] or None,
    )
    peft.inject_adapter_in_model(config, model)
    if adapter_dtype is not None:
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.data = p.data.to(adapter_dtype)
    if nf4:
        for module in list(model.modules()):
            if isinstance(module, peft.tuners.lora.LoraLayer) and isinstance(module.base_layer, torch.nn.Linear):
                module.base_layer = NF4Linear(module.base_layer)
        nf4_experts(model)


def nf4_experts(model: torch.nn.Module) -> None:
    """Our MoE experts in 4 bits as QLoRA stores them (trainer.model.quant.Experts4bit, `nf4_bytes` per expert
    tensor), in place. transformers' bitsandbytes quantizer leaves its expert tensors (3-D Parameters, not Linear
    layers) in the load dtype: a transformers model keeps them."""
    from trainer.model.moe import Experts

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is Experts:
                setattr(module, name, _nf4_experts_class()(child))


@functools.cache
def _nf4_experts_class():
    """NF4Experts: Experts4bit's forward (dequantize, run, dequantize again in backward) over modelled codes. Built on
    first use: trainer.model.quant imports bitsandbytes."""
    from trainer.model.quant import Experts4bit

    class NF4Experts(Experts4bit):
        def __init__(self, experts):
            torch.nn.Module.__init__(self)
            self.copy_settings(experts)
            self.compute_dtype = BF16
            for name, shape in self.full_shapes.items():
                codes = torch.empty(nf4_bytes(math.prod(shape)), dtype=torch.uint8, device="meta")
                self.register_buffer(f"{name}_nf4", codes)

        def dequantized(self, name: str) -> torch.Tensor:
            if tracing._TRACE is not None and not tracing._TRACE.suppress:
                n = math.prod(self.full_shapes[name])
                tracing._TRACE.add("nf4_dequantize", "other_elementwise", getattr(self, f"{name}_nf4").numel() + 2 * n)
            return torch.empty(self.full_shapes[name], dtype=BF16, device="meta")

    return NF4Experts


class HostParameters:
    """FSDP2's CPU offload, modelled on one process: parameters, gradients and optimizer state live on the host. A
    decoder block's bf16 weights are on the device while it runs in forward, and again from its recompute in backward
    until its last gradient is made; then its gradients go back (freed on the device). The root's parameters
    (embeddings, final norm, LM head) are gathered for the whole step, their gradients sent back as they are made."""

    def __init__(self, model: torch.nn.Module, layers):
        self.layers = list(layers)
        in_layers = {id(p) for layer in self.layers for p in layer.parameters()}
        self.root = [p for p in model.parameters() if id(p) not in in_layers]
        self.gathered: dict[int, torch.Tensor] = {}
        self.pending: dict[int, int] = {}
        self.handles = []
        for index, layer in enumerate(self.layers):
            self.handles.append(layer.register_forward_pre_hook(lambda m, a, i=index: self.gather(i)))
            self.handles.append(layer.register_forward_hook(lambda m, a, o, i=index: self.after_forward(i)))
            for p in layer.parameters():
                self.handles.append(p.register_post_accumulate_grad_hook(lambda p, i=index: self.grad_made(p, i)))
        for p in self.root:
            self.handles.append(p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None)))
        self.root_gathered = torch.empty(sum(nbytes(p) for p in self.root), dtype=torch.uint8, device="meta")

    def gather(self, index: int) -> None:
        if index not in self.gathered:
            size = sum(nbytes(p) for p in self.layers[index].parameters())
            self.gathered[index] = torch.empty(size, dtype=torch.uint8, device="meta")
            self.pending[index] = sum(1 for p in self.layers[index].parameters() if p.requires_grad)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.gathered, self.root_gathered = {}, None

    def after_forward(self, index: int) -> None:
        if tracing._TRACE is not None and tracing._TRACE.phase == "forward":
            self.gathered.pop(index, None)

    def grad_made(self, param, index: int) -> None:
        self.pending[index] -= 1
        if self.pending[index] == 0:
            for p in self.layers[index].parameters():
                p.grad = None
            self.gathered.pop(index, None)


@contextlib.contextmanager
def hf_through_backward(model):
    """transformers' model as it runs on a GPU through forward and the checkpoint's recompute in backward: its
    packed-sequence check reads position ids on the host (`.item()`, which meta tensors cannot give), and each row here
    is one sequence, for which it finds no packing: say so up front; hf_liger's RoPE (bound by `_hf`'s loss for the
    forward call only) stays bound for the recompute."""
    from transformers import masking_utils
    from transformers.models.llama import modeling_llama

    saved = masking_utils.find_packed_sequence_indices, modeling_llama.apply_rotary_pos_emb
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    modeling_llama.apply_rotary_pos_emb = getattr(model, "_roofline_rope", modeling_llama.apply_rotary_pos_emb)
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices, modeling_llama.apply_rotary_pos_emb = saved


@contextlib.contextmanager
def checkpoint_on_meta():
    """torch.utils.checkpoint on fake CUDA: its recompute enters torch.autocast("cuda") where autocast is available
    there, which without CUDA switches the emulated autocast's flag off: say it is not (the flag, on through backward,
    is what the recompute sees, as autocast would be on a GPU). Its check that the recompute saves what forward saved
    compares shape, dtype and device; a meta tensor's device reads cuda:0 or meta depending on which mode sees it, and
    a matmul's saved input is the flattened (tokens, features) view in one and the (1, tokens, features) tensor in
    the other, so the check keeps what memory depends on: the element count and the dtype."""
    available = torch.amp.is_autocast_available
    extractors = torch.utils.checkpoint._allowed_determinism_checks_to_fns
    default = extractors["default"]
    torch.amp.is_autocast_available = lambda device_type: device_type != "cuda" and available(device_type)
    extractors["default"] = lambda t: {"numel": t.numel(), "dtype": t.dtype}
    try:
        yield
    finally:
        torch.amp.is_autocast_available = available
        extractors["default"] = default


@contextlib.contextmanager
def cuda_dropout_on_meta():
    """Dropout as it runs on CUDA, on meta tensors: F.dropout takes PyTorch's fused kernel there (native_dropout, whose
    backward keeps a bool mask; on meta tensors F.dropout would take the CPU's path, whose mask is a tensor of the
    input's dtype). The fused LoRA path's generator state (16 bytes on CUDA) is neither saved nor restored: meta
    tensors draw nothing."""
    import kernels.lora as lora_op

    saved = F.dropout, lora_op._rng_state, lora_op._replayed_rng

    def dropout(x, p=0.5, training=True, inplace=False):
        return torch.native_dropout(x, p, training)[0] if training and p > 0 else x

    F.dropout = dropout
    lora_op._rng_state = lambda device: None
    lora_op._replayed_rng = lambda device, state: contextlib.nullcontext()
    try:
        yield
    finally:
        F.dropout, lora_op._rng_state, lora_op._replayed_rng = saved
