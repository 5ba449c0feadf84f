"""Moved to `trainer.data.tokenizer` (issue 29: trainer/ in folders by concern). `trainer.tokenizer` stays importable,
with a FutureWarning, for one release after 2026-11-27; then it goes."""

import warnings

from trainer.data.tokenizer import *  # noqa: F403

warnings.warn(
    "trainer.tokenizer moved to trainer.data.tokenizer; the old name goes in the next release",
    FutureWarning,
    stacklevel=2,
)
