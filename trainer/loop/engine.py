"""The engines the training loop calls, and the choice between them: PyTorch's (`TorchEngine`, one process, DDP
or FSDP2) and DeepSpeed's (`trainer.parallel.deepspeed_engine.DeepSpeedRun`). Both have the same methods, so the loop
(trainer/loop/trainer.py) calls `engine.*` and knows neither by name:

- `model`, `optimizer`, `scheduler`, `scaler`: what the engine runs (under DeepSpeed `model` is its engine module
  around the model; `scaler` is PyTorch's fp16 GradScaler, None under DeepSpeed, which scales fp16 losses itself);
- `backward(loss, last)`: one micro batch's backward, gradients accumulated; `last` marks the window's last;
- `step(host_sync, before_update)`: clip, bring the step's numbers to the host (`host_sync(grad_norm)` returns
  the window's (loss, gradient norm) as Python floats: the step's one host sync), call `before_update()`, then
  update the weights or skip a non-finite update, zero the gradients and step the scheduler after a real update.
  Returns (loss, gradient norm, stepped, finite, overflow): whether the update reached the weights, whether the
  loss (and, without a loss scaler, the gradient norm) was finite, and whether fp16's loss scaler skipped the
  update and lowered the scale;
- `save_checkpoint(directory)` / `load_checkpoint(directory, weights_only=False)`: the engine's part of a
  checkpoint-N directory (every rank calls them): the optimizer, scheduler and scaler (with the model under
  FSDP2 and DeepSpeed, whose shards or partitions hold it), or with `weights_only` the model's weights alone;
- `full_state_dict()`: the whole model's weights for the Hugging Face export where the engine must gather them
  (DeepSpeed), None where `trainer.loop.resume.save_model_files` reads the model itself (PyTorch: whole tensors, or
  FSDP2 shards it gathers);
- `frozen(model)`: a frozen model (DPO's reference) as the engine runs it beside the policy (DeepSpeed's: an
  inference engine of its own, partitioned like the policy under ZeRO-3);
- `full_weights()`: a context holding the model with its whole weights, to generate with (GRPO's completions):
  FSDP2's units unsharded and ZeRO-3's partitions gathered for its duration, so that decoding makes no collective;
- `same_world_only`: None where a checkpoint resumes under another number of processes
  (`trainer.loop.resume.check_resume_across_worlds`), else what ties it to its own (DeepSpeed's ZeRO partitions).

Test: python -m pytest tests/trainer/loop/test_trainer.py tests/trainer/parallel/test_deepspeed.py -q
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from trainer.loop.checkpoint import read_state
from trainer.loop.resume import load_model_and_optimizer, load_model_weights
from trainer.parallel.deepspeed_engine import DeepSpeedRun
from trainer.parallel.deepspeed_engine import check_args as check_deepspeed_args
from trainer.parallel.transforms import DCP_DIR, full_weights, is_fsdp, save_sharded, unwrap, uses_deepspeed

OPTIMIZER_FILE, SCHEDULER_FILE, SCALER_FILE = "optimizer.pt", "scheduler.pt", "scaler.pt"


class TorchEngine:
    """PyTorch's engine over a model (plain, DDP or FSDP2), its optimizer and schedule, and under fp16 a dynamic loss
    scaler: an overflow skips the step, lowers the scale and is counted, and the scheduler does not advance, as in
    Hugging Face."""

    same_world_only = None  # DCP reshards `dcp/`; optimizer.pt of one process or DDP splits into FSDP2's shards

    def __init__(self, model, optimizer, scheduler, scaler, *, max_grad_norm: float | None, device, rank: int):
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.max_norm = max_grad_norm if max_grad_norm and max_grad_norm > 0 else float("inf")
        self.device = device  # where a gradient norm of no parameters is made
        self.rank = rank

    @classmethod
    def initialize(cls, model, args, *, device, rank: int, make_optimizer, make_scheduler, scaler=None):
        """The optimizer (`make_optimizer(model)`, after FSDP2's sharding), its schedule (`make_scheduler`) and, under
        fp16, a GradScaler (`scaler`: one kept from an earlier call)."""
        optimizer = make_optimizer(model)
        scheduler = make_scheduler(optimizer)
        if args.fp16 and scaler is None:
            scaler = torch.amp.GradScaler(device.type)
        return cls(model, optimizer, scheduler, scaler, max_grad_norm=args.max_grad_norm, device=device, rank=rank)

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Backward of one micro batch through the loss scale (fp16), gradients accumulated in `.grad`. `last` needs
        nothing here: DDP/FSDP2 reduce in the last micro batch's backward through `parallel.gradient_sync`, which
        wraps the forward too."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, host_sync, before_update) -> tuple[float, float | None, bool, bool, bool]:
        """Unscale (fp16), clip, the host sync, `before_update()`, then the optimizer step (through the scaler under
        fp16) or a skip of a non-finite update; the gradients zeroed either way, the scheduler stepped only after
        a real update. Returns (loss, grad_norm, stepped, finite, overflow) (module docstring)."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        if params:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm)
        else:
            grad_norm = torch.zeros((), device=self.device)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: the norm over every rank's shards (already used to clip)
            grad_norm = grad_norm.full_tensor()
        loss, norm = host_sync(grad_norm)
        finite = math.isfinite(loss) and math.isfinite(norm)
        before_update()
        stepped = overflow = False
        if self.scaler is not None:
            # Non-finite gradients under fp16 are an overflow: the scaler skips the update and lowers the scale.
            # Only a non-finite loss counts as a non-finite step then.
            finite = math.isfinite(loss)
            scale_before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            stepped = self.scaler.get_scale() >= scale_before and finite
            overflow = self.scaler.get_scale() < scale_before
        elif finite:
            self.optimizer.step()
            stepped = True
        self.optimizer.zero_grad(set_to_none=True)
        if stepped:
            self.scheduler.step()
        return loss, norm, stepped, finite, overflow

    def save_checkpoint(self, directory: Path) -> None:
        """The optimizer (FSDP2: with the model, every rank its shards in `dcp/`; otherwise identical on every rank,
        so rank 0 writes it), the scheduler and the scaler into a checkpoint directory."""
        if is_fsdp(self.model):
            save_sharded(self.model, self.optimizer, directory / DCP_DIR)
        elif self.rank == 0:
            torch.save(self.optimizer.state_dict(), directory / OPTIMIZER_FILE)
        if self.rank == 0:
            torch.save(self.scheduler.state_dict(), directory / SCHEDULER_FILE)
            if self.scaler is not None:
                torch.save(self.scaler.state_dict(), directory / SCALER_FILE)

    def load_checkpoint(self, directory: Path, *, weights_only: bool = False) -> None:
        """A checkpoint's scheduler, scaler (where it has one), model and optimizer, in this run's layout (saved under
        any number of processes); or the model's weights alone."""
        if weights_only:
            load_model_weights(self.model, directory)
            return
        self.scheduler.load_state_dict(read_state(directory, SCHEDULER_FILE))
        if self.scaler is not None and (directory / SCALER_FILE).is_file():
            self.scaler.load_state_dict(read_state(directory, SCALER_FILE))
        load_model_and_optimizer(directory, self.model, self.optimizer, rank=self.rank)

    def full_state_dict(self) -> None:
        """None: `trainer.loop.resume.save_model_files` reads the model's own tensors (gathering FSDP2's shards)."""
        return None

    def frozen(self, model):
        """A frozen model (DPO's reference) as this engine runs it: PyTorch's runs it as it is."""
        return model

    def full_weights(self):
        """A context holding the model (DDP's unwrapped) with its whole weights, to generate with: FSDP2's units
        stay unsharded from their first forward to the end (`trainer.parallel.transforms.full_weights`)."""
        return full_weights(unwrap(self.model))


def check_engine_args(args, world_size: int) -> None:
    """The engine's checks of the arguments against the files they name, before anything is built (`Trainer`
    construction; `trainer.cli_args.check_run` for the command line): under dist_config deepspeed its JSON, read and
    checked against the arguments and `world_size` (one line each, `ConfigError`). PyTorch's engine reads no file."""
    if uses_deepspeed(args):
        check_deepspeed_args(args, world_size=world_size)


def start_engine(
    model, args, *, running, device, rank: int, world_size: int, max_steps: int, make_optimizer, make_scheduler, scaler
):
    """The engine of a train() call: DeepSpeed's under dist_config deepspeed, built once (it wraps the model; on a
    later call `running` is it), else PyTorch's over the optimizer and schedule `make_optimizer`/`make_scheduler`
    return (the Trainer's own where it has them) and the fp16 loss scaler kept from an earlier call (`scaler`)."""
    if not uses_deepspeed(args):
        return TorchEngine.initialize(
            model,
            args,
            device=device,
            rank=rank,
            make_optimizer=make_optimizer,
            make_scheduler=make_scheduler,
            scaler=scaler,
        )
    if isinstance(running, DeepSpeedRun):
        return running
    return DeepSpeedRun.initialize(
        model,
        args,
        world_size=world_size,
        max_steps=max_steps,
        make_optimizer=make_optimizer,
        make_scheduler=make_scheduler,
    )
