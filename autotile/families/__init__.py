"""The kernel families, by name. Each module defines one `FAMILY` instance of a `Family` subclass."""
from __future__ import annotations

import importlib

from autotile.errors import BadInputError
from autotile.families.base import Family

FAMILY_MODULES: dict[str, str] = {
    "gemm": "autotile.families.gemm",
    "flash": "autotile.families.flash",
    "paged": "autotile.families.paged",
    "elementwise": "autotile.families.elementwise",
}


def family_names() -> list[str]:
    """Families whose module is present in this installation."""
    names = []
    for name, module in FAMILY_MODULES.items():
        if importlib.util.find_spec(module) is not None:
            names.append(name)
    return names


def get_family(name: str) -> Family:
    module = FAMILY_MODULES.get(name)
    if module is None:
        raise BadInputError(f"unknown kernel family {name!r}; known: {', '.join(family_names())}")
    return importlib.import_module(module).FAMILY
