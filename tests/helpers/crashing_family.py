"""A GEMM family whose chosen configs kill or hang the process that runs them (for the worker tests).

The configs are the feasible points right after the default, enqueued as seed
configs, so the first trials of a study hit them in a known order: the
default (ok), EXIT (the process exits with code 3), KILLED (writes its pid to
$AUTOTILE_TEST_PIDFILE and waits to be killed from outside), HANG (never
returns), then ordinary trials. The worker process imports this module by
name (tests/helpers is on sys.path, which spawn hands down).
"""
from __future__ import annotations

import os
import time

from autotile.families.gemm import GemmFamily

EXIT_CODE = 3


class CrashingGemm(GemmFamily):
    def special_configs(self, problem, device) -> dict:
        default = self.default_config(problem, device)
        others = [c for c in self.space(problem, device).feasible() if c.hash != default.hash]
        return {"exit": others[0], "killed": others[1], "hang": others[2]}

    def seed_configs(self, problem, device):
        return list(self.special_configs(problem, device).values())

    def launch(self, problem, config, inputs, outputs):
        from autotile.device import interpret_device

        special = {c.hash: name for name, c in self.special_configs(problem, interpret_device()).items()}
        kind = special.get(config.hash)
        if kind == "exit":
            print("about to exit on purpose", flush=True)
            os._exit(EXIT_CODE)
        if kind == "killed":
            with open(os.environ["AUTOTILE_TEST_PIDFILE"], "w") as handle:
                handle.write(str(os.getpid()))
            time.sleep(600)
        if kind == "hang":
            time.sleep(600)
        super().launch(problem, config, inputs, outputs)
