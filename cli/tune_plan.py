"""`autotile tune --from-trace FILE --budget 10m` and `autotile tune gemm --model NAME --tokens ...`."""
from __future__ import annotations

import click

from autotile.cli.common import FamilyGroup, db_option, friendly_errors, known_families

# Families whose problems a model's dimensions describe.
MODEL_FAMILIES = ("gemm", "flash")


def option_value(parse, text: str, hint: str):
    """An option's text through `parse`, its refusal a usage error (exit 2) as the parser's own are."""
    from autotile.errors import BadInputError

    try:
        return parse(text)
    except BadInputError as exc:
        raise click.BadParameter(str(exc), param_hint=hint) from None


def model_options(family):
    """--model/--tokens/--dims (and --budget) for the families a model table describes; others get none."""

    def decorate(fn):
        if family.name not in MODEL_FAMILIES:
            return fn
        fn = click.option("--policy", is_flag=True,
                          help="with --model NAME[,NAME...]: verify the family's default config against the vendor op "
                               "on every projection of these models per M bucket, and store a policy where it wins "
                               "everywhere (it then serves untuned shapes in that range)")(fn)
        fn = click.option("--budget", default=None, metavar="DURATION",
                          help="time for the whole --model run, e.g. 10m (default: --trials per problem)")(fn)
        fn = click.option("--dims", default=None, metavar="hidden=N,intermediate=N,heads=N,kv_heads=N,head_dim=N",
                          help="a model that is not in the table")(fn)
        fn = click.option("--tokens", default=None, metavar="1,16,128,2048",
                          help="token counts (M) to tune with --model (default: every bucket 1..8192)")(fn)
        fn = click.option("--model", default=None, metavar="NAME[,NAME...]",
                          help="tune models' projections (gemm) or prefill attention (flash), each shape once; "
                               "see autotile.models")(fn)
        return fn

    return decorate


def take_model_options(options: dict) -> dict:
    """Remove the model options from a tune command's options; what is left describes one problem."""
    return {name: options.pop(name, None) for name in ("model", "tokens", "dims", "budget", "policy")}


# The problem options a --model run takes beside the model: the dtype, and flash's sequences a call (--batch).
MODEL_RUN_OPTIONS = {"gemm": ("dtype",), "flash": ("dtype", "batch")}


def tune_model(family, model_opts: dict, shape_options: dict, given: list[str], device, db_url, trials, seed,
               **tune_kwargs) -> None:
    """`given`: the problem options given on the command line (not left at their defaults)."""
    from autotile.models import parse_tokens
    from autotile.tune.plan import model_problems, parse_budget

    shapes = [name for name in ("m", "n", "k", "seq_q", "seq_k", "heads", "seq", "batch") if name in given
              and name not in MODEL_RUN_OPTIONS[family.name]]
    if shapes:
        raise click.UsageError(f"--model describes the shapes; drop {', '.join(_flag(g) for g in shapes)}")
    # Any other option (a bias, an activation, layouts, a window, the backward...) would be dropped: the model's
    # problems are what it runs. Said, not ignored.
    others = [name for name in given if name not in MODEL_RUN_OPTIONS[family.name]]
    if others:
        raise click.UsageError(
            f"--model/--dims tune the {family.name} problems the model runs ("
            f"{'its projections as nn.Linear calls' if family.name == 'gemm' else 'its causal prefill attention'}); "
            f"they take {', '.join(_flag(o) for o in MODEL_RUN_OPTIONS[family.name])} only. "
            f"Drop {', '.join(_flag(o) for o in others)}, or tune that one shape with its options "
            "(autotile.models.model_dims gives its dimensions)")
    dtype = _dtype(shape_options.get("dtype"))
    batch = shape_options.get("batch") or 1
    if model_opts["policy"]:
        _tune_policy(family, model_opts, dtype, device, db_url, seed, batch)
        return
    models = _models(model_opts)
    tokens = parse_tokens(model_opts["tokens"])
    planned = model_problems(family.name, models, tokens, dtype, batch)
    budget = option_value(parse_budget, model_opts["budget"], "--budget") if model_opts["budget"] else None
    click.echo(f"{', '.join(m.name for m in models)}: {len(planned)} {family.name} problems"
               + (f" within {budget:.0f} s" if budget else f", {trials} trials each"))
    _run(planned, device, budget, db_url, trials, seed, **tune_kwargs)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _models(model_opts: dict) -> list:
    """The models of --model NAME[,NAME...] and --dims (a model not in the table)."""
    from autotile.models import model_dims

    names = [n.strip() for n in (model_opts["model"] or "").split(",") if n.strip()]
    models = [model_dims(n) for n in names] + ([model_dims(None, model_opts["dims"])] if model_opts["dims"] else [])
    if not models:
        raise click.UsageError("name the models: --model NAME[,NAME...], or describe one with --dims")
    return models


def _tune_policy(family, model_opts: dict, dtype: str, device, db_url, seed, batch: int = 1) -> None:
    from autotile.models import parse_tokens
    from autotile.tune.plan import model_problems
    from autotile.tune.policy import tune_policy

    if device.interpret:
        raise click.UsageError("--policy keeps the family's default where it beats the vendor op (cuBLAS, SDPA) "
                               "over a range of shapes; the interpreter has no vendor op to time it against: run "
                               "it on the GPU whose policy you want")
    models = _models(model_opts)
    tokens = parse_tokens(model_opts["tokens"])
    # A policy must beat the vendor op, which has no soft-capping or window: heads alone (calls with those features
    # are the family's own anyway).
    problems = [p.problem for m in models for p in model_problems(family.name, [m], tokens, dtype, batch,
                                                                  features=False)]
    click.echo(f"policy: {len(problems)} {family.name} shapes of {', '.join(m.name for m in models)}")
    outcomes = tune_policy(family, problems, device, db_url=db_url, seed=seed, report=lambda line: click.echo(line))
    click.echo(f"{sum(o.stored for o in outcomes)} of {len(outcomes)} groups won by the default config everywhere")


def _dtype(value) -> str:
    from autotile.dtypes import canonical_dtype_name

    if isinstance(value, (tuple, list)):
        value = value[0] if value else None
    return canonical_dtype_name(value) if value else "bf16"


def _run(planned, device, budget, db_url, trials, seed, **tune_kwargs) -> None:
    from autotile.cli.tune_run import EXIT_INTERRUPTED
    from autotile.tune.plan import tune_planned

    try:
        outcome = tune_planned(planned, device, budget_s=budget, db_url=db_url, trials=trials, seed=seed,
                               report=lambda line: click.echo(line), **tune_kwargs)
    except KeyboardInterrupt:  # a second Ctrl-C: the current problem stored nothing new
        click.echo("interrupted before the current problem's winner was stored; every finished trial is stored: "
                   "run the same command again to resume", err=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
    vendor = sum(1 for r in outcome.tuned if r.vendor_won)
    ranged = sum(1 for r in outcome.tuned if r.verified_range and not r.vendor_won)
    exact = len(outcome.tuned) - vendor - ranged
    partly = " (the last of them interrupted: its search resumes on the next run)" if outcome.interrupted else ""
    click.echo(f"tuned {len(outcome.tuned)} problem(s){partly} in {outcome.seconds:.0f} s: {vendor} served by the "
               f"vendor op, {ranged} generated winners verified over their bucket, {exact} for their exact shape only; "
               f"{len(outcome.skipped)} left for a later run, {len(outcome.failed)} failed")
    for item, reason in outcome.failed:
        click.echo(f"  failed: {item.family.name} {item.family.problem_key(item.problem)}: {reason}", err=True)
    if outcome.interrupted:
        click.echo("interrupted: the best so far is stored; run the same command again to resume", err=True)
        raise SystemExit(EXIT_INTERRUPTED)
    if planned and not outcome.tuned:
        raise click.ClickException("no problem was tuned" + (": the budget is too small" if outcome.skipped else ""))
    if outcome.failed:
        # As `autotile tune` of one problem: a script that runs this must see that part of it did not happen.
        raise click.ClickException(f"{len(outcome.failed)} of {len(planned)} problem(s) failed (above); the others "
                                   "are stored")


def _nothing_to_tune(trace_path, entries, families) -> str:
    """Why a trace gave no problem to tune, and what to do."""
    if not entries:
        return (f"{trace_path} holds no problems: the recorded run made no autotile call; run the model with "
                "AUTOTILE_RECORD=FILE set")
    if families and not any(e.family in families for e in entries):
        held = ", ".join(sorted({e.family for e in entries}))
        return f"{trace_path} holds no {' or '.join(families)} problems (it holds {held}): drop --family or change it"
    return (f"none of the {len(entries)} recorded problem(s) in {trace_path} can be tuned (the notes above say "
            "why); a trace from another autotile version: record it again with this one")


def tune_group(factory) -> click.Group:
    """The `tune` group: one subcommand per family, plus `--from-trace FILE` for what a model ran."""

    @click.option("--from-trace", "trace_path", default=None, type=click.Path(dir_okay=False),
                  help="tune the problems recorded with AUTOTILE_RECORD=FILE, most calls first")
    @click.option("--budget", default=None, metavar="DURATION", help="time for the whole --from-trace run, e.g. 10m")
    @click.option("--gpu", default="auto", show_default=True, help="GPU profile to tune for (with --from-trace)")
    @click.option("--trials", default=40, show_default=True, type=click.IntRange(1),
                  help="most trials per problem (with --from-trace)")
    @click.option("--family", "families", multiple=True, callback=known_families,
                  help="only these families of the trace (repeatable)")
    @click.option("--shard", default=None, metavar="K/N",
                  help="tune the K-th of N shards of the trace (every N-th problem, most called first), within "
                       "--budget: several GPUs or runs share one trace")
    @click.option("--seed", default=0, show_default=True, type=int)
    @db_option
    @click.pass_context
    @friendly_errors
    def callback(ctx, trace_path, budget, gpu, trials, families, shard, seed, db_url):
        # The group's own options serve --from-trace only: before a family, or without a trace, they would be
        # ignored (`tune --db X gemm ...` would tune into AUTOTILE_DB).
        given = [param.opts[0] for param in ctx.command.params if param.name != "trace_path"
                 and ctx.get_parameter_source(param.name) == click.core.ParameterSource.COMMANDLINE]
        verb = "go" if len(given) > 1 else "goes"
        if ctx.invoked_subcommand is not None:
            if trace_path:
                raise click.UsageError("--from-trace tunes what the trace holds; give it without a family")
            if given:
                raise click.UsageError(f"{', '.join(given)} before a family {verb} with --from-trace; give the "
                                       "family's own options after its name (`autotile tune gemm --trials 20 "
                                       "--db FILE ...`)")
            return
        if not trace_path:
            if given:
                raise click.UsageError(f"{', '.join(given)} {verb} with --from-trace FILE, or after a family's name "
                                       "(`autotile tune gemm ...`)")
            click.echo(ctx.get_help())
            return
        from autotile.device import resolve_gpu
        from autotile.runtime.trace import read_trace
        from autotile.tune.plan import parse_budget, parse_shard, plan_from_trace, shard_of

        seconds = option_value(parse_budget, budget, "--budget") if budget else None
        part = option_value(parse_shard, shard, "--shard") if shard else None
        entries = read_trace(trace_path)
        device = resolve_gpu(gpu)
        planned, notes = plan_from_trace(entries, families or None)
        for note in notes:
            click.echo(f"note: {note}", err=True)
        if not planned:
            raise click.ClickException(_nothing_to_tune(trace_path, entries, families))
        others = sorted({e.device for e in entries} - {device.key})
        if others:
            click.echo(f"note: the trace was recorded on {', '.join(others)}; tuning for {device.key}", err=True)
        total = len(planned)
        if part:
            planned = shard_of(planned, *part)
        click.echo(f"{trace_path}: {len(entries)} recorded problem(s) -> {total} to tune"
                   + (f", {len(planned)} in shard {part[0]}/{part[1]}" if part else "")
                   + (f" within {seconds:.0f} s" if seconds else ""))
        _run(planned, device, seconds, db_url, trials, seed)

    group = FamilyGroup(name="tune", factory=factory, invoke_without_command=True, callback=callback,
                        params=list(reversed(getattr(callback, "__click_params__", []))),
                        help="Search a family's tuning space on this GPU and store the winner; "
                             "`autotile tune --from-trace FILE` tunes what a model ran.")
    return group
