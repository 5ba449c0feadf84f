"""One causal-LM model type through `python -m trainer.sft`, in its own process (tests/trainer/model/test_every_type.py
starts one per type: a type whose default sizes need gigabytes, or whose code crashes, cannot take the others down).

    python tests/trainer/model/type_sweep_worker.py MODEL_TYPE DIRECTORY

Writes a tiny random checkpoint of MODEL_TYPE (tiny_hf.write_tiny) in DIRECTORY/model, then runs two training steps on
the embedded tasks into DIRECTORY/out, and prints one JSON line: {"type", "written": the checkpoint could be written
(else "why": what transformers said), "code": the command's exit code, "stderr_errors": its lines starting with
"error", "report": its "transformers path: ..." line, "out_exists", "traceback": whether a traceback was printed}.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from tests.trainer.model.tiny_hf import write_tiny  # noqa: E402
from trainer import sft  # noqa: E402

STEPS = ["--max_steps", "2", "--per_device_train_batch_size", "2", "--eval_exact_match", "false"]
QUIET = ["--disable_tqdm", "true", "--save_strategy", "no", "--eval_strategy", "no", "--report_to", "none"]


def main() -> int:
    model_type, directory = sys.argv[1], Path(sys.argv[2])
    result = {"type": model_type}
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            path = write_tiny(model_type, directory / "model")
    except Exception as exc:  # transformers cannot make a tiny model of this type from its defaults: not ours to test
        result.update(written=False, why=f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}")
        print(json.dumps(result))
        return 0
    out = directory / "out"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = sft.main(["--model", str(path), "--output_dir", str(out), *STEPS, *QUIET])
    lines = err.getvalue().splitlines()
    result.update(
        written=True,
        code=code,
        stderr_errors=[line for line in lines if line.startswith("error")],
        report=next((line for line in lines if line.startswith("transformers path: ")), None),
        out_exists=out.exists(),
        traceback=any(line.startswith("Traceback") for line in lines),
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
