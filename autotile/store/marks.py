"""What a stored winner's checks found, in words: `autotile db verify`, `tune --stale` and toolchain changes.

One place for the list, show and report commands, and for the runtime's rule of which findings keep a winner from
being served.
"""
from __future__ import annotations

# `autotile db verify` outcomes (autotile.store.verify.VerifyStatus values), and `tune --stale`'s "failed" (none of
# the winner's top configs ran under this toolchain), that keep a winner from being served.
UNSERVABLE_VERIFY_STATUSES = frozenset({"wrong_result", "crash", "compile_error", "out_of_resources", "timeout",
                                        "outside_space", "bad_problem", "failed"})


def servable(verify_status: str) -> bool:
    return verify_status not in UNSERVABLE_VERIFY_STATUSES


def winner_mark(stale: bool, verify_status: str, regression: float | None) -> str:
    """'' for a winner nothing was found on; else what was found and whether it is still served.

    >>> winner_mark(False, "wrong_result", None)
    'db verify found wrong result; not served'
    >>> winner_mark(True, "regression", 0.82)
    'db verify timed it +82% slower; still served; stale: tuned with another toolchain or driver'
    """
    parts = []
    if verify_status == "failed":
        parts.append("tune --stale could not re-time it with this toolchain; not served")
    elif verify_status in UNSERVABLE_VERIFY_STATUSES:
        parts.append(f"db verify found {verify_status.replace('_', ' ')}; not served")
    elif verify_status == "regression" and regression is not None:
        parts.append(f"db verify timed it {regression:+.0%} slower; still served")
    if stale:
        parts.append("stale: tuned with another toolchain or driver")
    return "; ".join(parts)
