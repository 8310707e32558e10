"""Tuned policies: the family's default serves untuned shapes only inside a range where it beat the vendor op."""
from __future__ import annotations

import time

import pytest

from autotile.device import DeviceInfo, interpret_device
from autotile.families.base import POLICY_KEY, VENDOR_KEY
from autotile.families.gemm import FAMILY, GemmFamily, contiguous_problem
from autotile.runtime import dispatch
from autotile.space import Config
from autotile.store.db import open_engine
from autotile.store.repo import Store
from autotile.tune.policy import group_samples, tune_policy

CPU = interpret_device()
H200 = DeviceInfo("h200", "NVIDIA H200", (9, 0), 132, 150_000_000_000, 232448, "580", interpret=False)


def linear(m: int, n: int, k: int):
    return contiguous_problem(m, n, k, "fp32", "fp32", layout_b="col")


class _DelayedVendorGemm(GemmFamily):
    """torch.matmul on the CPU as the vendor op, slowed or not, so the outcome does not depend on CPU load."""

    def __init__(self, vendor_delay_s: float, kernel_delay_s: float = 0.0):
        self.vendor_delay_s, self.kernel_delay_s = vendor_delay_s, kernel_delay_s

    def vendor_configs(self, problem, device):
        return [Config({VENDOR_KEY: "cublas"})]

    def vendor_run(self, problem, config, inputs):
        time.sleep(self.vendor_delay_s)
        return super().vendor_run(problem, config, inputs)

    def launch(self, problem, config, inputs, outputs):
        time.sleep(self.kernel_delay_s)
        super().launch(problem, config, inputs, outputs)


@pytest.fixture
def db(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'policy.sqlite'}"
    monkeypatch.setenv("AUTOTILE_DB", url)
    monkeypatch.setattr("autotile.resources.shipped_db_path", lambda: tmp_path / "none.sqlite")
    dispatch.clear_cache()
    yield url
    dispatch.clear_cache()


SAMPLES = [linear(4, 40, 20), linear(3, 48, 28)]


@pytest.fixture(scope="module")
def _won_once(tmp_path_factory):
    """One tune_policy run the default wins everywhere (the vendor op sleeps): its outcomes and its database."""
    path = tmp_path_factory.mktemp("policy") / "won.sqlite"
    with pytest.MonkeyPatch.context() as patch:  # as the `db` fixture sets up a test
        patch.setenv("AUTOTILE_DB", f"sqlite:///{path}")
        patch.setattr("autotile.resources.shipped_db_path", lambda: path.parent / "none.sqlite")
        dispatch.clear_cache()
        outcomes = tune_policy(_DelayedVendorGemm(vendor_delay_s=0.3), SAMPLES, CPU, db_url=f"sqlite:///{path}",
                               rounds=1)
    dispatch.clear_cache()
    return outcomes, path


@pytest.fixture
def won(_won_once, db):
    """The outcomes of _won_once, its database copied into this test's `db` (each test changes its own copy)."""
    import sqlite3

    outcomes, path = _won_once
    source, target = sqlite3.connect(path), sqlite3.connect(db.removeprefix("sqlite:///"))
    try:
        source.backup(target)  # a consistent copy, write-ahead log included
    finally:
        source.close()
        target.close()
    return outcomes


def test_samples_group_by_fixed_fields_and_regime_cell():
    problems = [linear(3, 40, 20), linear(4, 48, 28), linear(5, 40, 20), linear(4, 64, 20),
                contiguous_problem(3, 40, 20, "fp32", "fp32")]
    groups = group_samples(FAMILY, problems)
    # (3, 40, 20), (4, 48, 28) and (4, 64, 20) share M 3..4, N 33..64, K 17..32
    sizes = sorted(len(g) for g in groups.values())
    assert sizes == [1, 1, 3]  # M 3..4 with N 40, 48, 64 in 33..64; M=5 alone; the row-major B alone


def test_a_policy_that_wins_everywhere_is_stored_and_serves_its_range_only(db, won):
    (outcome,) = won
    assert outcome.stored and outcome.verified_range == {"m": [3, 4], "n": [40, 48], "k": [20, 28]}
    (policy,) = Store(open_engine(db, create=False)).policies("gemm")
    assert Config.from_json(policy.config) == Config({POLICY_KEY: "default"}) and policy.samples == 4  # each sample at M = 3 and 4
    # Store it for the GPU's key too, and resolve there: inside the range the family's default serves.
    store = Store(open_engine(db))
    store.save_policy(family="gemm", device=H200, device_id=store.ensure_device(H200),
                      toolchain_id=store.ensure_toolchain(), params=policy.params,
                      verified_range=policy.verified_range, config=policy.config, samples=3, min_ratio=1.5,
                      geomean_ratio=2.0, provenance="test")
    dispatch.clear_cache()
    inside = dispatch.resolve(FAMILY, linear(3, 44, 24), H200)
    assert inside.match == "policy" and inside.config == FAMILY.default_config(linear(3, 44, 24), H200)
    for outside in (linear(5, 44, 24), linear(3, 64, 24), linear(3, 44, 16), contiguous_problem(3, 44, 24, "fp32", "fp32")):
        assert dispatch.resolve(FAMILY, outside, H200).source == "vendor", outside


def test_a_policy_that_loses_once_is_not_stored_and_an_old_one_is_removed(db, won):
    assert won[0].stored and len(Store(open_engine(db, create=False)).policies("gemm")) == 1
    outcome = tune_policy(_DelayedVendorGemm(vendor_delay_s=0.0, kernel_delay_s=0.3), SAMPLES, CPU, db_url=db,
                          rounds=1)[0]
    assert not outcome.stored and outcome.min_ratio < 1.0
    assert Store(open_engine(db, create=False)).policies("gemm") == []


def test_policy_configs_are_validated_like_any_stored_config():
    problem = linear(3, 44, 24)
    assert FAMILY.validate_config(problem, H200, {POLICY_KEY: "default"}) == FAMILY.default_config(problem, H200)
    with pytest.raises(Exception, match="the only policy"):
        FAMILY.validate_config(problem, H200, {POLICY_KEY: "fastest"})


def test_policies_travel_through_export_and_import_and_bad_ones_are_skipped(db, won, tmp_path):
    import json as _json

    from autotile.store.exchange import export_database, import_file

    out = tmp_path / "export.jsonl"
    assert export_database(db, out) == {"winner": 0, "policy": 1}
    lines = [_json.loads(line) for line in out.read_text().splitlines()]
    (record,) = [r for r in lines if r.get("record") == "policy"]
    assert record["verified_range"] == {"m": [3, 4], "n": [40, 48], "k": [20, 28]}
    target = f"sqlite:///{tmp_path / 'target.sqlite'}"
    report = import_file(target, out)
    assert report.counts() == {"added": 1, "skipped": 0}
    (copied,) = Store(open_engine(target, create=False)).policies("gemm")
    assert copied.verified_range == record["verified_range"] and copied.samples == 4

    bad = dict(record, verified_range={"m": [3, 4], "n": [40, 48]})  # k is fixed nowhere and ranged nowhere
    worse = dict(record, verified_range={"m": [5, 4], "n": [40, 48], "k": [20, 28]})
    tampered = dict(record, config={"POLICY": "fastest"})
    header = _json.dumps(lines[0])
    body = [_json.dumps(r) for r in (bad, worse, tampered)]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([header, *body, _json.dumps({"record": "end", "count": 3})]) + "\n")
    report = import_file(f"sqlite:///{tmp_path / 'other.sqlite'}", path)
    assert report.counts() == {"skipped": 3}
