"""One rank of a multi-process test run (tests/trainer/parallel/test_distributed.py starts one per rank, as torchrun
would: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the environment).

    python tests/trainer/parallel/dist_worker.py SPEC.json

SPEC: {"data": a JSONL file, "presets": {name: config.json dict} added to trainer.build.PRESETS, "jobs": [job, ...]},
the jobs run one after the other in the same process group (starting Python and importing torch costs ~5-10 s
per process on a loaded machine: one launch serves many runs).

A training job is {"output": its directory, "args": TrainingArguments overrides, "model": a transformers model
directory (the transformers path) or null for the small CausalLM, "resume": a checkpoint path or
null, "fail_at_step": a step at which rank 1 raises, or null, "nan_at_step": a step whose losses rank 1 makes NaN,
or null, "metrics": true to evaluate with tests.trainer.parallel.test_distributed.eval_metrics, "host_labels_probe":
true to run `HostLabelsProbe`}. Rank 0 writes output/result.json (the logged losses, the eval metrics, the non-finite
steps counted) and every job ends with the consolidated model in output/final.

A preference job is {"output", "args", "pairs": a preference JSONL file, "pref": PreferenceArguments, "resume": a
checkpoint path or null, "lora": true to put a LoRA adapter (args' use_peft settings) on the model before
the trainer gets it}: DPO (`trainer.methods.preference.PreferenceTrainer`) on the pairs, then an evaluation on them;
rank 0 writes result.json (with what each rank holds of the reference model: `reference_holding`).

A sampling job is {"output", "args", "sample": {...}}: GRPO's sampler inside the engine's `full_weights()`, each rank
stopping after its own number of decoding steps (`sample` says more).

A build job is {"output", "args", "build": {"model": a preset or directory, "seed": int}}: the model is loaded as
`python -m trainer.sft` loads it (`trainer.build.build_model`; sharded without a full copy under dist_config fsdp2,
whose dcp_path may name a DCP copy) while `FullSizeWatch` counts full-size tensors and every safetensors read is
recorded; rank 0 writes output/gathered.safetensors (the model gathered) and result.json (per rank: the reads,
the peak of full-size tensors alive at once; the greedy tokens the sharded model generates).

An exception on any rank is reported and ends the job through `trainer.dist.end_on_error`, as the CLI does.
"""

from __future__ import annotations

import json
import math
import os
import sys
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("KERNELS_BACKEND", "reference")  # the interpreter is far too slow for whole models

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from trainer import build as build_module  # noqa: E402
from trainer import checkpoint_hf  # noqa: E402
from trainer.config.args import TrainingArguments  # noqa: E402
from trainer.data.sft_data import load_sft_dataset  # noqa: E402
from trainer.data.tokenizer import byte_level_tokenizer  # noqa: E402
from trainer.dist import end_on_error, init_distributed  # noqa: E402
from trainer.loop.callbacks import TrainerCallback  # noqa: E402
from trainer.loop.trainer import Trainer  # noqa: E402

torch.set_num_threads(1)  # two ranks share the test machine's cores


class FailAt(TrainerCallback):
    """Rank 1 raises at the end of `step`: the others are then waiting for it in the next collective."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank

    def on_step_end(self, args, state, control, **kwargs):
        if self.rank == 1 and state.global_step == self.step:
            raise RuntimeError(f"injected failure on rank 1 at step {self.step}")


class NanAt(TrainerCallback):
    """Rank 1's training losses of optimizer step `step` become NaN (a forward hook multiplies them), as a
    diverging model's would: the step must be skipped on every rank."""

    def __init__(self, step: int, rank: int, model):
        self.step, self.active = step, False
        if rank == 1:
            model.register_forward_hook(self.poison)

    def on_step_begin(self, args, state, control, **kwargs):
        self.active = state.global_step + 1 == self.step

    def poison(self, module, inputs, output):
        if self.active and module.training and output.loss is not None:
            output.loss = output.loss * float("nan")
        return output


class HostLabelsProbe:
    """What FSDP2's root pre-forward moves to the device and how many rows the fused loss's matmuls see.

    On a CPU mesh FSDP2 skips its input move (it moves only to an accelerator); here its root pre-forward takes
    that branch anyway (the privateuse1 backend answers "cpu" while it runs), so its own `_to_kwargs` runs and
    records the tensor arguments it would move. The fused loss runs its Triton path (the interpreter) with the
    token passes' rows counted: with host labels they are the kept rows only."""

    def __init__(self):
        import importlib

        from torch.distributed.fsdp._fully_shard import _fsdp_state

        import kernels

        self.moved = []  # per root pre-forward: names of the tensor keyword arguments FSDP2 moves
        self.calls = []  # per loss call: [rows the token passes saw, targets kept, targets in all]
        flce = importlib.import_module("kernels.fused_linear_cross_entropy")
        to_kwargs, root_pre_forward, token_pass = (
            _fsdp_state._to_kwargs,
            _fsdp_state.FSDPState._root_pre_forward,
            flce._token_pass,
        )
        fused = kernels.fused_linear_cross_entropy

        def spy_to_kwargs(args, kwargs, device, use_side_stream):
            self.moved.append(sorted(k for k, v in (kwargs or {}).items() if isinstance(v, torch.Tensor)))
            return to_kwargs(args, kwargs, device, use_side_stream)

        def as_on_an_accelerator(state, module, args, kwargs):
            state._lazy_init()
            name = torch._C._get_privateuse1_backend_name
            torch._C._get_privateuse1_backend_name = lambda: "cpu"
            try:
                return root_pre_forward(state, module, args, kwargs)
            finally:
                torch._C._get_privateuse1_backend_name = name

        def counted_token_pass(hidden, *args, **kwargs):
            self.calls[-1][0] += hidden.shape[0]
            return token_pass(hidden, *args, **kwargs)

        def triton_loss(hidden, weight, target, *args, **kwargs):
            self.calls.append([0, int((target != -100).sum()), target.numel()])
            with kernels.backend("triton"):
                return fused(hidden, weight, target, *args, **kwargs)

        self.saved = [
            (_fsdp_state, "_to_kwargs", to_kwargs),
            (_fsdp_state.FSDPState, "_root_pre_forward", root_pre_forward),
            (flce, "_token_pass", token_pass),
            (kernels, "fused_linear_cross_entropy", fused),
        ]
        _fsdp_state._to_kwargs = spy_to_kwargs
        _fsdp_state.FSDPState._root_pre_forward = as_on_an_accelerator
        flce._token_pass = counted_token_pass
        kernels.fused_linear_cross_entropy = triton_loss

    def close(self):
        """Put back what __init__ replaced (the next job in this process runs unprobed)."""
        for owner, name, value in self.saved:
            setattr(owner, name, value)


def file_backed(t: torch.Tensor) -> bool:
    """Whether `t`'s memory is a mapping of a file (Linux): safetensors >= 0.6 returns views of a copy-on-write mmap
    of the file, so a full-shape view costs address space, and only the pages of the rows copied out are read."""
    ptr = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= ptr < high:
                return len(fields) >= 6 and fields[5].startswith("/")
    return False


class FullSizeWatch(TorchDispatchMode):
    """Counts the memory blocks of a full weight's size alive at the same time: plain float tensors (not meta, not
    DTensor; DTensor's own index arithmetic makes int64 ones) of one of `shapes` (the full shapes of the sharded
    parameters) that fill their whole storage (a view of a part of something bigger allocates nothing), once per
    storage, unless it maps a file. `peak` is the most at once, `file_views` how many full-shape views of mapped
    files went by."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.alive, self.peak, self.file_views = set(shapes), {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if (
                type(t) is not torch.Tensor
                or t.is_meta
                or not t.is_floating_point()
                or tuple(t.shape) not in self.shapes
            ):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.alive or storage.nbytes() != t.numel() * t.element_size():
                continue
            if file_backed(t):
                self.file_views += 1
                continue
            self.alive[key] = weakref.ref(t, lambda _, k=key: self.alive.pop(k, None))
        self.peak = max(self.peak, len(self.alive))
        return out


def watched_shapes(config, world_size: int, rank: int) -> set:
    """Full shapes of the parameters FSDP2 splits on this rank, minus any shape that is also a local shard's here."""
    from trainer.model.causal_lm import CausalLM

    with torch.device("meta"):
        shapes = [tuple(p.shape) for p in CausalLM(config).parameters()]
    local = set()
    for s in shapes:
        chunk = math.ceil(s[0] / world_size)
        local.add((max(0, min(chunk, s[0] - rank * chunk)), *s[1:]))
    return {s for s in shapes if s not in local}


def build(job: dict) -> None:
    from trainer.build import build_model, is_preset, preset_config, read_config
    from trainer.dist import local_shard
    from trainer.model.causal_lm import generate
    from trainer.parallel.transforms import full_model_state_dict

    rank, world_size = init_distributed()
    out = Path(job["output"])
    args = TrainingArguments(**{"output_dir": str(out / "run"), **job["args"]})
    name, seed = job["build"]["model"], job["build"].get("seed", 0)
    config = preset_config(name)[0] if is_preset(name) else read_config(name)
    reads, read_tensor = [], checkpoint_hf.read_tensor

    def spy(f, key, rows=None):
        tensor = read_tensor(f, key, rows)
        reads.append([key, list(rows) if rows else None, list(tensor.shape)])
        return tensor

    checkpoint_hf.read_tensor = spy
    watch = FullSizeWatch(watched_shapes(config, world_size, rank))
    try:
        with watch:
            model, _ = build_model(name, args, seed=seed)
    finally:
        checkpoint_hf.read_tensor = read_tensor
    shards = {n: [list(p.shape), list(local_shard(p)[0].shape)] for n, p in model.named_parameters()}
    mine = {
        "rank": rank,
        "reads": reads,
        "peak_full_size_alive": watch.peak,
        "watched_shapes": len(watch.shapes),
        "full_size_file_views": watch.file_views,
        "shards": shards,
    }
    everyone = [None] * world_size
    torch.distributed.all_gather_object(everyone, mine)
    tokens = generate(model, [5, 6, 7, 8], 6)  # decode_step gathers the root's weights (a collective)
    state = full_model_state_dict(model)
    if rank == 0:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.clone() for k, v in state.items()}, str(out / "gathered.safetensors"))
        (out / "result.json").write_text(
            json.dumps({"ranks": everyone, "generated": tokens, "sharded": type(model).__name__})
        )


def sample(job: dict) -> None:
    """A sampling job, {"output", "args", "sample": {"model": a preset, "prompts": [[ids], ...], "lengths": the
    max_completion_length of each rank}}: the engine of `args` (FSDP2's or DeepSpeed's) over the preset's seed-0
    model; rank r samples 2 greedy completions of its share of the prompts inside `engine.full_weights()`, up to
    its own length (ranks stop after different numbers of decoding steps), twice over; then a forward through the
    engine on every rank. Rank 0 writes result.json: {"tokens": per rank, "logits": the forward's last logits}."""
    from trainer.build import build_model
    from trainer.dist import local_device
    from trainer.loop.engine import start_engine
    from trainer.methods.grpo_sampling import sample_completions

    rank, world_size = init_distributed()
    out = Path(job["output"])
    args = TrainingArguments(**{"output_dir": str(out / "run"), **job["args"]})
    spec = job["sample"]
    model, _ = build_model(spec["model"], args, seed=0)
    engine = start_engine(
        model,
        args,
        running=None,
        device=local_device(),
        rank=rank,
        world_size=world_size,
        max_steps=1,
        make_optimizer=lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.0),
        make_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
        scaler=None,
    )
    share = len(spec["prompts"]) // world_size
    prompts = spec["prompts"][rank * share : (rank + 1) * share]
    tokens = []
    for _ in range(2):  # the context leaves the engine as it found it: entered again, it samples the same
        with engine.full_weights() as policy:
            got = sample_completions(
                policy, prompts, 2, spec["lengths"][rank], temperature=0.0, first_completion_index=rank * share * 2
            )
        tokens.append(got.completion_ids.tolist())
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor(spec["prompts"][:1], device=local_device())).logits
    everyone = [None] * world_size
    torch.distributed.all_gather_object(everyone, tokens)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps({"tokens": everyone, "logits": logits[0, -1].tolist()}))


def run_preference(job: dict) -> None:
    """A preference job, {"output", "args", "pairs": a preference JSONL file, "pref": PreferenceArguments, "resume",
    "model"?}:
    DPO on the pairs; rank 0 writes result.json (the logged losses and reward margins, the eval metrics, what each
    rank holds of the reference model)."""
    from tests.trainer.loop.test_trainer import small_model
    from trainer.data.preference_data import load_preference_dataset
    from trainer.methods.preference import PreferenceArguments, PreferenceTrainer

    rank, world_size = init_distributed()
    out = Path(job["output"])
    tokenizer = byte_level_tokenizer()
    pairs = load_preference_dataset([job["pairs"]], tokenizer, show_progress=False)
    args = TrainingArguments(output_dir=str(out / "run"), **job["args"])
    # "model": a transformers model directory, built as the CLI builds it (the transformers path)
    model = build_module.build_model(job["model"], args)[0] if job.get("model") else small_model()
    if job.get("lora"):  # the adapter on the model as given: the reference is the model with it disabled
        from trainer.model.lora import apply_lora, init_adapter_weights

        model = apply_lora(model, args)
        init_adapter_weights(model, seed=0)
    trainer = PreferenceTrainer(
        model=model,
        args=args,
        pref=PreferenceArguments(**job["pref"]),
        train_dataset=pairs,
        eval_dataset=pairs,
        processing_class=tokenizer,
    )
    trainer.train(resume_from_checkpoint=job.get("resume"))
    metrics = trainer.evaluate()
    trainer.save_model(str(out / "final"))
    holding = [reference_holding(trainer.ref_model)] * world_size
    if torch.distributed.is_initialized():
        torch.distributed.all_gather_object(holding, holding[0])
    if rank == 0:
        logs = [h for h in trainer.state.log_history if "loss" in h]
        (out / "result.json").write_text(
            json.dumps(
                {
                    "world_size": world_size,
                    "losses": [h["loss"] for h in logs],
                    "margins": [h["rewards/margins"] for h in logs],
                    "metrics": metrics,
                    "reference_holding": holding,
                }
            )
        )


def reference_holding(ref) -> dict | None:
    """What this rank holds of the reference model between forwards: {"type", "numel": the full parameter count,
    "held": the elements stored here (a ZeRO-3 partition `ds_tensor` plus whatever `data` is gathered)}; None
    without a reference model."""
    if ref is None:
        return None
    params = list(ref.parameters())
    return {
        "type": type(ref).__name__,
        "numel": sum(getattr(p, "ds_numel", p.numel()) for p in params),
        "held": sum(p.numel() + (p.ds_tensor.numel() if hasattr(p, "ds_tensor") else 0) for p in params),
    }


def run(data: str, job: dict) -> None:
    from tests.trainer.loop.test_trainer import small_model

    if "build" in job:
        return build(job)
    if "sample" in job:
        return sample(job)
    if "pairs" in job:
        return run_preference(job)
    rank, world_size = init_distributed()
    out = Path(job["output"])
    dataset = load_sft_dataset([data], byte_level_tokenizer(), cutoff_len=64, show_progress=False)
    args = TrainingArguments(**{"output_dir": str(out / "run"), **job["args"]})
    callbacks = [FailAt(job["fail_at_step"], rank)] if job.get("fail_at_step") else []
    compute_metrics = None
    if job.get("metrics"):
        from tests.trainer.parallel.test_distributed import eval_metrics as compute_metrics
    probe = HostLabelsProbe() if job.get("host_labels_probe") else None
    # "model": a transformers model directory, built as the CLI builds it (the transformers path: FSDP2 or DDP applied)
    model = build_module.build_model(job["model"], args)[0] if job.get("model") else small_model()
    if job.get("nan_at_step"):
        callbacks.append(NanAt(job["nan_at_step"], rank, model))
    loss_grad_outputs = []  # the gradient reaching each training loss: 1.0 unless the loop scales the loss

    def record_loss_grad(module, inputs, output):
        if output.loss is not None and output.loss.requires_grad:
            output.loss.register_hook(lambda g: loss_grad_outputs.append(g.item()))

    model.register_forward_hook(record_loss_grad)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=dataset,
        eval_dataset=dataset,
        callbacks=callbacks,
        compute_metrics=compute_metrics,
        processing_class=byte_level_tokenizer(),
    )
    trainer.train(resume_from_checkpoint=job.get("resume"))
    state = trainer.state
    metrics = trainer.evaluate()
    trainer.save_model(str(out / "final"))
    if rank == 0:
        losses = [h["loss"] for h in state.log_history if "loss" in h]
        (out / "result.json").write_text(
            json.dumps(
                {
                    "losses": losses,
                    "world_size": world_size,
                    "eval_loss": metrics["eval_loss"],
                    "metrics": metrics,
                    "nonfinite_steps": state.nonfinite_steps,
                    "loss_grad_outputs": loss_grad_outputs,
                    "probe": probe and {"moved": probe.moved, "calls": probe.calls},
                    # the hooks the model's layer loop calls: an offloader's, with what the last forward sent
                    "offloaded_bytes": [h.__self__.offloaded_bytes for h in getattr(model, "block_hooks", [])],
                }
            )
        )
    if probe is not None:
        probe.close()


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    build_module.PRESETS.update(spec.get("presets") or {})
    try:
        for job in spec["jobs"]:
            run(spec["data"], job)
    except Exception as exc:
        return end_on_error(exc)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
