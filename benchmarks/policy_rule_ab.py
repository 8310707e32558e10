"""One rule of the gemm policy against the policy without it, timed on the model shapes where the two differ.

Run from the repository root:
    python benchmarks/policy_rule_ab.py --rule _prefill_narrow_wide --plan                # the rows it changes, no GPU
    python benchmarks/policy_rule_ab.py --rule _prefill_narrow_wide --out OUT/ab.json     # ~30 s on an H100
    python benchmarks/policy_rule_ab.py --rule _wide_one_wave --seed 1 --out OUT/oos.json  # other token counts
    python benchmarks/policy_rule_ab.py --set NARROW_SPLIT_MAX=4 --out OUT/refit.json     # a constant refitted

With --set, the policy with gemm_policy's named constants set to the values given (numbers) takes the rule's place
(labelled the default), against the policy as it is (labelled the rule off): a constant refitted without editing
the policy first.

Each rule named in RULES returns a config or None, and None hands the problem to the rules after it. For every
projection of the model table (nn.Linear layout, bf16) at TOKENS, the policy's default is compared with the default
it gives with the rule returning None; `--per-weight` of the rows where they differ are drawn for each weight shape
(`--seed` draws others: a rule fitted on one draw is checked out of sample on another). Both configs of a row are
timed as a decode step or prefill chunk runs them (CUDA-graph streams beside F.linear, interleaved rounds, medians:
decode_stream_candidates.time_shape), each checked against F.linear first. Prints a line a row and the verdict (the
geometric mean of cuBLAS / ours with and without the rule, and how many rows the rule won), and writes every timing
as JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import gemm_kernels_bench as gkb  # noqa: E402  (compile pool, config labels, the planning device)
from decode_stream_candidates import cuda_device, time_plans  # noqa: E402

from autotile.families import gemm_policy  # noqa: E402
from autotile.families.gemm import FAMILY, contiguous_problem  # noqa: E402
from autotile.models import MODELS, projections  # noqa: E402

# The policy's rules that return None where they do not apply, handing the problem to the rules after them.
RULES = ("_wide_one_wave", "_prefill_narrow_wide", "_narrow_one_wave", "_one_wave_split", "few_tokens_config",
         "token_tile_config", "_narrow_gluon_split", "_long_k_gluon_split", "_prefill_narrow_tma")
# Token counts compared: every 8 up to 2048 (decode steps and prefill chunks), every 64 to 8192.
TOKENS = tuple(range(1, 2048, 8)) + tuple(range(2048, 8193, 64))
WITH, WITHOUT = "default", "rule off"  # origins (decode_stream_candidates.time_shape labels the default)


@contextmanager
def rule_off(rule: str):
    """gemm_policy.`rule` returning None while inside."""
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}: name one of {', '.join(RULES)}")
    kept = getattr(gemm_policy, rule)
    setattr(gemm_policy, rule, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        setattr(gemm_policy, rule, kept)


def policy_constant(name: str) -> int | float:
    """gemm_policy's numeric module constant `name`; ValueError for any other name."""
    value = getattr(gemm_policy, name, None)
    if not name.isupper() or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name!r} is not a numeric constant of gemm_policy: name one such as NARROW_SPLIT_MAX")
    return value


@contextmanager
def constants_set(values: dict[str, float]):
    """gemm_policy's module constants named in `values` set to them while inside."""
    kept = {name: policy_constant(name) for name in values}
    try:
        for name, value in values.items():
            setattr(gemm_policy, name, type(kept[name])(value))
        yield
    finally:
        for name, value in kept.items():
            setattr(gemm_policy, name, value)


def changed_rows(rule: str | dict, device, models=None, tokens=TOKENS) -> list:
    """(problem, default, default without `rule`) for each projection of `models` (all of the table's by default) at
    `tokens` where the two differ. A dict in place of a rule's name sets those constants (constants_set) for the
    first config of each row and leaves the second to the policy as it is."""
    shapes = sorted({(p.n, p.k) for name in (models or MODELS) for p in projections(MODELS[name])})
    if isinstance(rule, dict):
        first, second = (lambda: constants_set(rule)), nullcontext
    else:
        first, second = nullcontext, (lambda: rule_off(rule))
    rows = []
    for n, k in shapes:
        for m in tokens:
            problem = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
            with first():
                with_rule = FAMILY.default_config(problem, device)
            with second():
                without = FAMILY.default_config(problem, device)
            if with_rule != without:
                rows.append((problem, with_rule, without))
    return rows


def parse_constants(text: str) -> dict[str, float]:
    """NAME=VALUE[,NAME=VALUE...] -> {NAME: VALUE}, each NAME a constant of gemm_policy (policy_constant)."""
    values = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        try:
            values[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise argparse.ArgumentTypeError(f"{item!r}: write NAME=NUMBER, e.g. NARROW_SPLIT_MAX=4")
        try:
            policy_constant(name.strip())
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return values


def drawn(rows: list, per_weight: int, seed: int) -> list:
    """`per_weight` of `rows` for each weight shape (N, K), drawn with `seed`, in token order."""
    by_weight: dict = {}
    for row in rows:
        by_weight.setdefault((row[0].n, row[0].k), []).append(row)
    rng = random.Random(seed)
    picked = []
    for weight in sorted(by_weight):
        group = by_weight[weight]
        picked += sorted(rng.sample(group, min(per_weight, len(group))), key=lambda row: row[0].m)
    return picked


def verdict(timed: list[dict], change: str = "the rule") -> str:
    """The geometric means of cuBLAS / ours without and with the rule (or `change`) over the rows where both ran
    (time_shape marks the default's name " [default]"), and its wins."""
    pairs = []
    for row in timed:
        with_rule = [us for name, us in row["us"].items() if name.endswith("[default]")]
        without = [us for name, us in row["us"].items() if not name.endswith("[default]")]
        if with_rule and without:
            pairs.append((row["cuBLAS_us"] / without[0], row["cuBLAS_us"] / with_rule[0]))
    if not pairs:
        return "no row timed both configs"
    geomean = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))  # noqa: E731
    return (f"{len(pairs)} rows: {geomean([p[0] for p in pairs]):.3f}x of cuBLAS without {change} -> "
            f"{geomean([p[1] for p in pairs]):.3f}x with it; {change} ahead on {sum(b > a for a, b in pairs)}, "
            f"worst pair {min(b / a for a, b in pairs):.3f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    change = parser.add_mutually_exclusive_group(required=True)
    change.add_argument("--rule", choices=RULES)
    change.add_argument("--set", type=parse_constants, metavar="NAME=VALUE[,...]",
                        help="gemm_policy constants to try against the policy as it is")
    parser.add_argument("--out", type=Path, default=Path("policy_rule_ab.json"))
    parser.add_argument("--models", type=lambda t: t.split(","), help="comma-separated model names (default: all)")
    parser.add_argument("--per-weight", type=int, default=3, help="rows drawn for each weight shape")
    parser.add_argument("--seed", type=int, default=0, help="which rows are drawn")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--budget-s", type=float, default=300, help="no row starts after this many seconds")
    parser.add_argument("--workers", type=int, default=14, help="processes compiling kernels ahead")
    parser.add_argument("--plan", action="store_true", help="list the rows (H200 policy) and exit")
    args = parser.parse_args()
    unknown = sorted(set(args.models or ()) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}: choose from {', '.join(MODELS)}")
    change = args.set if args.set is not None else args.rule
    label = args.rule or "set " + ",".join(f"{name}={value:g}" for name, value in args.set.items())
    if args.plan:
        rows = changed_rows(change, gkb.H200_PLAN, args.models)
        for problem, with_rule, without in drawn(rows, args.per_weight, args.seed):
            print(f"{problem.m}x{problem.n}x{problem.k}: {gkb.short(with_rule)} "
                  f"({'without' if args.rule else 'as is'}: {gkb.short(without)})")
        print(f"{len(rows)} rows changed; {args.per_weight} drawn per weight shape")
        return 0

    device = cuda_device()
    if device is None:
        return 2
    started = time.monotonic()
    plans = [(problem, {with_rule: WITH, without: WITHOUT}) for problem, with_rule, without
             in drawn(changed_rows(change, device, args.models), args.per_weight, args.seed)]
    if not plans:
        print(f"{label} changes no default on this GPU")
        return 0
    status = time_plans(plans, args.rounds, args.budget_s, args.out, args.workers, started, rule=label,
                        seed=args.seed)
    print(verdict(json.loads(args.out.read_text())["rows"], "the rule" if args.rule else "the change"))
    return status


if __name__ == "__main__":
    sys.exit(main())
