"""Errors autotile raises at users. Each message names the problem and what to do."""


class AutotileError(Exception):
    """Base class: every error autotile raises on purpose derives from this."""


class BadInputError(AutotileError, ValueError):
    """Tensors or options the kernels cannot take (dtype, layout, shape)."""


class UnsupportedDtypeError(BadInputError):
    """A dtype that a family does not support."""


class ShapeMismatchError(BadInputError):
    """Operand shapes that do not fit together."""


class ConfigOutsideSpaceError(AutotileError, ValueError):
    """A config that is not a point of the family's search space."""


class NoFeasibleConfigError(AutotileError, RuntimeError):
    """No config of a family's search space fits a problem on a device (RuntimeError for callers that caught that)."""


class DeviceMismatchError(AutotileError):
    """`--gpu NAME` names a GPU other than the one present."""


class DatabaseError(AutotileError):
    """A database that is not autotile's, is corrupt, or has a schema this version cannot read."""


class KernelUnusableError(AutotileError):
    """No kernel can serve a call here: the generated ones failed to build or launch, and no vendor op computes it."""


class KernelCacheError(AutotileError, OSError):
    """The folder rendered kernels are written to cannot take them (not a folder, read-only, full): the machine's
    setup, not a config's fault, so tuning stops instead of filing every config as a crash."""
