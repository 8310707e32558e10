"""Accuracy of the fused kernels' shared sin/cos ("sincos" step) on the GPU, beside torch.sin/torch.cos.

    PYTHONPATH=. python benchmarks/sincos_accuracy.py

autotile.fuse("a = sin(x); b = cos(x)") on CUDA fp32 arguments against float64 torch, in ulps of the fp32
result, next to torch.sin/torch.cos (CUDA's sinf/cosf, documented at 2 ulp):
  within:  2^24 arguments log-uniform over [1e-30, 1e5] of either sign, every fp32 within 2 ulps of
           k pi/2 for k pi/2 <= 105615 (where the range reduction cancels most) and specials; blocks of
           these take the shared reduction, which the kernel's differences from torch show;
  beyond:  arguments beyond the reduction's bound (105616 to 3e38, inf, NaN): their blocks take tl.sin/tl.cos.
Both segments are whole multiples of the largest block (16384), so no block mixes them. Subnormal arguments
only appear within: beyond, tl.sin is libdevice's flush-to-zero version, where torch keeps subnormals.
The two anchor-like chains "sin(x)**2 + cos(x)**2" and "sin(x)*cos(x)" are reported beside eager fp32 torch.
Exits 1 when autotile's max error exceeds torch's by more than 1 ulp in either function. Three kernels
compile and about 18M arguments run: meant to finish within 20 s.
"""
from __future__ import annotations

import math
import sys

import torch

import autotile

SINCOS_BOUND = 105615.0  # templates/elementwise.py.j2: the fast path's range
SMALLEST_BLOCK, LARGEST_BLOCK = 256, 16384  # the elementwise space's BLOCK_SIZE range
SPECIALS = [0.0, -0.0, 1e-37, -1e-37, 1e-40, -1e-40, math.nan, 1e5, -1e5, SINCOS_BOUND, -SINCOS_BOUND] + [
    k * math.pi / 4 for k in range(-16, 17)]
BEYOND = [105616.0, -105616.0, 2e5, 1e6, -3e7, 1e30, -1e30, 3e38, math.inf, -math.inf, math.nan]
ALLOWED_EXCESS_ULPS = 1.0


def _padded(x: torch.Tensor, gen: torch.Generator, high: float) -> torch.Tensor:
    """x followed by log-uniform arguments up to `high`, to a whole number of the largest blocks."""
    fill = -x.numel() % LARGEST_BLOCK
    return torch.cat([x, _log_uniform(fill, gen, 1e-30, high, x.device)])


def _log_uniform(n: int, gen: torch.Generator, low: float, high: float, device) -> torch.Tensor:
    magnitude = torch.exp(torch.empty(n, dtype=torch.float64, device=device).uniform_(
        math.log(low), math.log(high), generator=gen))
    sign = torch.where(torch.rand(n, generator=gen, device=device) < 0.5, -1.0, 1.0)
    return (sign * magnitude).float()


def _near_multiples_of_half_pi(device, spread: int = 2) -> torch.Tensor:
    k = torch.arange(1, int(SINCOS_BOUND / (math.pi / 2)) + 1, device=device, dtype=torch.float64)
    nearest = (k * (math.pi / 2)).float()
    values, up, down = [nearest], nearest, nearest
    for _ in range(spread):
        up = torch.nextafter(up, torch.full_like(up, math.inf))
        down = torch.nextafter(down, torch.zeros_like(down))
        values += [up, down]
    near = torch.cat(values)
    near = torch.cat([near, -near])
    return near[near.abs() <= SINCOS_BOUND]


def arguments(device) -> tuple[torch.Tensor, int]:
    """(the fp32 arguments, how many of them lie within the bound: the first ones)."""
    gen = torch.Generator(device=device).manual_seed(2026)
    within = torch.cat([torch.tensor(SPECIALS, device=device), _near_multiples_of_half_pi(device),
                        _log_uniform(2**24, gen, 1e-30, 1e5, device)])
    within = _padded(within, gen, 1e5)
    beyond = _padded(torch.tensor(BEYOND, device=device), gen, 1e5)
    beyond.view(-1, SMALLEST_BLOCK)[:, -1] = 2e5  # so that every block of any size takes tl.sin/tl.cos
    return torch.cat([within, beyond]), within.numel()


def ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in fp32 ulps at the float64 reference (2^-149 below the normal range); NaN for NaN is 0."""
    got = got.double()
    _, exponent = torch.frexp(want)
    ulp = torch.exp2((exponent - 24).clamp(min=-149).double())
    err = (got - want).abs() / ulp
    return torch.where(torch.isnan(want) & torch.isnan(got), 0.0, torch.nan_to_num(err, nan=math.inf))


def worst(x: torch.Tensor, got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max ulps, the argument where it occurs)."""
    err = ulps(got, want)
    i = int(err.argmax())
    return float(err[i]), float(x[i])


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    device = torch.device("cuda")
    x, n_within = arguments(device)
    info = autotile.explain("fuse", "a = sin(x); b = cos(x)", x=x)
    print(f"{torch.cuda.get_device_name()}; {x.numel()} fp32 arguments ({n_within} within |x| <= {SINCOS_BOUND:g}); "
          f"autotile config {info['config']} ({info['source']})")
    a, b = autotile.fuse("a = sin(x); b = cos(x)")(x=x)
    xd = x.double()
    reference = {"sin": torch.sin(xd), "cos": torch.cos(xd)}
    ours = {"sin": a, "cos": b}
    theirs = {"sin": torch.sin(x), "cos": torch.cos(x)}
    failed = False
    print(f"{'':4} {'segment':8} {'autotile max ulp (at x)':>34} {'torch max ulp (at x)':>34} {'differ':>9}")
    for name in ("sin", "cos"):
        for segment, part in (("within", slice(0, n_within)), ("beyond", slice(n_within, None))):
            mine = worst(x[part], ours[name][part], reference[name][part])
            torch_ = worst(x[part], theirs[name][part], reference[name][part])
            differ = int((ours[name][part] != theirs[name][part]).sum())
            print(f"{name:4} {segment:8} {mine[0]:>12.3f} ({mine[1]:>19.9g}) {torch_[0]:>12.3f} ({torch_[1]:>19.9g}) "
                  f"{differ:>9}")
            if mine[0] > torch_[0] + ALLOWED_EXCESS_ULPS:
                failed = True
                print(f"FAIL: autotile's {name} exceeds torch's max error by more than {ALLOWED_EXCESS_ULPS:g} ulp")
        if int((ours[name][:n_within] != theirs[name][:n_within]).sum()) == 0:
            print(f"note: {name} within the bound equals torch's bit for bit: the shared reduction did not run")
    for expr, exact in (("sin(x)**2 + cos(x)**2", lambda v: torch.sin(v) ** 2 + torch.cos(v) ** 2),
                        ("sin(x)*cos(x)", lambda v: torch.sin(v) * torch.cos(v))):
        fused = autotile.fuse(expr)(x=x[:n_within])
        want = exact(xd[:n_within])
        print(f"{expr:22} within: autotile max {worst(x[:n_within], fused, want)[0]:.3f} ulp, "
              f"eager fp32 torch {worst(x[:n_within], exact(x[:n_within]), want)[0]:.3f} ulp")
    print("FAILED" if failed else "ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
