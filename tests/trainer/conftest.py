"""Trainer tests run the kernels' reference path by default (the interpreter is far too slow for whole
models); a test that wants the Triton kernels through the interpreter uses `kernels.backend("triton")`."""

import pytest

import kernels


@pytest.fixture(autouse=True)
def _reference_kernels():
    with kernels.backend("reference"):
        yield
