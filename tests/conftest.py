"""Test-wide setup.

TRITON_INTERPRET=1 must be in the environment before `@triton.jit` decorates any kernel, so it is set
here, before anything imports `kernels`. With it, CPU tensors run the Triton kernels through the
interpreter (the dispatch rule in `kernels._dispatch`); trainer tests switch back to the reference path
in `tests/trainer/conftest.py` because the interpreter costs ~37 us per program instance.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
