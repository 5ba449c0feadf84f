"""Test-wide setup.

TRITON_INTERPRET=1 must be in the environment before `@triton.jit` decorates any kernel, so it is set
here, before anything imports `kernels`. With it, CPU tensors run the Triton kernels through the
interpreter (the dispatch rule in `kernels._dispatch`); trainer tests switch back to the reference path
in `tests/trainer/conftest.py` because the interpreter costs ~37 us per program instance.
`gpu`-marked tests skip without CUDA, and also on CUDA while TRITON_INTERPRET=1 (the interpreter would run the
kernels instead of the GPU): on a GPU machine they run in their own session, `TRITON_INTERPRET=0 pytest -m gpu`.
The shared data cache (trainer/data/cache.py) never is the user's: the session's is a temporary directory, and each
test gets its own (so that a test's first load is a miss, whatever ran before it).
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# liger's fused MoE kernels pinned to one config each (read when liger_kernel.ops.fused_moe_kernels is imported): no
# autotuning benchmark loop under the interpreter, and the tile sizes the roofline's meter test counts with
os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")
# Forced, not setdefault: a user's cache must not receive the test data. Module fixtures that run commands use it.
os.environ["KERNELWRIGHT_DATA_CACHE"] = tempfile.mkdtemp(prefix="kernelwright-test-data-cache-")
atexit.register(shutil.rmtree, os.environ["KERNELWRIGHT_DATA_CACHE"], ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402

# Under pytest-xdist (-n N) the N workers share the cores: each takes its share, so that their thread pools do not
# oversubscribe the machine (on CI's 2 cores, two workers of 2 threads each spent a quarter more CPU time).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(4, (os.cpu_count() or 1) // _WORKERS)))


@pytest.fixture(autouse=True)
def _data_cache(tmp_path_factory, monkeypatch):
    """Each test's own data cache root (commands it starts inherit it through the environment)."""
    monkeypatch.setenv("KERNELWRIGHT_DATA_CACHE", str(tmp_path_factory.mktemp("data-cache")))


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
    elif os.environ["TRITON_INTERPRET"] == "1":
        # The interpreter would run every Triton kernel on host copies of the CUDA tensors: nothing of the GPU
        # path would be tested. The CPU tests need it, so the two kinds run in separate sessions.
        skip = pytest.mark.skip(
            reason="TRITON_INTERPRET=1 would run the Triton kernels in the interpreter, not on "
            "the GPU: run TRITON_INTERPRET=0 python -m pytest -m gpu (or python -m bench.gpu --part tests)"
        )
    else:
        return
    for item in items:
        # get_closest_marker, not `"gpu" in item.keywords`: keywords also hold the names of the folders on the
        # test's path, so every test of a checkout under a folder named gpu was skipped as a GPU test.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
