"""A CPU-only install has no triton (it is an extra: CUDA builds of torch bring their own). Without it `import
kernels` and the whole CPU trainer work on the references, and forcing the Triton backend is one clear error.

Each check runs in a fresh interpreter where `import triton` fails (`sys.modules["triton"] = None`), with the
test-wide TRITON_INTERPRET=1 removed from its environment (set back where a test forces Triton)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # a tiny run: ~15 s on 2 shared cores

NO_TRITON = "import sys; sys.modules['triton'] = None\n"


def run_without_triton(code: str, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KERNELS_BACKEND")}
    return subprocess.run(
        [sys.executable, "-c", NO_TRITON + code],
        cwd=ROOT,
        env={**base, **env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def test_the_cpu_trainer_runs_without_triton(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"reverse: ab{i}"},
                        {"role": "assistant", "content": f"{i}ba"},
                    ]
                }
            )
            + "\n"
            for i in range(16)
        )
    )
    out = tmp_path / "out"
    code = (
        "import kernels\n"
        "assert not kernels.HAS_TRITON\n"
        "from trainer import sft\n"
        f"code = sft.main(['--model', 'tiny', '--data', {str(data)!r}, '--output_dir', {str(out)!r}, "
        "'--max_steps', '2', '--per_device_train_batch_size', '4', '--disable_tqdm', 'true'])\n"
        "assert 'triton' not in {m.split('.')[0] for m, v in sys.modules.items() if v is not None}\n"
        "raise SystemExit(code)\n"
    )
    done = run_without_triton(code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "model.safetensors").is_file()
    assert json.loads((out / "final_metrics.json").read_text())["global_step"] == 2


def test_forcing_triton_without_it_says_how_to_install_it():
    code = (
        "import torch, kernels\n"
        "try:\n"
        "    kernels.rms_norm(torch.ones(2, 8), torch.ones(8))\n"
        "except RuntimeError as exc:\n"
        "    print(exc)\n"
    )
    for env in ({"KERNELS_BACKEND": "triton"}, {"TRITON_INTERPRET": "1"}):
        done = run_without_triton(code, **env)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = done.stdout.strip().splitlines()
        assert len(lines) == 1 and "triton is not installed: pip install triton" in lines[0], (env, done.stdout)


def test_a_plain_install_brings_what_the_main_job_uses_and_no_triton():
    """README command 1 (`pip install torch==2.13.0 -e .`) must draw loss_curve.png (matplotlib) and never pull
    triton (about 1 GB) into a CPU-only environment; the tests' extra brings triton for the interpreter."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [d.split(";")[0].split(">")[0].split("=")[0].strip() for d in project["dependencies"]]
    assert "matplotlib" in names and "triton" not in names
    assert any(d.startswith("triton") for d in project["optional-dependencies"]["test"])


def test_the_cli_refuses_a_forced_triton_backend_without_triton_in_one_line(tmp_path):
    out = tmp_path / "out"
    code = f"from trainer.sft import main\nraise SystemExit(main(['--model', 'tiny', '--output_dir', {str(out)!r}]))\n"
    done = run_without_triton(code, KERNELS_BACKEND="triton")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert (
        lines[0].startswith("error: use_kernels: ")
        and "pip install triton" in lines[0]
        and "--use_kernels false" in lines[0]
    )
    assert not out.exists()
