"""Activation offloading (`--activation_offloading`, TRL's name): the tensors autograd saves for backward wait in CPU
memory between a decoder block's forward and its backward, instead of in GPU memory.

How it runs (one `ActivationOffloader` per model, entered around each forward that backward will follow):
- `torch.autograd.graph.saved_tensors_hooks` sees every tensor autograd saves. Kept where it is: tensors under
  `min_bytes`, parameters and anything shaped like one (autocast's cast copies of the weights: a weight goes to the host
  and back every step for nothing), and tensors not on the model's device. The rest are grouped by the decoder block
  whose forward saved them: `CausalLM` calls `on_block(i)` before block i (`CausalLM.block_hooks`, in its layer loop,
  outside any compiled block, so per-block `torch.compile` never traces it).
- When block i starts, the previous group's tensors are copied to pinned CPU memory on a side CUDA stream: the copy
  overlaps block i's compute, and the allocator frees the device copy once the side stream is past it
  (`record_stream`). The last group (the last block's saves and the loss's) is never offloaded: backward needs it at
  once.
- In backward, the first tensor unpacked from group g starts copying group g - 1 back on another side stream
  (prefetch, one block ahead), and each unpack waits only for its own copy's event. A tensor saved several times
  (the same storage, size, strides: q, k and v's projections save the same normed input) is copied once.
- With gradient checkpointing, autograd saves only each block's inputs (torch.utils.checkpoint's non-reentrant
  frame saves them with `save_for_backward`), so those are what goes to the host; inside a checkpointed block the
  checkpoint's own hooks decide, and nothing there is offloaded.
- Without CUDA (the tests, a CPU run) the same code runs with the copies made at once on the caller's stream.

Exactness: the values come back bit for bit (copies, no casts); the tests compare gradients and weights with and
without offloading. A saved tensor that is not dense comes back contiguous (same values, other strides).

What it costs: each offloaded byte crosses PCIe twice per step. At short sequence lengths the copies outlast the
block's compute and the step slows down; `bench.roofline --ladder` models where they hide.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable

import torch
from torch import nn

from trainer.coerce import ConfigError

MIN_BYTES_CUDA = 1 << 20  # smaller saved tensors stay on the GPU: a copy costs more than it frees
# The effective pinned host <-> device copy rate per direction: PCIe Gen5 x16's 64 GB/s (H100/H200 SXM) derated
# (an assumption, not measured here; a Gen4 card gets about half). `hiding_note` and bench.roofline's ladder use it.
COPY_BYTES_PER_S = 50e9


class _Saved:
    """One offloaded tensor (maybe saved several times): where its values are now."""

    __slots__ = (
        "device_tensor",
        "host",
        "d2h_done",
        "h2d_done",
        "nbytes",
        "forward",
        "group",
        "unpacks_left",
        "__weakref__",
    )

    def __init__(self, tensor: torch.Tensor, forward: int, group: int):
        self.device_tensor: torch.Tensor | None = tensor
        self.host: torch.Tensor | None = None
        self.d2h_done = None  # torch.cuda.Event of the copy to the host
        self.h2d_done = None  # torch.cuda.Event of the prefetch back
        self.nbytes = tensor.numel() * tensor.element_size()
        self.forward = forward  # which forward saved it (ActivationOffloader.forwards)
        self.group = group
        self.unpacks_left = 1


class ActivationOffloader:
    """Offload the activations a model's forward saves to (pinned) CPU memory; see the module docstring.

    `param_shapes`: tensors of these shapes are never offloaded (the model's parameters and their cast copies);
    group boundaries come from `on_block` (`for_model` hooks it into the model's layer loop); `min_bytes`: the
    smallest tensor offloaded (default 1 MiB on CUDA, 0 on the CPU, where there is no transfer to amortise and the
    tests want every tensor to take the path)."""

    def __init__(self, device: torch.device, param_shapes: Iterable[torch.Size], min_bytes: int | None = None):
        self.device = _indexed(device)
        self.cuda = self.device.type == "cuda"
        self.min_bytes = _min_bytes(self.device, min_bytes)
        # a weight's shape and its transpose's (matmuls save weight.t() of autocast's cast copy)
        self.param_shapes = {shape for s in param_shapes for shape in (tuple(s), tuple(s)[::-1])}
        self.d2h_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.h2d_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.active = False
        self.offloaded_bytes = 0  # the last forward's bytes sent to the host
        self.resident_bytes = 0  # the last forward's saved bytes this offloader left on the device (its last group)
        # The current forward's saves by group, as weak references: the autograd graph owns them, so a graph freed
        # frees its host copies; _by_view holds the group being filled (dedup) until it is offloaded.
        self.forwards = 0
        self._groups: list[list[weakref.ref]] = [[]]
        self._by_view: dict[tuple, _Saved] = {}
        self._prefetched: set[int] = set()

    @classmethod
    def for_model(cls, model: nn.Module, device, min_bytes: int | None = None) -> ActivationOffloader:
        """The offloader attached to `model` (its `block_hooks` call `on_block`; one per model: a second call with the
        same settings returns the first); parameters' shapes never offloaded."""
        hooks = getattr(model, "block_hooks", None)
        if hooks is None:
            raise ConfigError(
                f"activation_offloading: {type(model).__name__} has no decoder-block hooks (block_hooks); it needs "
                "kernelwright's CausalLM (trainer.build.build_model / load_pretrained)"
            )
        device = _indexed(device)
        for hook in hooks:
            same = getattr(hook, "__self__", None)
            if isinstance(same, cls) and (same.device, same.min_bytes) == (device, _min_bytes(device, min_bytes)):
                return same
        offloader = cls(device, (p.shape for p in model.parameters()), min_bytes)
        hooks.append(offloader.on_block)
        return offloader

    @contextlib.contextmanager
    def __call__(self):
        """Around a forward whose backward follows: saves made inside are offloaded (backward may run outside)."""
        self._groups, self._by_view, self._prefetched = [[]], {}, set()
        self.forwards += 1
        self.offloaded_bytes = 0
        self.active = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield self
        finally:
            self.active = False
            self._by_view = {}
            self.resident_bytes = sum(s.nbytes for s in _alive(self._groups[-1]) if s.device_tensor is not None)

    # ---- forward -------------------------------------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor):
        if (
            not self.active
            or tensor.device != self.device
            or tensor.numel() * tensor.element_size() < self.min_bytes
            or isinstance(tensor, nn.Parameter)
            or tuple(tensor.shape) in self.param_shapes
        ):
            return tensor
        # the view's identity while the tensor is alive (it is: _by_view holds it until its group is offloaded); the
        # storage by its object, not its address: meta tensors (bench.roofline's traces) all have address 0
        key = (
            tensor.untyped_storage()._cdata,
            tensor.storage_offset(),
            tensor.shape,
            tensor.stride(),
            tensor.dtype,
        )
        saved = self._by_view.get(key)
        if saved is not None:
            saved.unpacks_left += 1
            return saved
        saved = _Saved(tensor.detach(), self.forwards, len(self._groups) - 1)
        self._groups[-1].append(weakref.ref(saved))
        self._by_view[key] = saved
        return saved

    pack.gives_back_as_saved = True  # trainer.model.causal_lm._recompute_allowed: these hooks change no value

    def on_block(self, index: int) -> None:
        """Called before decoder block `index` runs: the saves so far (the previous block's) go to the host."""
        if not self.active or not torch.is_grad_enabled():
            return
        if self.cuda:  # the copies start after what the compute stream has queued so far (the group's producers)
            self.d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
        for saved in _alive(self._groups[-1]):
            self._to_host(saved)
        self._by_view = {}
        self._groups.append([])

    def _to_host(self, saved: _Saved) -> None:
        tensor = saved.device_tensor
        # preserve_format: the same strides where the tensor fills its memory (permuted views: attention's q, k, v),
        # else contiguous
        host = torch.empty_like(tensor, device="cpu", pin_memory=self.cuda)
        if self.cuda:
            with torch.cuda.stream(self.d2h_stream):
                host.copy_(tensor, non_blocking=True)
                saved.d2h_done = torch.cuda.Event()
                saved.d2h_done.record()
            tensor.record_stream(self.d2h_stream)  # its memory is reused only once the copy is done
        else:
            host.copy_(tensor)
        saved.host, saved.device_tensor = host, None
        self.offloaded_bytes += saved.nbytes

    # ---- backward ------------------------------------------------------------------------------------------------
    def unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        if saved.forward == self.forwards and saved.group not in self._prefetched:
            self._prefetched.add(saved.group)
            if saved.group > 0:
                for earlier in _alive(self._groups[saved.group - 1]):
                    self._prefetch(earlier)
        tensor = saved.device_tensor
        if tensor is None:  # not prefetched (the first group reached, or a second backward): fetch it now
            tensor = self._from_host(saved, torch.cuda.current_stream(self.device) if self.cuda else None)
        elif saved.h2d_done is not None:
            torch.cuda.current_stream(self.device).wait_event(saved.h2d_done)
        saved.unpacks_left -= 1
        if saved.unpacks_left <= 0 and saved.host is not None:
            saved.device_tensor, saved.h2d_done = None, None  # the host copy stays for a retained graph
        return tensor

    def _prefetch(self, saved: _Saved) -> None:
        if saved.host is None or saved.device_tensor is not None:
            return
        saved.device_tensor = self._from_host(saved, self.h2d_stream)
        if self.cuda:
            saved.device_tensor.record_stream(torch.cuda.current_stream(self.device))  # used by the backward there
            with torch.cuda.stream(self.h2d_stream):
                saved.h2d_done = torch.cuda.Event()
                saved.h2d_done.record()

    def _from_host(self, saved: _Saved, stream) -> torch.Tensor:
        host = saved.host
        if stream is None:
            return host.to(self.device)  # on the CPU: the host copy itself
        stream.wait_event(saved.d2h_done)
        with torch.cuda.stream(stream):
            return torch.empty_like(host, device=self.device).copy_(host, non_blocking=True)


def _indexed(device) -> torch.device:
    """`device` as saved tensors name it: cuda:N, not cuda."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _min_bytes(device: torch.device, min_bytes: int | None) -> int:
    return (MIN_BYTES_CUDA if device.type == "cuda" else 0) if min_bytes is None else min_bytes


def _alive(refs: list[weakref.ref]) -> list[_Saved]:
    return [s for s in (r() for r in refs) if s is not None]


def hiding_note(offloaded_bytes: int, tokens: int, flops_per_token: float, peak_flops: float) -> str | None:
    """One line when a forward's copies to the host (at COPY_BYTES_PER_S) would outlast that forward's compute (a
    third of the training FLOPs, at the device's peak): then they cannot hide and the step slows down. None when
    they can. A model, said as one."""
    forward_s = tokens * flops_per_token / 3 / peak_flops
    copy_s = offloaded_bytes / COPY_BYTES_PER_S
    if copy_s <= forward_s:
        return None
    return (
        f"activation_offloading: a forward of {tokens} tokens sends {offloaded_bytes / 1e9:.2f} GB to the host, "
        f"~{1e3 * copy_s:.0f} ms at {COPY_BYTES_PER_S / 1e9:.0f} GB/s against ~{1e3 * forward_s:.0f} ms of forward "
        "compute at peak (modelled): the copies will not hide and steps slow down; longer sequences hide them "
        "better, and without a memory shortage it is better off"
    )
