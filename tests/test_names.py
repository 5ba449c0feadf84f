"""kernelwright's package names `kernels` and `trainer` are also Hugging Face's kernel hub and Coqui's trainer
(issue 29 item 3): with either in the environment, the commands and `import kernels` stop with one line naming both,
instead of running the wrong code. Neither package is installed here: each is simulated by a package of that name
found first on the path, or by a distribution's metadata of that name."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, *args, extra_path=()):
    """Python in tmp_path (first on sys.path) with this checkout, then extra_path, on PYTHONPATH."""
    env = {"PYTHONPATH": ":".join([str(ROOT), *map(str, extra_path)]), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def _foreign_package(tmp_path, name):
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("raise RuntimeError('the foreign package ran')\n")


def test_a_kernels_found_first_stops_the_commands_with_one_line(tmp_path):
    _foreign_package(tmp_path, "kernels")
    out = _run(tmp_path, "-m", "trainer.sft", "--help")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"kernelwright: the `kernels` Python finds first ({tmp_path / 'kernels'}) is not")
    assert "Hugging Face's `kernels` (the kernel hub)" in out.stderr and "virtual environment" in out.stderr
    lib = _run(tmp_path, "-c", "import trainer")  # a library import: an ImportError with the same line
    assert lib.returncode == 1 and "ImportError: kernelwright: the `kernels` Python finds first" in lib.stderr
    assert "the foreign package ran" not in out.stderr + lib.stderr


def test_a_trainer_found_first_stops_import_kernels_with_one_line(tmp_path):
    _foreign_package(tmp_path, "trainer")
    out = _run(tmp_path, "-c", "import kernels")
    assert out.returncode == 1 and "the foreign package ran" not in out.stderr
    assert out.stderr.splitlines()[-1] == (
        f"ImportError: kernelwright: the `trainer` Python finds first ({tmp_path / 'trainer'}) is not kernelwright's "
        f"({ROOT / 'trainer'}): Coqui's `trainer`, or another package of that name, comes before it on sys.path; "
        "install kernelwright in a virtual environment of its own (python -m venv .venv)"
    )


@pytest.mark.parametrize(
    ("name", "who"), [("kernels", "Hugging Face's `kernels` (the kernel hub)"), ("trainer", "Coqui's `trainer`")]
)
def test_an_installed_distribution_of_either_name_is_one_line(tmp_path, name, who):
    site = tmp_path / "site"
    (site / f"{name}-0.18.2.dist-info").mkdir(parents=True)
    (site / f"{name}-0.18.2.dist-info" / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.18.2\n"
    )
    out = _run(tmp_path, "-m", "trainer.sft", "--help", extra_path=[site])
    assert out.returncode == 2 and out.stderr == (
        f"kernelwright: {who} 0.18.2 is installed in this environment and has kernelwright's package name `{name}`; "
        f"install kernelwright in a virtual environment of its own (python -m venv .venv), or pip uninstall {name}\n"
    )


def test_transformers_never_takes_our_kernels_for_hugging_faces():
    """transformers reads the version of the distribution that holds a top-level `kernels` (ours: kernelwright's) and
    uses the hub kernels from KERNELS_MIN_VERSION on; pyproject.toml keeps our version below it."""
    import_utils = pytest.importorskip("transformers.utils.import_utils")
    from packaging.version import Version

    assert import_utils.is_kernels_available() is False
    available, version = import_utils._is_package_available("kernels", return_version=True)
    if available:  # this project installed (editable or not): its version stands for `kernels`
        assert Version(version) < Version(import_utils.KERNELS_MIN_VERSION)


def test_this_checkout_imports_cleanly(tmp_path):
    out = _run(tmp_path, "-c", "import kernels, trainer; print(trainer.TrainingArguments.__name__)")
    assert out.returncode == 0 and out.stdout == "TrainingArguments\n", out.stderr


# bitsandbytes' CPU backend as an AVX512-BF16 CPU imports it, on any CPU: its probe answers yes (a meta path hook
# replaces bitsandbytes.functional.has_avx512bf16 as that module is loaded, before the backend reads it)
_AVX512_BF16 = """
import importlib.abc, importlib.machinery, sys
class Probe(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "bitsandbytes.functional":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            module.has_avx512bf16 = lambda: True
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, Probe())
"""


@pytest.mark.parametrize("first", ["", "import trainer; "])
def test_bitsandbytes_hub_lookup_on_an_avx512_bf16_cpu(tmp_path, first):
    """bitsandbytes' `from kernels import get_kernel` finds ours on an AVX512-BF16 CPU and logs a failure line (what a
    user who imports it alone sees, README); imported where kernelwright is (the commands, the API, the tests), no
    line."""
    pytest.importorskip("bitsandbytes")
    env_path = [p for p in sys.path if p.endswith("site-packages")]
    out = _run(tmp_path, "-c", _AVX512_BF16 + first + "import bitsandbytes, peft", extra_path=env_path)
    assert out.returncode == 0, out.stderr
    failure = "Failed to load CPU gemm_4bit_forward from kernels-community: cannot import name 'get_kernel'"
    if first:
        assert "Failed to load" not in out.stderr and "get_kernel" not in out.stderr, out.stderr
    else:
        assert failure in out.stderr, out.stderr
