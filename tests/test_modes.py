"""The modes' table (hyperlight_agent/modes.py) against the settings that name its rows."""

from __future__ import annotations

from hyperlight_agent import config, modes


def test_the_mode_settings_choices_are_the_rows_names_in_order() -> None:
    """`--mode`'s choices (config.MODE_NAMES, which the settings table and its docs list) are the
    rows, each once: a row added without its choice, or a choice without its row, fails here."""
    assert tuple(m.name for m in modes.MODES) == config.MODE_NAMES
    assert tuple(modes.BY_NAME) == config.MODE_NAMES
