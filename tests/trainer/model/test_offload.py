"""Activation offloading (trainer/model/offload.py, issue 30 item 1) on the CPU, where the same code runs with the
copies made at once: gradients bit for bit those of the same step without it (fp32 and bf16 autocast, our kernels
through the Triton interpreter, with and without gradient checkpointing, LoRA), and the saved bytes left resident
between forward and backward counted against an independent count of what autograd saves."""

import weakref

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from trainer.config.args import TrainingArguments
from trainer.model.causal_lm import CausalLM, ModelConfig
from trainer.model.lora import apply_lora
from trainer.model.offload import COPY_BYTES_PER_S, ActivationOffloader, hiding_note
from trainer.parallel.transforms import apply_compile

LAYERS, T = 4, 24
CONFIG = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def model_and_batch(use_kernels=True, checkpointing=False, lora=False):
    model = CausalLM(ModelConfig(**CONFIG), use_kernels=use_kernels)
    model.init_weights(seed=0)
    if lora:
        apply_lora(model, TrainingArguments(use_peft=True, lora_r=4, lora_alpha=8, seed=0))
    model.set_gradient_checkpointing(checkpointing)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, T), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100
    return model.train(), ids, labels


def step(model, ids, labels, offloader=None, dtype=None):
    model.zero_grad()
    torch.manual_seed(0)  # LoRA's dropout draws
    with offloader() if offloader else torch.enable_grad():
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = model(ids, labels=labels).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize(
    "use_kernels,checkpointing,lora,dtype",
    [
        (True, False, False, None),
        (True, False, False, torch.bfloat16),
        (True, True, False, torch.bfloat16),
        (True, False, True, torch.bfloat16),
        (False, True, True, None),
    ],
)
def test_gradients_bit_for_bit_with_and_without_offloading(use_kernels, checkpointing, lora, dtype):
    model, ids, labels = model_and_batch(use_kernels, checkpointing, lora)
    plain_loss, plain = step(model, ids, labels, dtype=dtype)
    offloader = ActivationOffloader.for_model(model, "cpu")
    loss, grads = step(model, ids, labels, offloader, dtype)
    assert offloader.offloaded_bytes > 0 and offloader.resident_bytes > 0
    assert torch.equal(loss, plain_loss)
    assert len(grads) == len(plain) and all(torch.equal(a, b) for a, b in zip(grads, plain))


class Box:
    def __init__(self, tensor):
        self.tensor = tensor


def saved_bytes_by_block(model, ids, labels, dtype=torch.bfloat16):
    """An independent count of the bytes autograd holds for backward when the forward ends, per decoder block (the
    saves before block 0 in entry 0, block i's in entry i + 1, the loss's with the last block's): one count per
    distinct tensor in a block, still held when the forward ends (a save whose graph branch died before is not),
    parameters and tensors shaped like one or like its transpose (autocast's copies, which matmuls save
    transposed) left out, as the offloader leaves them."""
    shapes = {s for p in model.parameters() for s in (tuple(p.shape), tuple(p.shape)[::-1])}
    boxes, seen = [[]], set()

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
        box = Box(t)
        if not isinstance(t, torch.nn.Parameter) and tuple(t.shape) not in shapes and key not in seen:
            seen.add(key)
            boxes[-1].append((weakref.ref(box), t.numel() * t.element_size()))
        return box

    pack.gives_back_as_saved = True  # as the offloader's: the model's MLP takes the same path under both

    def on_block(index):
        boxes.append([])
        seen.clear()

    model.block_hooks.append(on_block)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.tensor), torch.autocast("cpu", dtype=dtype):
        loss = model(ids, labels=labels).loss
    model.block_hooks.remove(on_block)
    held = [sum(n for ref, n in block if ref() is not None) for block in boxes]
    loss.backward()
    return held


@pytest.mark.parametrize("checkpointing", [False, True])
def test_only_the_last_block_stays_resident(checkpointing):
    model, ids, labels = model_and_batch(checkpointing=checkpointing)
    blocks = saved_bytes_by_block(model, ids, labels)
    assert len(blocks) == LAYERS + 1 and all(b > 0 for b in blocks)
    offloader = ActivationOffloader.for_model(model, "cpu")
    step(model, ids, labels, offloader, torch.bfloat16)
    assert offloader.resident_bytes == blocks[-1]  # the last block's saves and the loss's
    assert offloader.offloaded_bytes == sum(blocks[:-1])
    if checkpointing:  # a checkpointed block saves only its inputs: the residual stream and the MLP's output
        assert max(blocks[1:-1]) <= 2 * 2 * T * CONFIG["hidden_size"] * 4
    # a tensor of min_bytes or more goes; smaller ones stay, and are no longer counted as offloaded
    big = ActivationOffloader.for_model(model, "cpu", min_bytes=T * CONFIG["hidden_size"] * 4)
    step(model, ids, labels, big, torch.bfloat16)
    assert 0 < big.offloaded_bytes < offloader.offloaded_bytes


def test_a_retained_graph_backs_up_twice_and_a_graph_freed_frees_its_copies():
    import gc

    model, ids, labels = model_and_batch()
    offloader = ActivationOffloader.for_model(model, "cpu")
    with offloader():
        loss = model(ids, labels=labels).loss
    saves = [r for group in offloader._groups for r in group]
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss.backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), first))
    del loss
    gc.collect()
    assert saves and all(r() is None for r in saves)  # the host copies went with the graph
    with torch.no_grad(), offloader():
        model(ids)
    assert offloader.offloaded_bytes == 0  # nothing is saved without grad


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_blocks_offload_what_they_save_and_match(checkpointing, backend):
    """Each block compiled (aot_eager: AOTAutograd's saves at run time, in seconds; inductor: ~25 s per case on a
    CPU, so marked slow): the compiled blocks' saves reach the hooks, and the gradients are still bit for bit."""
    model, ids, labels = model_and_batch(use_kernels=False, checkpointing=checkpointing)
    apply_compile(model, backend, None)
    plain_loss, plain = step(model, ids, labels, dtype=torch.bfloat16)
    offloader = ActivationOffloader.for_model(model, "cpu")
    loss, grads = step(model, ids, labels, offloader, torch.bfloat16)
    assert offloader.offloaded_bytes > 0
    assert torch.equal(loss, plain_loss) and all(torch.equal(a, b) for a, b in zip(grads, plain))


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", [False, True])
def test_cuda_streams_give_the_same_gradients_and_free_device_memory(checkpointing):
    """On a GPU the copies run on side streams: the gradients are still bit for bit, and the memory the forward
    leaves allocated for backward drops by what went to the host (the last block's saves stay).

    Attention runs on SDPA's math backend here: the flash backend's backward accumulates dQ with atomics, so two
    plain steps differ in their last bits (seen on an H200: the losses equal, gradients not), and a bit-for-bit
    comparison needs a step that repeats itself; the test shows that it does before comparing."""
    torch.manual_seed(0)
    config = dict(CONFIG, hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4)
    model = CausalLM(ModelConfig(**config), use_kernels=True).cuda()
    model.init_weights(seed=0)
    model.set_gradient_checkpointing(checkpointing)
    ids = torch.randint(0, config["vocab_size"], (4, 2048), device="cuda")

    def run(offloader):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with sdpa_kernel(SDPBackend.MATH):
            with offloader() if offloader else torch.enable_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(ids, labels=ids).loss
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # frees the blocks the side stream was still recorded on (record_stream)
            held = torch.cuda.memory_allocated() - before
            loss.backward()
        return held, loss.detach(), [p.grad.clone() for p in model.parameters()]

    plain_held, plain_loss, plain = run(None)
    _, again_loss, again = run(None)
    assert torch.equal(again_loss, plain_loss) and all(torch.equal(a, b) for a, b in zip(again, plain)), (
        "two plain steps differ: this comparison needs a deterministic step"
    )
    offloader = ActivationOffloader.for_model(model, "cuda")
    held, loss, grads = run(offloader)
    assert torch.equal(loss, plain_loss) and all(torch.equal(a, b) for a, b in zip(grads, plain))
    assert offloader.offloaded_bytes > 0
    assert held <= plain_held - 0.9 * offloader.offloaded_bytes


def test_the_note_says_when_copies_cannot_hide_behind_the_forward():
    """A forward of 4096 tokens at 6e9 training FLOPs per token on a 1e15 FLOP/s device computes for 8.2 ms: 1 GB
    of copies (20 ms at 50 GB/s) cannot hide; 0.2 GB (4 ms) can."""
    assert COPY_BYTES_PER_S == 50e9
    note = hiding_note(10**9, 4096, 6e9, 1e15)
    assert note.startswith("activation_offloading: a forward of 4096 tokens sends 1.00 GB to the host, ~20 ms")
    assert "at 50 GB/s against ~8 ms of forward compute" in note
    assert hiding_note(2 * 10**8, 4096, 6e9, 1e15) is None


def test_a_save_is_shared_by_views_of_one_storage_only():
    """Saves of one view (the same storage, offset, shape, strides) are one copy; two storages of the same shape are
    two, also on the meta device, where every storage's address is 0 (bench.roofline's ladder traces: merging them
    dropped a tensor from the modelled device memory)."""
    for device in ("cpu", "meta"):
        offloader = ActivationOffloader(torch.device(device), [], min_bytes=0)
        a, b = torch.empty(4, 8, device=device), torch.empty(4, 8, device=device)
        offloader.active = True
        assert offloader.pack(a) is offloader.pack(a)
        assert offloader.pack(a) is not offloader.pack(b)
