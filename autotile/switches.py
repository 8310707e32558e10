"""On/off environment switches (AUTOTILE_VENDOR, AUTOTILE_LOG, AUTOTILE_CHECKS): one spelling rule for all of them.

Off: 0, false, no, off; on: 1, true, yes, on (any case, spaces ignored). Unset or blank is the switch's default. Any
other value is taken as the default and said once, naming the switch and what it does: a typo never turns a debug
mode on, or a production path off, silently.
"""
from __future__ import annotations

import logging
import os

OFF = ("0", "false", "no", "off")
ON = ("1", "true", "yes", "on")
_warned: set[tuple[str, str]] = set()


def switch(name: str, default: bool, meaning: str) -> bool:
    """The value of environment switch `name`; `meaning` says what it does when on (for the once-said warning)."""
    value = os.environ.get(name, "").strip().lower()
    if value in ON:
        return True
    if value in OFF:
        return False
    if value and (name, value) not in _warned:
        _warned.add((name, value))
        logging.getLogger("autotile.runtime").warning(
            "autotile: %s=%r is neither on (1, true, yes, on) nor off (0, false, no, off); taken as %s (%s=1 %s)",
            name, value, "on" if default else "off", name, meaning)
    return default
