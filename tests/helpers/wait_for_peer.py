"""Hold the tuner's own search until a search process has claimed a trial (for the --gpus tests).

The first search of `--gpus` runs in the tuner's process and starts at once; under the interpreter it can
finish a small study before a search process has imported torch. Tests that need every search to run
trials call `hold_local_search(url)` in the tuner's process: its first trial waits (at most `limit_s`)
until a trial owned by another process is claimed. Search processes are unaffected (they do not import this).
"""
from __future__ import annotations

import os
import time

import optuna

from autotile.tune import workers
from autotile.tune.cluster import CLAIM_ATTR, OWNER_ATTR


def hold_local_search(url: str, limit_s: float = 120.0) -> None:
    evaluate = workers.InProcessEvaluator.evaluate
    waited = []

    def evaluate_after_a_peer(self, number, config):
        if not waited:
            waited.append(True)
            end = time.monotonic() + limit_s
            while time.monotonic() < end and not _peer_claimed(url):
                time.sleep(0.1)
        return evaluate(self, number, config)

    workers.InProcessEvaluator.evaluate = evaluate_after_a_peer


def _peer_claimed(url: str) -> bool:
    from autotile.tune.storage import optuna_storage

    storage = optuna_storage(url)  # the study's storage: a database, or its journal beside one
    try:
        for summary in optuna.get_all_study_summaries(storage):
            for trial in optuna.load_study(study_name=summary.study_name, storage=storage).trials:
                owner = trial.user_attrs.get(OWNER_ATTR, "")
                if trial.user_attrs.get(CLAIM_ATTR) and owner.split(":")[1:2] != [str(os.getpid())]:
                    return True
        return False
    finally:
        if hasattr(storage, "engine"):
            storage.engine.dispose()
