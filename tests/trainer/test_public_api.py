"""The public names: `from trainer import ...` gives the objects their modules define, loaded when first asked for,
so `import trainer` alone imports neither torch nor any of trainer's modules (issue 29 item 2)."""

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import trainer

ROOT = Path(__file__).resolve().parents[2]

PUBLIC = {
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


def test_each_public_name_is_the_object_its_module_defines():
    assert trainer.__all__ == sorted(PUBLIC)
    for name, module in PUBLIC.items():
        assert getattr(trainer, name) is getattr(importlib.import_module(module), name), name
    assert set(PUBLIC) <= set(dir(trainer))
    from trainer import PreferenceTrainer, SFTTrainer, Trainer, TrainingArguments  # the README's one-line import

    assert issubclass(PreferenceTrainer, Trainer) and issubclass(SFTTrainer, Trainer)
    assert TrainingArguments().optim == "adamw_fused"


def test_submodules_and_unknown_names():
    from trainer import sft  # a command module, not a public name: imported as a submodule

    assert sft.__name__ == "trainer.sft"
    with pytest.raises(AttributeError, match="module 'trainer' has no attribute 'Trainr'"):
        trainer.Trainr  # noqa: B018
    with pytest.raises(ImportError, match="cannot import name 'Trainr'"):
        from trainer import Trainr  # noqa: F401


def test_import_trainer_alone_loads_nothing_heavy():
    code = "import sys, trainer; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('trainer.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_docs_import_the_public_names_only():
    """The one documented way in is `from trainer import <public name>` (issue 48 item 3): the Python examples of
    README.md and docs/ import nothing else of trainer, and no page shows an import of one of its modules."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    imported, other = [], []
    for page in pages:
        text = page.read_text()
        other += [(page.name, line) for line in re.findall(r"(?:from|import) trainer\.[\w.]+.*", text)]
        for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
            for node in ast.walk(ast.parse(block)):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "trainer":
                    imported += [(page.name, node.module, alias.name) for alias in node.names]
                elif isinstance(node, ast.Import):
                    other += [(page.name, a.name) for a in node.names if a.name.split(".")[0] == "trainer"]
    assert imported and other == []
    assert [(page, module, name) for page, module, name in imported if module != "trainer" or name not in PUBLIC] == []
