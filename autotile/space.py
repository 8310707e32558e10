"""Typed tuning axes, named constraints, and canonical configs.

A `Space` is a finite grid of axes pruned by named constraints. Configs are
plain mappings of axis name -> value; their canonical JSON (sorted keys, no
spaces) and its hash identify them everywhere (database, kernel cache, CLI).

>>> space = Space([Axis("BLOCK", (16, 32)), Axis("num_warps", (4, 8), AxisKind.META)],
...               [Constraint("block_fits", lambda c: c["BLOCK"] * c["num_warps"] <= 128,
...                           "BLOCK x num_warps must be <= 128")])
>>> [dict(c) for c in space.feasible()]
[{'BLOCK': 16, 'num_warps': 4}, {'BLOCK': 16, 'num_warps': 8}, {'BLOCK': 32, 'num_warps': 4}]
"""
from __future__ import annotations

import enum
import hashlib
import itertools
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from autotile.errors import ConfigOutsideSpaceError

Value = int | bool | str


class AxisKind(enum.Enum):
    RENDER = "render"  # decides template structure: a Jinja switch
    LAUNCH = "launch"  # a tl.constexpr launch argument
    META = "meta"  # a launch option of Triton itself: num_warps, num_stages


@dataclass(frozen=True)
class Axis:
    name: str
    choices: tuple[Value, ...]
    kind: AxisKind = AxisKind.LAUNCH

    def __post_init__(self):
        if not self.choices:
            raise ValueError(f"axis {self.name} has no choices")
        types = {type(c) for c in self.choices}
        if len(types) != 1 or types.pop() not in (int, bool, str):
            raise ValueError(f"axis {self.name}: choices must be all int, all bool or all str")


@dataclass(frozen=True)
class Constraint:
    """A named rule every config must satisfy; `explain` says why a config breaks it."""

    name: str
    holds: Callable[[Mapping[str, Value]], bool]
    explain: str | Callable[[Mapping[str, Value]], str]

    def message(self, config: Mapping[str, Value]) -> str:
        text = self.explain(config) if callable(self.explain) else self.explain
        return f"{self.name}: {text}"


class Config(Mapping[str, Value]):
    """An immutable, hashable config with a canonical JSON form."""

    __slots__ = ("_items", "_hash")

    def __init__(self, values: Mapping[str, Value] | None = None, **kwargs: Value):
        merged = dict(values or {}, **kwargs)
        self._items = tuple(sorted(merged.items()))
        self._hash: str | None = None  # `hash`, computed once: the search compares thousands of configs by it

    def __getitem__(self, key: str) -> Value:
        for k, v in self._items:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self):
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __repr__(self) -> str:
        return f"Config({self.to_json()})"

    def to_json(self) -> str:
        return json.dumps(dict(self._items), sort_keys=True, separators=(",", ":"))

    @property
    def hash(self) -> str:
        if self._hash is None:
            self._hash = hashlib.sha256(self.to_json().encode()).hexdigest()[:16]
        return self._hash

    @classmethod
    def from_json(cls, text: str) -> Config:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigOutsideSpaceError(f"config is not valid JSON ({exc}): {text!r}") from None
        if not isinstance(data, dict):
            raise ConfigOutsideSpaceError(f"config must be a JSON object of axis -> value, got {text!r}")
        return cls(data)


class Space:
    """Axes and the constraints that prune their product."""

    def __init__(self, axes: list[Axis] | tuple[Axis, ...], constraints: list[Constraint] | tuple[Constraint, ...] = (),
                 upgrade: Callable[[Mapping[str, Value]], Mapping[str, Value]] | None = None):
        """`upgrade` maps a config from an earlier version of the space (fewer axes) onto this one, with the values
        that reproduce the kernel it named (stored winners stay valid); `violations` and `validate` apply it first."""
        names = [a.name for a in axes]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate axis names in {names}")
        self.axes: tuple[Axis, ...] = tuple(axes)
        self.constraints: tuple[Constraint, ...] = tuple(constraints)
        self._by_name = {a.name: a for a in self.axes}
        self._upgrade = upgrade or (lambda config: config)

    def axis(self, name: str) -> Axis:
        return self._by_name[name]

    def names(self, kind: AxisKind | None = None) -> list[str]:
        return [a.name for a in self.axes if kind is None or a.kind == kind]

    def violations(self, config: Mapping[str, Value]) -> list[str]:
        """Every reason the config (upgraded) is not in the space (empty when it is)."""
        return self._violations_of(self._upgrade(config))

    def _violations_of(self, config: Mapping[str, Value]) -> list[str]:
        problems = []
        unknown = sorted(set(config) - set(self._by_name))
        if unknown:
            problems.append(f"unknown axes {unknown}; this space has {self.names()}")
        missing = [n for n in self._by_name if n not in config]
        if missing:
            problems.append(f"missing axes {missing}")
        for name, value in config.items():
            axis = self._by_name.get(name)
            if axis is not None and (value not in axis.choices or type(value) is not type(axis.choices[0])):
                problems.append(f"{name}={value!r} is not one of {list(axis.choices)}")
        if problems:
            return problems
        return [c.message(config) for c in self.constraints if not c.holds(config)]

    def is_feasible(self, config: Mapping[str, Value]) -> bool:
        return not self.violations(config)

    def filled(self, config: Mapping[str, Value], defaults: Mapping[str, Value]) -> dict:
        """A partial config (render's and export-kernel's --config): upgraded as stored ones are, then the axes it
        still lacks taken from `defaults` (the default config). Not validated."""
        upgraded = self._upgrade(config)
        return {**{name: value for name, value in defaults.items() if name not in upgraded}, **upgraded}

    def validate(self, config: Mapping[str, Value]) -> Config:
        """The config, upgraded to this space's axes; raises ConfigOutsideSpaceError where it is not in the space."""
        upgraded = self._upgrade(config)
        problems = self._violations_of(upgraded)
        if problems:
            raise ConfigOutsideSpaceError("config is outside the search space: " + "; ".join(problems))
        return Config(upgraded)

    def admit(self, config: Mapping[str, Value]) -> Config | None:
        """The config upgraded to this space's axes, or None where it is outside the space (one check, no raise)."""
        upgraded = self._upgrade(config)
        return None if self._violations_of(upgraded) else Config(upgraded)

    def grid(self) -> Iterator[Config]:
        for values in itertools.product(*(a.choices for a in self.axes)):
            yield Config(zip(self.names(), values))

    def feasible(self) -> Iterator[Config]:
        """Every config of the grid that satisfies all constraints (plain dicts are checked, Configs yielded)."""
        names = self.names()
        for values in itertools.product(*(a.choices for a in self.axes)):
            candidate = dict(zip(names, values))
            if all(c.holds(candidate) for c in self.constraints):
                yield Config(candidate)

    def describe(self) -> dict:
        return {
            "axes": {a.name: {"kind": a.kind.value, "choices": list(a.choices)} for a in self.axes},
            "constraints": [c.name for c in self.constraints],
        }
