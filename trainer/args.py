"""Moved to `trainer.config.args` (issue 29: trainer/ in folders by concern). `trainer.args` stays importable,
with a FutureWarning, for one release after 2026-11-27; then it goes."""

import warnings

from trainer.config.args import *  # noqa: F403

warnings.warn(
    "trainer.args moved to trainer.config.args; the old name goes in the next release",
    FutureWarning,
    stacklevel=2,
)
