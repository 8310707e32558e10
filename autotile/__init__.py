"""autotile: Triton kernels generated from templates, tuned with Optuna, served from a SQL database of winners.

>>> import torch, autotile
>>> a, b = torch.randn(33, 17), torch.randn(17, 5)
>>> torch.allclose(autotile.matmul(a, b), a @ b, atol=1e-4)
True
"""
from pathlib import Path as _Path

_checkout_root = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "cli").is_dir() and (_checkout_root / "cli" / "__init__.py").is_file():
    # NOTE: a wheel maps the top-level cli/, templates/ and tuning_db/ folders into this package
    # (pyproject's package-dir); a source checkout that was not installed gets the same names this way.
    __path__.append(str(_checkout_root))  # type: ignore[name-defined]

__version__ = "0.1.0"

__all__ = ["matmul", "linear", "flash_attention", "flash_attention_varlen", "paged_attention", "paged_prefill", "plan_paged_attention",
           "plan_paged_prefill", "fuse", "explain", "warmup", "clear_cache", "__version__"]

# Public name -> (module, attribute). The ops are imported on first use, so `import autotile` stays
# cheap (no torch.library registration, no database) for tools that only need the CLI or a family.
_PUBLIC = {
    "matmul": ("autotile.runtime.ops_gemm", "matmul"),
    "linear": ("autotile.runtime.ops_gemm", "linear"),
    "flash_attention": ("autotile.runtime.ops_flash", "flash_attention"),
    "flash_attention_varlen": ("autotile.runtime.ops_flash_varlen", "flash_attention_varlen"),
    "paged_attention": ("autotile.runtime.ops_paged", "paged_attention"),
    "paged_prefill": ("autotile.runtime.ops_paged", "paged_prefill"),
    "plan_paged_attention": ("autotile.runtime.paged_plan", "plan_paged_attention"),
    "plan_paged_prefill": ("autotile.runtime.paged_plan", "plan_paged_prefill"),
    "fuse": ("autotile.runtime.ops_elementwise", "fuse"),
    "explain": ("autotile.runtime.api", "explain"),
    "warmup": ("autotile.runtime.warmup", "warmup"),
    # Forget what served each call signature and the databases' reads (after tuning in the same process).
    "clear_cache": ("autotile.runtime.dispatch", "clear_cache"),
}


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        module, attribute = _PUBLIC[name]
        value = getattr(importlib.import_module(module), attribute)
        # Bound as a plain module attribute from now on: torch.compile sees the op function itself.
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autotile' has no attribute {name!r}")
