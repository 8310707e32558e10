"""The Gluon GEMM's split-K arrival protocol (gemm_gluon_ws.py.j2, _arrive_keeping_own), run on Python threads.

The template's function is executed as written, with `gl` standing in for Gluon: one lock-guarded counter, stores
recorded per slot. Whatever the interleaving, exactly one contributor of a tile is the last, and it returns only once
every other contributor's partial is stored; the counter then holds the arrivals and the stores. Gluon kernels do
not run under the interpreter, so this is the protocol's CPU check; test_gemm_gpu.py runs it on a GPU.
"""
from __future__ import annotations

import random
import threading
import time

import pytest

from autotile.resources import templates_dir


class _Gluon:
    """The part of Gluon's `gl` the protocol uses, on a shared counter and a slot table."""

    constexpr = int

    def __init__(self):
        self.lock = threading.Lock()
        self.counter = 0
        self.stored: set[int] = set()

    def atomic_add(self, counter, value, sem, scope):
        assert scope == "gpu" and sem in ("relaxed", "acquire", "release")
        time.sleep(random.random() * 1e-4)  # other contributors may run in between
        with self.lock:
            before = self.counter
            self.counter += value
            return before

    def store(self, slot, value):
        time.sleep(1e-3 + random.random() * 1e-3)  # slower than a count: a last that did not wait would see it
        with self.lock:
            self.stored.add(slot)

    def thread_barrier(self):
        pass


def _protocol(gl: _Gluon):
    source = (templates_dir() / "gemm_gluon_ws.py.j2").read_text()
    body = source[source.index("def _arrive_keeping_own("):]
    body = body[:body.index("\n\n\n")]
    scope = dict(gl=gl, _partials=lambda ws_ptr, slot, offsets, tile: slot)
    exec(body, scope)  # noqa: S102 - the template's own device function, on stand-ins
    return scope["_arrive_keeping_own"]


@pytest.mark.parametrize("contributors", [2, 3, 4, 6])
@pytest.mark.parametrize("seed", range(4))
def test_one_last_contributor_that_sees_every_other_partial(contributors, seed):
    random.seed(seed)
    gl = _Gluon()
    arrive = _protocol(gl)
    outcome: dict[int, tuple[bool, set]] = {}

    def contributor(slot):
        last = arrive(None, slot, None, None, None, contributors, 0)
        with gl.lock:
            outcome[slot] = (bool(last), set(gl.stored))

    threads = [threading.Thread(target=contributor, args=(slot,)) for slot in range(contributors)]
    for thread in random.sample(threads, len(threads)):
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert len(outcome) == contributors, "a contributor never returned"
    lasts = [slot for slot, (last, _) in outcome.items() if last]
    assert len(lasts) == 1
    last, = lasts
    assert outcome[last][1] == set(range(contributors)) - {last}, "the last returned before the others' stores"
    assert last not in gl.stored, "the last keeps its own partial"
    assert gl.counter == contributors + (contributors - 1) * 65536
