"""4-bit base weights (QLoRA, Dettmers et al. 2023) through bitsandbytes: `--load_in_4bit` with transformers' and
TRL's names (`bnb_4bit_quant_type`, `bnb_4bit_compute_dtype`, `bnb_4bit_use_double_quant`, `bnb_4bit_quant_storage`);
and 8-bit ones (LLM.int8, Dettmers et al. 2022): `--load_in_8bit`, `llm_int8_threshold`, `Linear8bit` below
(bitsandbytes' layer and forward as transformers builds them; DDP only).

What it does: `quantize_base(model, args)`, the first of `trainer.parallel.transforms.apply_transforms` (before LoRA,
so that peft wraps the 4-bit layers with its bitsandbytes LoRA layer, as it does over a transformers model), replaces
every linear layer of the decoder blocks by `Linear4bit`: lm_head stays in full precision (transformers keeps the
output embedding out of quantization too; the fused loss reads its weight) and so do the embeddings and norms. Each
weight is cut into blocks of 64 values, each block scaled by its absmax and rounded to the nearest of 16 NF4 (or FP4)
levels; double quantization stores those absmax scales in 8 bits with one fp32 scale per 256 blocks. Bytes per weight:
0.5 + 4/64 = 0.5625 without double quantization, 0.5 + 1/64 + 4/(64*256) ~ 0.516 with it.

Quantized as they are read: on the meta device (`trainer.build.build_model`) a swapped layer's weight is a meta
tensor of its packed size, so materialising the model allocates 4-bit codes, never the full-precision weights; the
loaders then copy each full-precision tensor (from the safetensors, one tensor at a time, or from a preset's seeded
init) into `quantizing_targets(model)[id(param)]`, whose `copy_` quantizes it on the layer's device and keeps only
the codes and scales. Peak memory is one full-precision tensor above the 4-bit model, plus the memory-mapped shard.
A model that already has its weights (built by hand and given to the Trainer) is quantized layer by layer in place.

`Linear4bit` is bitsandbytes' `Linear4bit` (so peft, transformers' helpers and `bnb.functional` treat it as theirs)
with one forward of ours, `_DequantizedLinear`: y = x dequantize(W)^T (+ bias) in forward, dx = dy dequantize(W) in
backward, the 4-bit weight dequantized again there rather than kept (the values bitsandbytes' MatMul4Bit computes in
training, bit for bit: tests/trainer/model/test_quant.py). It is the same in training and evaluation, which
bitsandbytes' own forward is not: in eval mode without grad on a CPU with AVX512-BF16 it repacks the weight in place,
after which training forwards return no input gradient (the adapters below stop learning, silently), and for one row
at inference it takes another kernel (gemv). Here evaluating between training steps leaves training exact.

DDP, FSDP2 and DeepSpeed ZeRO-2/3 work (the frozen 4-bit codes are parameters like any other: ZeRO-3 partitions and
gathers them; FSDP2 shards the packed codes by rows: every rank quantizes each whole weight as it is read and keeps its
rows of the codes, and the layer keeps the whole quantization state, absmax per block of 64, about 1/32 of the codes'
bytes, so the codes FSDP2 gathers for a block dequantize as one process's; tests/trainer/parallel). The quantization
state lives on the layer (`quant_state`, as bitsandbytes' own layer keeps it), not only on the parameter, which FSDP2
replaces. Refused, in one line while the arguments are checked: 4-bit weights without an adapter (they cannot be
trained), FSDP2 or DeepSpeed with the codes packed in a float dtype (`bnb_4bit_quant_storage`: both cast floating
parameters to their precision), FSDP2 from a DCP copy (`dcp_path`: the layers quantize full-precision weights as they
are read), and a missing bitsandbytes (`pip install 'kernelwright[qlora]'`). bitsandbytes is imported only when
4-bit weights are asked for (it takes seconds to import).

Test: python -m pytest tests/trainer/model/test_quant.py -q
"""

from __future__ import annotations

import math

import bitsandbytes as bnb
import torch
import torch.nn.functional as F
from bitsandbytes.functional import quantize_4bit
from torch import nn
from torch.distributed.tensor import DTensor

import kernels
from trainer.dist import local_shard
from trainer.model.moe import Experts

BLOCKSIZE = 64  # values per absmax block: bitsandbytes' and transformers' default for 4-bit weights
_SKIP = ("lm_head",)  # kept in full precision, as transformers' quantizer keeps the output embedding


class _DequantizedLinear(torch.autograd.Function):
    """y = x W^T + b with W = dequantize(weight) in forward, and again in backward for dx (W frozen: no dW)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, state, bias: torch.Tensor | None) -> torch.Tensor:
        # a frozen parameter, held by the module anyway (FSDP2 gathers it again for backward): nothing is saved
        ctx.weight, ctx.state = weight, state
        ctx.has_bias = bias is not None
        return F.linear(x, dequantize(weight, state).to(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_x = grad @ dequantize(ctx.weight, ctx.state).to(grad.dtype) if ctx.needs_input_grad[0] else None
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return grad_x, None, None, grad_bias


def dequantize(weight: torch.Tensor, state=None) -> torch.Tensor:
    """The full-precision (out, in) weight a Linear4bit's packed `weight` stands for, in the dtype it was quantized
    from: bitsandbytes' dequantize_4bit bit for bit, computed by `kernels.dequantize_4bit` (our Triton kernel on CUDA)
    from the pieces of its quantization state (`state`, else the weight's own quant_state)."""
    state = weight.quant_state if state is None else state
    nested = None
    if state.nested:
        nested = kernels.NestedAbsmax(state.state2.code, state.state2.absmax, state.state2.blocksize, state.offset)
    return kernels.dequantize_4bit(
        weight.data, state.absmax, state.quant_type, state.blocksize, state.shape, state.dtype, nested
    )


class _Settings4bit:
    """What a 4-bit layer quantizes with (its quant_type, double_quant and quant_storage attributes)."""

    def quant_settings(self) -> dict:
        """bitsandbytes' quantization arguments for this layer (`quantize_4bit`'s and `Params4bit`'s names)."""
        return {
            "blocksize": BLOCKSIZE,
            "compress_statistics": self.double_quant,
            "quant_type": self.quant_type,
            "quant_storage": self.quant_storage,
        }


class Linear4bit(_Settings4bit, bnb.nn.Linear4bit):
    """bitsandbytes' Linear4bit with our forward (see the module docstring); built by `from_linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_state is None:
            raise RuntimeError("a Linear4bit was used before its weight was loaded and quantized")
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        return _DequantizedLinear.apply(x.to(self.compute_dtype), self.weight, self.quant_state, bias).to(x.dtype)

    def dequantize_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """`dequantize` of this layer's packed weight as forward sees it (under FSDP2 the gathered codes, which carry
        no state of their own: the layer keeps it)."""
        return dequantize(weight, self.quant_state)

    @classmethod
    def from_linear(cls, linear: nn.Linear, quant_type: str, compute_dtype, double_quant: bool, storage) -> Linear4bit:
        """A Linear4bit standing in for `linear`: its weight quantized now, or, on the meta device, a meta tensor
        of the packed size that `set_weight` fills once the model is materialised. The bias stays a full-precision
        parameter (loaded by name)."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=False,
            compute_dtype=compute_dtype or linear.weight.dtype,
            compress_statistics=double_quant,
            quant_type=quant_type,
            quant_storage=storage,
            device="meta",
        )
        # what set_weight needs, kept on the layer (materialising a meta model turns the weight into a plain tensor)
        layer.quant_type, layer.double_quant, layer.weight_dtype = quant_type, double_quant, linear.weight.dtype
        layer.bias = linear.bias
        if linear.weight.is_meta:  # bitsandbytes' parameter (peft reads its settings), of the packed size
            codes = (linear.in_features * linear.out_features + 1) // 2  # two 4-bit codes a byte
            layer.weight = bnb.nn.Params4bit(
                torch.empty(codes // storage.itemsize, 1, dtype=storage, device="meta"),
                requires_grad=False,
                module=layer,
                bnb_quantized=True,
                **layer.quant_settings(),
            )
        else:
            layer.set_weight(linear.weight.detach(), device=linear.weight.device)
        return layer

    @torch.no_grad()
    def set_weight(self, full: torch.Tensor, device: torch.device | None = None) -> None:
        """Quantize `full` (out, in) in `weight_dtype` on `device` (default: where the layer's weight is) and keep
        only its codes and scales. Sharded by FSDP2 (a DTensor of the packed codes, split by rows), every rank
        quantizes the whole weight and keeps its rows of the codes and the whole state (absmax per block of 64:
        about 1/32 of the codes' bytes), so that the gathered codes dequantize with it as one process's do."""
        full = full.to(device=device or self.weight.device, dtype=self.weight_dtype).contiguous()
        codes, state = quantize_4bit(full, **self.quant_settings())
        self.quant_state = state  # bitsandbytes' Linear4bit keeps it on the module too
        if isinstance(self.weight, DTensor):
            # no quant_state on the sharded parameter: bitsandbytes' state_dict would name its pieces under the
            # weight ("weight.absmax", ...), which torch.distributed.checkpoint cannot find on a DTensor
            local, rows = local_shard(self.weight)
            local.copy_(codes[rows[0] : rows[1]])
            self.weight.full_numel = full.numel()
            return
        self.weight = bnb.nn.Params4bit(
            codes, requires_grad=False, quant_state=state, module=self, bnb_quantized=True, **self.quant_settings()
        )
        self.weight.full_numel = full.numel()


class Experts4bit(_Settings4bit, Experts):
    """Our MoE experts (trainer/model/moe.py) with gate_up_proj and down_proj in 4 bits: each 3-D tensor quantized as
    one weight (blocks of 64 over its flattened values, as bitsandbytes quantizes any tensor), its codes a frozen
    bitsandbytes Params4bit under the same name, its state kept on the module (`quant_states`). The router stays in
    full precision. Forward dequantizes both tensors (`kernels.dequantize_4bit`, bit for bit bitsandbytes') in the
    compute dtype and runs the experts on them, with peft's adapter as rank-r GEMMs; what backward needs of them is
    dequantized again from the codes, not kept (saved-tensor hooks), so a layer's full-precision experts exist only
    while it runs: the same trade as `Linear4bit`. Every other save goes to the saved-tensor hooks around the call
    (gradient checkpointing drops it and recomputes it, activation offloading sends it to the host), as plain experts'
    saves do. Under FSDP2 the packed codes are sharded by rows like a Linear4bit's (`set_weight`): the gathered codes
    of a decoder layer dequantize with the whole state on the module.

    peft's `target_parameters` reads a wrapped tensor's shape from `ds_shape` where there is one (where DeepSpeed
    ZeRO-3 has partitioned it): the packed codes carry their full (E, out, in) shape there, so peft builds the
    adapter of the unquantized tensor."""

    @classmethod
    def from_experts(cls, experts: Experts, quant_type: str, compute_dtype, double_quant: bool, storage) -> Experts4bit:
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.copy_settings(experts)
        layer.quant_type, layer.double_quant, layer.quant_storage = quant_type, double_quant, storage
        layer.weight_dtype = experts.gate_up_proj.dtype
        layer.compute_dtype = compute_dtype or layer.weight_dtype
        layer.quant_states = {}
        for name, shape in layer.full_shapes.items():
            param = getattr(experts, name)
            if param.is_meta:  # packed codes of the full size, filled by set_weight once materialised
                codes = (math.prod(shape) + 1) // 2
                packed = torch.empty(codes // storage.itemsize, 1, dtype=storage, device="meta")
                layer._put(name, packed, None)
            else:
                layer.set_weight(name, param.detach(), device=param.device)
        return layer

    def _put(self, name: str, codes: torch.Tensor, state) -> None:
        param = bnb.nn.Params4bit(
            codes, requires_grad=False, quant_state=state, bnb_quantized=True, **self.quant_settings()
        )
        param.ds_shape = torch.Size(self.full_shapes[name])  # what peft reads (class docstring)
        param.full_numel = math.prod(self.full_shapes[name])
        setattr(self, name, param)

    @torch.no_grad()
    def set_weight(self, name: str, full: torch.Tensor, device: torch.device | None = None) -> None:
        """Quantize the full (E, out, in) tensor `name` in `weight_dtype` on `device` (default: where its codes are)
        and keep only its codes and state; sharded by FSDP2, this rank's rows of the codes (Linear4bit.set_weight)."""
        codes_now = getattr(self, name, None)  # none yet when quantized as the layer is built
        full = full.to(device=device or codes_now.device, dtype=self.weight_dtype).contiguous()
        codes, state = quantize_4bit(full, **self.quant_settings())
        self.quant_states[name] = state
        if isinstance(codes_now, DTensor):
            local, rows = local_shard(codes_now)
            local.copy_(codes[rows[0] : rows[1]])
            codes_now.full_numel = full.numel()
            return
        self._put(name, codes, state)

    def dequantized(self, name: str) -> torch.Tensor:
        """The full-precision tensor `name` its codes stand for, in the dtype it was quantized from."""
        if name not in self.quant_states:
            raise RuntimeError("4-bit experts were used before their weights were loaded and quantized")
        return dequantize(getattr(self, name), self.quant_states[name])

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, loras=None) -> torch.Tensor:
        full = {name: self.dequantized(name).to(self.compute_dtype) for name in self.full_shapes}
        again = {id(_root(t)): name for name, t in full.items()}
        unpacked = {}  # backward's dequantized tensors, once each (the reference saves a view per expert)
        # the hooks around this call (gradient checkpointing's, activation offloading's): hooks pushed here take every
        # save made inside from them, so each save that is not a dequantized tensor is handed to them
        enclosing = torch._C._autograd._top_saved_tensors_default_hooks(False)

        def pack(t):  # a dequantized tensor or a view of one is saved as its name and view, dequantized again
            name = again.get(id(_root(t)))
            if name is not None:
                return name, t.size(), t.stride(), t.storage_offset()
            return t if enclosing is None else (_ENCLOSING, enclosing[0](t))

        def unpack(packed):
            if not isinstance(packed, tuple):
                return packed
            if packed[0] is _ENCLOSING:
                return enclosing[1](packed[1])
            name, *view = packed
            if name not in unpacked:
                unpacked[name] = self.dequantized(name).to(self.compute_dtype)
            return unpacked[name].as_strided(*view)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return self.run(x, index, weights, full["gate_up_proj"], full["down_proj"], loras)


_ENCLOSING = object()  # an Experts4bit save the hooks around its call packed


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage `t` views (PyTorch keeps a view's root as its `_base`)."""
    return t if t._base is None else t._base


class _QuantizingExperts:
    """The loaders' target of a 4-bit experts tensor: its full shape; `copy_` of the whole tensor quantizes it, and
    indexing gives a target of one slice (an expert's 2-D weight on disk), the slices gathered in a full-precision
    buffer until every value is written, then quantized (one tensor's full precision at a time)."""

    is_meta = False

    def __init__(self, layer: Experts4bit, name: str):
        self.layer, self.name = layer, name
        self.shape = torch.Size(layer.full_shapes[name])
        self.dtype = layer.weight_dtype  # what a loader dequantizing MXFP4 expert weights writes (trainer/build.py)
        self.buffer, self.written = None, 0

    def copy_(self, full: torch.Tensor) -> _QuantizingExperts:
        self.layer.set_weight(self.name, full)
        return self

    def __getitem__(self, index) -> _ExpertSlice:
        return _ExpertSlice(self, index)


class _ExpertSlice:
    def __init__(self, parent: _QuantizingExperts, index):
        self.parent, self.index = parent, index
        self.shape = torch.empty(parent.shape, device="meta")[index].shape

    def copy_(self, part: torch.Tensor) -> _ExpertSlice:
        parent = self.parent
        if parent.buffer is None:
            device = getattr(parent.layer, parent.name).device
            parent.buffer = torch.empty(parent.shape, dtype=parent.layer.weight_dtype, device=device)
        parent.buffer[self.index].copy_(part)
        parent.written += part.numel()
        if parent.written == parent.buffer.numel():  # every expert's slice read: quantize, free the buffer
            parent.layer.set_weight(parent.name, parent.buffer)
            parent.buffer, parent.written = None, 0
        return self


class Linear8bit(bnb.nn.Linear8bitLt):
    """bitsandbytes' Linear8bitLt (LLM.int8, Dettmers et al. 2022) as transformers' BitsAndBytesConfig(load_in_8bit=
    True) builds it, with bitsandbytes' own forward: W stored as int8 per output row with its absmax scale (SCB,
    fp32), x quantized per row in the forward, the input features holding a value above `threshold` multiplied in
    16 bits beside the int8 product. Its training and evaluation paths take different kernels but leave the layer
    as it was (tests/trainer/model/test_quant.py). Built by `from_linear`, filled by `set_weight` as read."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, threshold: float) -> Linear8bit:
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=False,
            has_fp16_weights=False,
            threshold=threshold,
            device="meta",
        )
        layer.weight_dtype = linear.weight.dtype
        layer.bias = linear.bias
        if linear.weight.is_meta:  # int8, one byte a weight: what materialising the model allocates
            layer.weight = bnb.nn.Int8Params(
                torch.empty(linear.out_features, linear.in_features, dtype=torch.int8, device="meta"),
                requires_grad=False,
                has_fp16_weights=False,
            )
        else:
            layer.set_weight(linear.weight.detach(), device=linear.weight.device)
        return layer

    @torch.no_grad()
    def set_weight(self, full: torch.Tensor, device: torch.device | None = None) -> None:
        """Quantize `full` (out, in) as bitsandbytes' Int8Params does when moved to a device (through fp16, int8 per
        row with its absmax scale) and keep only the int8 rows and scales."""
        weight = bnb.nn.Int8Params(full.contiguous(), requires_grad=False, has_fp16_weights=False)
        self.weight = weight._quantize(device or self.weight.device)
        self.state.CB = self.state.SCB = None  # a fresh weight: the layer takes its rows and scales in its next forward

    @property
    def scales(self) -> torch.Tensor:
        """The (out,) absmax scales of the int8 rows, wherever bitsandbytes keeps them (the weight until the first
        forward, the layer's state after it)."""
        return self.weight.SCB if self.weight.SCB is not None else self.state.SCB

    def dequantize_weight(self) -> torch.Tensor:
        """W as the int8 rows stand for it, int8 x SCB / 127 (bitsandbytes' int8_vectorwise_dequant), in the dtype
        the layer was built from."""
        return bnb.functional.int8_vectorwise_dequant(self.weight.data, self.scales).to(self.weight_dtype)


class _Quantizing:
    """What the loaders copy a quantized layer's full-precision weight into: it has the full shape, and `copy_`
    quantizes (the layer's `set_weight`)."""

    def __init__(self, layer: Linear4bit | Linear8bit):
        self.layer = layer
        self.shape = torch.Size((layer.out_features, layer.in_features))

    def copy_(self, full: torch.Tensor) -> _Quantizing:
        self.layer.set_weight(full)
        return self


_QUANTIZED = (Linear4bit, Linear8bit, Experts4bit)


def quantizing_targets(model: nn.Module) -> dict[int, _Quantizing | _QuantizingExperts]:
    """id(weight parameter) -> the target the loaders copy its full-precision tensor into, for every quantized
    layer and 4-bit experts tensor."""
    targets = {}
    for m in model.modules():
        if isinstance(m, Experts4bit):
            targets.update({id(getattr(m, name)): _QuantizingExperts(m, name) for name in m.full_shapes})
        elif isinstance(m, _QUANTIZED):
            targets[id(m.weight)] = _Quantizing(m)
    return targets


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, _QUANTIZED) for m in model.modules())


def quantize_base(model: nn.Module, args) -> nn.Module:
    """Every linear layer of `model` but lm_head as a Linear4bit (load_in_4bit) or a Linear8bit (load_in_8bit), in
    place; the model unchanged otherwise, or when it is quantized already (transforms are idempotent)."""
    if not (args.load_in_4bit or args.load_in_8bit) or is_quantized(model):
        return model
    if args.load_in_4bit:
        settings = {
            "quant_type": args.bnb_4bit_quant_type,
            "compute_dtype": getattr(torch, args.bnb_4bit_compute_dtype) if args.bnb_4bit_compute_dtype else None,
            "double_quant": args.bnb_4bit_use_double_quant,
            "storage": getattr(torch, args.bnb_4bit_quant_storage or "uint8"),  # names validated by the arguments
        }

        def quantized(linear):
            return Linear4bit.from_linear(linear, **settings)
    else:

        def quantized(linear):
            return Linear8bit.from_linear(linear, args.llm_int8_threshold)

    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear and child_name not in _SKIP:
                setattr(module, child_name, quantized(child))
            elif type(child) is Experts and args.load_in_4bit:  # 8-bit keeps the experts in full precision
                setattr(module, child_name, Experts4bit.from_experts(child, **settings))
    # transformers' flags, from which peft picks its 4-bit or 8-bit LoRA layer
    setattr(model, "is_loaded_in_4bit" if args.load_in_4bit else "is_loaded_in_8bit", True)
    return model


@torch.no_grad()
def dequantized(model: nn.Module) -> nn.Module:
    """`model` with every Linear4bit replaced by a plain nn.Linear holding dequantize(W) in the dtype it was
    quantized from (in place): the function a QLoRA adapter was trained over, to merge it into."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, Experts4bit):
                plain = Experts.__new__(Experts)
                nn.Module.__init__(plain)
                plain.copy_settings(child)
                for name in child.full_shapes:
                    setattr(plain, name, nn.Parameter(child.dequantized(name), requires_grad=False))
                setattr(module, child_name, plain)
            elif isinstance(child, _QUANTIZED):
                weight = (
                    dequantize(child.weight, child.quant_state)
                    if isinstance(child, Linear4bit)
                    else child.dequantize_weight()
                )
                linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                linear.weight = nn.Parameter(weight, requires_grad=False)
                linear.bias = child.bias
                setattr(module, child_name, linear)
    model.__dict__.pop("is_loaded_in_4bit", None)
    model.__dict__.pop("is_loaded_in_8bit", None)
    return model


def quantized_bytes(model: nn.Module) -> int:
    """Bytes the 4-bit weights of `model` take: codes plus their quantization state (absmax scales, nested scales
    and code book), counted from the tensors."""
    total = 0
    for m in model.modules():
        if isinstance(m, Linear8bit) and m.weight.dtype == torch.int8:
            total += m.weight.numel() + 4 * m.scales.numel()  # int8 rows + fp32 scale per row
        packed = []
        if isinstance(m, Linear4bit) and m.quant_state is not None:
            packed = [(m.weight, m.quant_state)]
        if isinstance(m, Experts4bit):
            packed = [(getattr(m, name), state) for name, state in m.quant_states.items()]
        for codes, state in packed:
            total += codes.numel() * codes.element_size()
            tensors = [state.absmax, state.code]
            if state.nested:
                tensors += [state.state2.absmax, state.state2.code, state.offset]
            total += sum(t.numel() * t.element_size() for t in tensors)
    return total
