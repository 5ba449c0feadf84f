"""One rank of a multi-process test run (tests/trainer/test_distributed.py starts one per rank, as torchrun would:
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the environment).

    python tests/trainer/dist_worker.py SPEC.json

SPEC: {"data": a JSONL file, "jobs": [job, ...]}, the jobs run one after the other in the same process group
(starting Python and importing torch costs ~5-10 s per process on a loaded machine: one launch serves many
runs). A job is {"output": its directory, "args": TrainingArguments overrides, "resume": a checkpoint path or
null, "fail_at_step": a step at which rank 1 raises, or null}. Rank 0 writes output/result.json (the logged
losses, the eval loss) and every job ends with the consolidated model in output/final. An exception on any
rank is reported and ends the job through `trainer.parallel.end_on_error`, as the CLI does.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("KERNELS_BACKEND", "reference")  # the interpreter is far too slow for whole models

import torch  # noqa: E402

from trainer.args import TrainingArguments  # noqa: E402
from trainer.callbacks import TrainerCallback  # noqa: E402
from trainer.data import load_sft_dataset  # noqa: E402
from trainer.parallel import end_on_error, init_distributed  # noqa: E402
from trainer.tokenizer import byte_level_tokenizer  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402

torch.set_num_threads(1)  # two ranks share the test machine's cores


class FailAt(TrainerCallback):
    """Rank 1 raises at the end of `step`: the others are then waiting for it in the next collective."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank

    def on_step_end(self, args, state, control, **kwargs):
        if self.rank == 1 and state.global_step == self.step:
            raise RuntimeError(f"injected failure on rank 1 at step {self.step}")


def run(data: str, job: dict) -> None:
    from tests.trainer.test_trainer import small_model

    rank, world_size = init_distributed()
    out = Path(job["output"])
    dataset = load_sft_dataset([data], byte_level_tokenizer(), cutoff_len=64, show_progress=False)
    args = TrainingArguments(**{"output_dir": str(out / "run"), **job["args"]})
    callbacks = [FailAt(job["fail_at_step"], rank)] if job.get("fail_at_step") else []
    trainer = Trainer(model=small_model(), args=args, train_dataset=dataset, eval_dataset=dataset,
                      callbacks=callbacks)
    state = trainer.train(resume_from_checkpoint=job.get("resume"))
    metrics = trainer.evaluate()
    trainer.save_model(str(out / "final"))
    if rank == 0:
        losses = [h["loss"] for h in state.log_history if "loss" in h]
        (out / "result.json").write_text(json.dumps({"losses": losses, "world_size": world_size,
                                                     "eval_loss": metrics["eval_loss"]}))


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
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
