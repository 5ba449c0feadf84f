"""SFT and preference data, Hugging Face `datasets` inputs, batching, the tokenizer and the embedded tasks.

`trainer.data` was the SFT data module before issue 29 (now `trainer.data.sft_data`); for one release after
2026-11-27 its names are still served here, with a FutureWarning."""

import importlib
import warnings

_MOVED = frozenset(
    {
        "IGNORE_INDEX",
        "DATA_FORMATS",
        "ROLES",
        "EXTENSIONS",
        "BATCHING_STRATEGIES",
        "BatchLoader",
        "DataError",
        "TokenizedDataset",
        "alpaca_prompt",
        "checked_records",
        "detect_format",
        "load_cached",
        "load_sft_dataset",
        "normalize_record",
        "read_examples",
        "resolve_data_files",
        "save_to_cache",
        "split_dataset",
        "summary_text",
        "tokenize_conversation",
        "tokenize_text",
        "tools_field",
    }
)


def __getattr__(name: str):
    if name not in _MOVED:
        raise AttributeError(f"module 'trainer.data' has no attribute {name!r}")
    warnings.warn(
        f"trainer.data.{name} moved to trainer.data.sft_data.{name}; the old name goes in the next release",
        FutureWarning,
        stacklevel=2,
    )
    value = globals()[name] = getattr(importlib.import_module("trainer.data.sft_data"), name)  # one warning a name
    return value
