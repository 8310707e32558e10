"""Comparing kernel outputs with references, naming the worst element when they differ."""
from __future__ import annotations

import torch

from autotile.families.base import CheckResult, Tolerance


def compare(name: str, got: torch.Tensor, want: torch.Tensor, tol: Tolerance) -> CheckResult:
    """Every element written (outputs are poisoned with NaN before a run), finite where the reference is, within tolerance."""
    if got.shape != want.shape:
        return CheckResult(False, f"{name}: shape {tuple(got.shape)} != reference {tuple(want.shape)}")
    g = got.detach().to(torch.float64)
    w = want.detach().to(device=g.device, dtype=torch.float64)
    unexpected_nan = torch.isnan(g) & ~torch.isnan(w)
    if unexpected_nan.any():
        idx = tuple(int(i) for i in unexpected_nan.nonzero()[0])
        count = int(unexpected_nan.sum())
        return CheckResult(False, f"{name}: {count} element(s) NaN or never written, first at {idx} (reference {w[idx].item():.6g})", float("nan"))
    both_nan = torch.isnan(g) & torch.isnan(w)
    err = (g - w).abs()
    allowed = tol.atol + tol.rtol * w.abs()
    # inf == inf counts as equal; NaN where the reference is NaN too counts as equal.
    same_inf = torch.isinf(w) & (g == w)
    bad = ~((err <= allowed) | same_inf | both_nan)
    max_err = float(torch.where(same_inf | both_nan, 0.0, err).max()) if err.numel() else 0.0
    if bad.any():
        excess = torch.where(bad, torch.nan_to_num(err - allowed, nan=float("inf")), torch.zeros_like(err))
        idx = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
        return CheckResult(
            False,
            f"{name}: {int(bad.sum())} of {bad.numel()} elements outside tolerance; worst at {idx}: "
            f"got {g[idx].item():.6g}, expected {w[idx].item():.6g}, |err| {err[idx].item():.3g} > "
            f"allowed {allowed[idx].item():.3g} (atol {tol.atol:.3g}, rtol {tol.rtol:.3g})",
            max_err,
        )
    return CheckResult(True, f"{name}: ok, max |err| {max_err:.3g}", max_err)
