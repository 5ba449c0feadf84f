"""kernelwright's two top-level names, `kernels` and `trainer`, are also the names of two PyPI packages: Hugging Face's
`kernels` (the kernel hub, which transformers and bitsandbytes look up by module name) and Coqui's `trainer`. Installed
into one environment with kernelwright, such a package shares its folder in site-packages (files overwritten), or is
found first on the path (the wrong code imported). Importing this module runs `check()`, which says which in one line
instead. Standard library only: kernels/__init__.py imports it first, and trainer/__init__.py runs it from this file's
path, before anything imports a `kernels` that might not be ours.
"""

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

HOME = Path(__file__).resolve().parent.parent  # the folder holding kernelwright's kernels/ and trainer/
OTHERS = {"kernels": "Hugging Face's `kernels` (the kernel hub)", "trainer": "Coqui's `trainer`"}
FIX = "install kernelwright in a virtual environment of its own (python -m venv .venv)"


def name_collision() -> str | None:
    """One line naming the other package that takes `kernels` or `trainer` in this environment, or None."""
    for name, other in OTHERS.items():
        try:
            version = importlib.metadata.version(name)  # a distribution of that name (kernelwright's is kernelwright)
        except importlib.metadata.PackageNotFoundError:
            pass
        else:
            return (
                f"kernelwright: {other} {version} is installed in this environment and has kernelwright's package "
                f"name `{name}`; {FIX}, or pip uninstall {name}"
            )
        spec = importlib.util.find_spec(name)  # where the import system finds it (not imported)
        found = Path(spec.origin).resolve().parent if spec is not None and spec.origin else None
        if found is not None and found.parent != HOME:
            return (
                f"kernelwright: the `{name}` Python finds first ({found}) is not kernelwright's ({HOME / name}): "
                f"{other}, or another package of that name, comes before it on sys.path; {FIX}"
            )
    return None


def check() -> None:
    """Raise ImportError with `name_collision`'s line; a command (`python -m trainer.<command>`) prints it alone and
    exits 2."""
    line = name_collision()
    if line is None:
        return
    if sys.orig_argv[1:2] == ["-m"] and sys.orig_argv[2:3] and sys.orig_argv[2].startswith("trainer."):
        print(line, file=sys.stderr)
        raise SystemExit(2)
    raise ImportError(line)


check()
