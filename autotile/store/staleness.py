"""Stale winners: tuned with another torch, Triton or CUDA than this process has, or on another GPU driver.

A stale winner is still served (it is usually still good); `autotile db verify`
re-checks it and `autotile tune --stale` re-times its stored top few configs.
Nothing here imports Optuna or Alembic, so the runtime may use it.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from autotile.device import DeviceInfo
from autotile.store.fingerprint import toolchain_versions

# The toolchain fields whose change can change what a config compiles to, or how fast it runs.
STALENESS_FIELDS = ("torch", "triton", "cuda")


def stale_reasons(toolchain: Mapping[str, str], driver: str, device: DeviceInfo,
                  present: Mapping[str, str] | None = None) -> list[str]:
    """Why a winner measured with `toolchain` on a device with `driver` is stale here; empty when it is not.

    >>> from autotile.device import interpret_device
    >>> stale_reasons({"torch": "2.0", "triton": "3.6.0", "cuda": "none"}, "none", interpret_device(),
    ...               present={"torch": "2.13.0", "triton": "3.6.0", "cuda": "none"})
    ['torch 2.0 -> 2.13.0']
    """
    present = present if present is not None else toolchain_versions()
    reasons = [f"{name} {toolchain.get(name)} -> {present[name]}" for name in STALENESS_FIELDS
               if toolchain.get(name) != present[name]]
    if driver != device.driver:
        reasons.append(f"driver {driver} -> {device.driver}")
    return reasons


@dataclass(frozen=True)
class StaleWinner:
    winner_id: int
    family: str
    problem_key: str
    device_key: str
    reasons: tuple[str, ...]


def mark_stale(store, device: DeviceInfo, family: str | None = None) -> list[StaleWinner]:
    """Set the `stale` flag of every winner filed under `device.key` from this process's toolchain and driver.

    Returns the winners that are stale now. `store` is an autotile.store.repo.Store.
    """
    present = toolchain_versions()
    stale = []
    for winner, problem, dev, toolchain in store.winner_rows(family, device.key):
        versions = {name: getattr(toolchain, name) for name in STALENESS_FIELDS}
        reasons = stale_reasons(versions, dev.driver, device, present)
        if bool(reasons) != bool(winner.stale):
            store.update_winner(winner.id, stale=int(bool(reasons)))
        if reasons:
            stale.append(StaleWinner(winner.id, problem.family, problem.key, winner.device_key, tuple(reasons)))
    return stale
