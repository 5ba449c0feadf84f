"""Moved to `trainer.methods.preference` (issue 29: trainer/ in folders by concern). `trainer.preference`
stays importable, with a FutureWarning, for one release after 2026-11-27; then it goes."""

import warnings

from trainer.methods.preference import *  # noqa: F403

warnings.warn(
    "trainer.preference moved to trainer.methods.preference; the old name goes in the next release",
    FutureWarning,
    stacklevel=2,
)
