"""Moved to `trainer.data.preference_data` (issue 29: trainer/ in folders by concern). `trainer.preference_data`
stays importable, with a FutureWarning, for one release after 2026-11-27; then it goes."""

import warnings

from trainer.data.preference_data import *  # noqa: F403

warnings.warn(
    "trainer.preference_data moved to trainer.data.preference_data; the old name goes in the next release",
    FutureWarning,
    stacklevel=2,
)
