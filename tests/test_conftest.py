"""tests/conftest.py's rules for `gpu`-marked tests, checked in a pytest subprocess over a throwaway test file."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour: gpu-marked tests skip")
def test_gpu_marker_comes_from_markers_not_from_folder_names(tmp_path):
    # A checkout under a folder named `gpu` had every test skipped: the folder's name is one of item.keywords.
    folder = tmp_path / "gpu"
    folder.mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", folder / "conftest.py")
    (folder / "test_probe.py").write_text(
        "import pytest\n\ndef test_cpu():\n    pass\n\n@pytest.mark.gpu\ndef test_gpu():\n    pass\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(folder)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "1 passed, 1 skipped" in out.stdout, out.stdout + out.stderr
    assert "needs a CUDA device" in out.stdout


@pytest.mark.gpu
def test_gpu_session_runs_compiled_kernels_not_the_interpreter():
    """Under TRITON_INTERPRET=1 a gpu test would run the interpreter on host copies of CUDA tensors."""
    from triton.runtime.jit import JITFunction

    from kernels.rms_norm import _rms_norm_fwd_kernel

    assert os.environ.get("TRITON_INTERPRET", "0") != "1"
    assert isinstance(_rms_norm_fwd_kernel, JITFunction)
