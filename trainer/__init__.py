"""trainer: a lean, exact trainer for fine-tuning Llama-family LLMs, with Hugging Face `Trainer` and TRL semantics.

The public names, one import each (`from trainer import Trainer, TrainingArguments`); each is loaded when first
asked for, so `import trainer` itself stays cheap. The folders below hold the rest, each importing only from those
below it: config/, model/, data/, parallel/, build, loop/, methods/ (docs/architecture.md).
"""

import importlib
import importlib.util
import logging
from pathlib import Path

# kernels/_names.py run from its path beside this folder (a `kernels` found first elsewhere is not imported): one line,
# not the wrong import, where another `kernels` or `trainer` package shares our names
_NAMES = importlib.util.spec_from_file_location(
    "_kernelwright_names", Path(__file__).parent.parent / "kernels/_names.py"
)
_NAMES.loader.exec_module(importlib.util.module_from_spec(_NAMES))


class _OurKernelsForTheHub(logging.Filter):
    """bitsandbytes' CPU backend, imported on a CPU with AVX512-BF16, looks for Hugging Face's kernel hub as `from
    kernels import get_kernel`, finds ours and logs "Failed to load CPU gemm_4bit_forward from kernels-community"
    (then uses its own C++ kernel). Our 4-bit layers never call that GEMM (trainer/model/quant.py), so wherever
    kernelwright is imported (the commands, the Python API, the tests, which import bitsandbytes themselves or through
    peft and transformers) that line is dropped; any other line of bitsandbytes' stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community")
            and any(isinstance(arg, ImportError) and "get_kernel" in str(arg) for arg in record.args or ())
        )


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_OurKernelsForTheHub())

# public name -> the module that defines it
_PUBLIC = {
    "TrainingArguments": "trainer.config.args",
    "build_model": "trainer.build",
    "load_pretrained": "trainer.build",
    "Tokenizer": "trainer.data.tokenizer",
    "load_sft_dataset": "trainer.data.sft_data",
    "load_preference_dataset": "trainer.data.preference_data",
    "tokenize_sft_dataset": "trainer.data.hf_datasets",
    "tokenize_preference_dataset": "trainer.data.hf_datasets",
    "load_sft_sources": "trainer.data.hf_sources",
    "SFTStream": "trainer.data.streaming",
    "Trainer": "trainer.loop.trainer",
    "set_seed": "trainer.loop.trainer",
    "TrainerCallback": "trainer.loop.callbacks",
    "EarlyStoppingCallback": "trainer.loop.callbacks",
    "PreferenceArguments": "trainer.methods.preference",
    "PreferenceTrainer": "trainer.methods.preference",
    "SFTTrainer": "trainer.methods.sft",
    "GRPOArguments": "trainer.methods.grpo",
    "GRPOTrainer": "trainer.methods.grpo",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:  # a submodule (`from trainer import sft`) is then imported by the import system
        raise AttributeError(f"module 'trainer' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(_PUBLIC[name]), name)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
