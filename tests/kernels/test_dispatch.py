"""What `import kernels` costs and the compile-time constant it keeps cheap (issue 29 item 2): importing kernels
loads neither torch._dynamo nor torch._inductor (together about 3 s on a CPU, 5x torch's own import), and
`kernels._dispatch.num_sms` is marked constant for torch.compile the way torch's own decorator marks a function."""

import os
import subprocess
import sys

import torch

from kernels._dispatch import num_sms


def test_import_kernels_loads_neither_dynamo_nor_inductor():
    heavy = "('torch._dynamo', 'torch._inductor')"
    code = f"import sys, kernels; print(sorted(m for m in sys.modules if m.startswith({heavy})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_num_sms_carries_what_assume_constant_result_sets():
    def plain():
        return 0

    marked = torch.compiler.assume_constant_result(plain)
    assert marked is plain and vars(plain)  # the decorator marks the function in place, by attributes
    assert vars(plain).items() <= vars(num_sms).items()


def test_a_function_marked_like_num_sms_is_a_constant_under_fullgraph():
    def untraceable(i: int) -> int:
        return 3 + i + 0 * os.getpid()  # os.getpid breaks a fullgraph trace unless the call is a constant

    untraceable.__dict__.update(vars(num_sms))

    @torch.compile(backend="eager", fullgraph=True)
    def f(x):
        return x * untraceable(1)

    torch._dynamo.reset()
    assert torch.equal(f(torch.ones(2)), torch.full((2,), 4.0))
