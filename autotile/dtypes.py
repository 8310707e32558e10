"""Dtype names: the short and torch spellings users type, and their canonical form."""
from __future__ import annotations

import torch

from autotile.errors import UnsupportedDtypeError

# Canonical short name -> torch dtype. The short names are what problem keys,
# configs and the database store.
_CANONICAL: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp64": torch.float64,
}

_ALIASES: dict[str, str] = {
    "float32": "fp32", "float": "fp32", "f32": "fp32",
    "float16": "fp16", "half": "fp16", "f16": "fp16",
    "bfloat16": "bf16",
    "float8_e4m3fn": "fp8", "fp8_e4m3": "fp8", "e4m3": "fp8", "float8": "fp8",
    "float64": "fp64", "double": "fp64",
}


def canonical_dtype_name(name: str | torch.dtype) -> str:
    """'float16', 'torch.float16', 'fp16' or torch.float16 -> 'fp16'.

    >>> canonical_dtype_name("bfloat16")
    'bf16'
    """
    if isinstance(name, torch.dtype):
        for short, dt in _CANONICAL.items():
            if dt == name:
                return short
        raise UnsupportedDtypeError(f"dtype {name} is not one autotile knows; use one of {sorted(_CANONICAL)}")
    key = str(name).strip().lower().removeprefix("torch.")
    key = _ALIASES.get(key, key)
    if key not in _CANONICAL:
        known = sorted(set(_CANONICAL) | set(_ALIASES))
        raise UnsupportedDtypeError(f"unknown dtype {name!r}; use one of: {', '.join(known)}")
    return key


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """Short or torch name -> torch.dtype."""
    return _CANONICAL[canonical_dtype_name(name)]


def element_size(name: str) -> int:
    return torch.empty((), dtype=torch_dtype(name)).element_size()
