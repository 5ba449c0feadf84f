"""Build script: the pure-Python packages always; the CUDA C++ ops in csrc/ only where they can be built.

The extension `kernels._C` is compiled when all of these hold:
- csrc/ holds sources (ops.cpp and <op>.cu files),
- PyTorch is importable in the build environment and is a CUDA build (`pip install --no-build-isolation .`
  lets the build see the installed torch; with build isolation it cannot, and the build is skipped),
- `nvcc` is found (CUDA_HOME or PATH),
- KERNELWRIGHT_SKIP_CUDA_BUILD is not set to 1.
KERNELWRIGHT_FORCE_CUDA_BUILD=1 turns a skip into an error (for CI images that must have the ops).
TORCH_CUDA_ARCH_LIST picks the architectures (default "9.0" for H100/H200), MAX_JOBS limits parallel
compile jobs. Otherwise the package installs without the extension, with a warning, never a failure:
every op has a Triton kernel and a PyTorch reference.
"""

import glob
import os
import shutil
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _warn(msg: str) -> None:
    print(f"kernelwright setup: {msg}", file=sys.stderr)


def cuda_extensions():
    if os.environ.get("KERNELWRIGHT_SKIP_CUDA_BUILD", "0") == "1":
        _warn("KERNELWRIGHT_SKIP_CUDA_BUILD=1: installing without the CUDA ops")
        return [], {}
    force = os.environ.get("KERNELWRIGHT_FORCE_CUDA_BUILD", "0") == "1"
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "*.cu")))
    reason = None
    if not any(s.endswith(".cu") for s in sources):
        reason = "csrc/ has no .cu sources"
    else:
        try:
            import torch
            from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
        except Exception:
            reason = "PyTorch is not importable in the build environment (use pip install --no-build-isolation)"
        else:
            if torch.version.cuda is None:
                reason = f"PyTorch {torch.__version__} is not a CUDA build"
            elif CUDA_HOME is None and shutil.which("nvcc") is None:
                reason = "nvcc was not found (set CUDA_HOME)"
    if reason:
        if force:
            raise RuntimeError(f"KERNELWRIGHT_FORCE_CUDA_BUILD=1 but the CUDA ops cannot be built: {reason}")
        _warn(f"{reason}; installing without the CUDA ops (Triton and PyTorch paths still work)")
        return [], {}
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    ext = CUDAExtension(
        name="kernels._C",
        sources=sources,
        # No -std flag: torch.utils.cpp_extension adds the one its headers need (c++20 for torch >= 2.10; a
        # forced c++17 draws warnings from them). No --use_fast_math: it flushes denormals and approximates sqrt
        # and division in every kernel; a kernel that wants fast math uses the intrinsics where it is safe.
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-lineinfo"]},
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)}


ext_modules, cmdclass = cuda_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
