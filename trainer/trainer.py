"""Moved to `trainer.loop.trainer` (issue 29: trainer/ in folders by concern). `trainer.trainer` stays importable,
with a FutureWarning, for one release after 2026-11-27; then it goes."""

import warnings

from trainer.loop.trainer import *  # noqa: F403

warnings.warn(
    "trainer.trainer moved to trainer.loop.trainer; the old name goes in the next release",
    FutureWarning,
    stacklevel=2,
)
