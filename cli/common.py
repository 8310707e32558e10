"""Pieces every `autotile` command shares: error reporting, the --db option, family problem options."""
from __future__ import annotations

import errno
import functools

import click

from autotile.errors import AutotileError, NoFeasibleConfigError


# Errors of a path the user gave (an --out in a missing folder, under a file, read-only, a folder): one line, no
# traceback.
_PATH_ERRORS = {errno.ENOENT: "no such folder", errno.ENOTDIR: "a part of the path is a file, not a folder",
                errno.EACCES: "permission denied", errno.EPERM: "not permitted", errno.EISDIR: "it is a folder",
                errno.EROFS: "a read-only file system",
                errno.EEXIST: "a part of the path is a file, not a folder"}  # mkdir(parents=True) over a file


def friendly_errors(fn):
    """AutotileError, a failing database (damaged, full, read-only, busy, a row it cannot read), a full disk and
    a problem no config of its family fits -> a one-line message and exit status 1, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NoFeasibleConfigError as exc:
            raise click.ClickException(f"{exc}: no kernel config of this family fits the problem on this GPU; try "
                                       "another shape, dtype or --gpu") from None
        except AutotileError as exc:
            raise click.ClickException(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - re-raised unless it is a database or disk failure
            from autotile.store.db import database_failure

            line = database_failure(exc, kwargs.get("db_url"))
            if line is None and isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                line = f"no space left to write {exc.filename or 'a file'}: free some space and run the command again"
            if line is None and isinstance(exc, OSError) and exc.errno in _PATH_ERRORS and exc.filename:
                what = _PATH_ERRORS[exc.errno] if exc.errno == errno.EEXIST else exc.strerror or _PATH_ERRORS[exc.errno]
                line = (f"cannot use {exc.filename}: {what}; check the path (its "
                        "folder must exist and be a folder you may write in)")
            if line is None:
                raise
            raise click.ClickException(line) from None

    return wrapper


def named_file(ctx, param, value):
    """Click callback of an --out FILE: an empty name is a usage error, not a traceback from pathlib."""
    from pathlib import Path

    if value is not None and value != "-" and not Path(str(value).strip()).name:
        raise click.BadParameter(f"give a file name ({str(value)!r} names no file)")
    return value


def refuse_overwriting_database(out, db_url: str | None, storage: str | None = None) -> None:
    """A usage error where --out names the tuning database (or its WAL, shared-memory or journal file, or a study
    journal beside it): writing there would destroy every trial it holds."""
    from pathlib import Path

    from autotile.store.db import default_db_url, normalise_url, sqlite_path

    if out is None or str(out) == "-":
        return
    target = Path(out).expanduser().resolve()
    for url in (db_url or default_db_url(), storage):
        if url is None:
            continue
        path = Path(url.removeprefix("journal:")) if url.startswith("journal:") else sqlite_path(normalise_url(url))
        if path is None:
            continue
        path = path.expanduser().resolve()
        companions = {path, *(path.with_name(path.name + suffix) for suffix in ("-wal", "-shm", "-journal", ".lock"))}
        if target in companions or path.with_name(path.name + ".studies") in target.parents:
            raise click.BadParameter(f"{out} is the tuning database {path} (or a file of it): writing it would "
                                     "destroy every trial it holds; give another file", param_hint="--out")


def what_is_stored(db_url, family: str | None, device_key: str | None) -> str:
    """For a selection that matched nothing: what the database does hold ('' where the selection was everything
    or the database holds no winners)."""
    from autotile.store.db import open_engine, reading
    from autotile.store.repo import Store

    if not (family or device_key):
        return ""
    with reading(db_url):
        stored = Store(open_engine(db_url, create=False, read_only=True)).winners(None, None)
    if not stored:
        return ""
    asked = " and ".join(f"{name} {value!r}" for name, value in (("family", family), ("device", device_key)) if value)
    return (f"no winners stored for {asked}; the database holds winners of families "
            f"{', '.join(sorted({w.family for w in stored}))} on devices {', '.join(sorted({w.device_key for w in stored}))}")


def known_family(ctx, param, value):
    """Click callback: a family name autotile has (None passes), else a usage error listing them."""
    from autotile.families import family_names

    if value is not None and value not in family_names():
        raise click.BadParameter(f"unknown family {value!r}; autotile has {', '.join(family_names())}")
    return value


def known_families(ctx, param, values):
    """Click callback of a repeatable --family: each a family name autotile has."""
    return tuple(known_family(ctx, param, value) for value in values)


def positive_seconds(ctx, param, value):
    """Click callback: a duration in seconds above 0 (None passes). A timeout of 0 or less would end the search
    before its first trial and read as 'every trial failed'; NaN would be no limit at all."""
    if value is not None and not value > 0:
        raise click.BadParameter(f"{value} is not a number of seconds above 0; leave it out for no limit")
    return value


def _blank_is_unset(ctx, param, value):
    """AUTOTILE_DB="  " (or --db "") means no database given, as blank AUTOTILE_RECORD means no trace."""
    return value.strip() or None if isinstance(value, str) else value


db_option = click.option("--db", "db_url", default=None, envvar="AUTOTILE_DB", callback=_blank_is_unset,
                         help="SQLAlchemy URL or SQLite file of the tuning database (default: the user cache dir).")


# One spelling of each head option across families; the earlier per-family spellings stay as aliases.
FLAG_NAMES = {
    "heads": ("--heads", "--q-heads"), "q_heads": ("--heads", "--q-heads"),
    "heads_kv": ("--kv-heads", "--heads-kv"), "kv_heads": ("--kv-heads", "--heads-kv"),
}


# Options whose 0 a family reads as "not given" (paged: mean_context 0 means every sequence is --context long).
# Given on the command line they must be real values; left out they stay None.
AT_LEAST_ONE = {"mean_context": "a mean context length in tokens; leave it out when every sequence is --context long"}


def _at_least_one(ctx, param, value):
    """Click callback: None (not given) passes; below 1 is refused, never read as 'not given'."""
    if value is not None and value < 1:
        raise click.BadParameter(f"must be >= 1, got {value}: {AT_LEAST_ONE[param.name]}")
    return value


def flags_of(option_name: str) -> tuple[str, ...]:
    """The command-line flags of a family option: its preferred spelling first, then any alias."""
    return FLAG_NAMES.get(option_name, ("--" + option_name.replace("_", "-"),))


class DtypeChoice(click.ParamType):
    """A dtype among `choices`, by its short or its torch name (bf16 / bfloat16 / torch.bfloat16)."""

    name = "dtype"

    def __init__(self, choices):
        self.choices = tuple(choices)

    def get_metavar(self, param, ctx=None) -> str:
        return "[" + "|".join(self.choices) + "]"

    def convert(self, value, param, ctx):
        from autotile.dtypes import canonical_dtype_name

        try:
            name = canonical_dtype_name(value)
        except AutotileError:
            name = None
        if name not in self.choices:
            self.fail(f"{value!r} is not one of {', '.join(self.choices)} (torch names such as bfloat16 work too)",
                      param, ctx)
        return name


class CommaList(click.ParamType):
    """One or several values of `item` separated by commas: `--seq 64,128` is `--seq 64 --seq 128`."""

    def __init__(self, item):
        self.item = item
        self.name = f"{getattr(item, 'name', 'value')}[,...]"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        parts = [p.strip() for p in str(value).split(",")]
        if not all(parts):
            self.fail(f"{value!r}: give values separated by commas, e.g. 64,128", param, ctx)
        return tuple(self.item.convert(p, param, ctx) for p in parts)


def _flatten(ctx, param, value):
    return tuple(v for group in value for v in (group if isinstance(group, tuple) else (group,))) if value else value


def _is_dtype_choice(option) -> bool:
    from autotile.dtypes import canonical_dtype_name

    try:
        return bool(option.choices) and all(canonical_dtype_name(c) == c for c in option.choices)
    except AutotileError:
        return False


def family_options(family):
    """Click options built from a family's problem options (`Family.cli_options`).

    Dtype options take torch names too; repeatable numeric and choice options take comma-separated
    values; head options are spelled --heads / --kv-heads in every family (older spellings still work).
    """

    def decorate(fn):
        for opt in reversed(family.cli_options):
            flags = flags_of(opt.name)
            if opt.type is bool:
                negative = "--no-" + flags[0].removeprefix("--")
                fn = click.option(flags[0] + "/" + negative, opt.name, default=bool(opt.default), help=opt.help)(fn)
                continue
            if _is_dtype_choice(opt):
                kind = DtypeChoice(opt.choices)
            else:
                kind = click.Choice(opt.choices) if opt.choices else click.types.convert_type(opt.type)
            default = opt.default
            callback = _at_least_one if opt.name in AT_LEAST_ONE else None
            if opt.multiple:
                if default is not None and not isinstance(default, (tuple, list)):
                    default = (default,)  # click takes the default of a repeatable option as a sequence
                if opt.type is not str or opt.choices:  # free text (expressions) may hold commas itself
                    kind, callback = CommaList(kind), _flatten
            help_text = opt.help + (" (comma-separated or repeated)" if callback is _flatten else "")
            fn = click.option(*flags, opt.name, type=kind, default=default, help=help_text, multiple=opt.multiple,
                              show_default=opt.default is not None, callback=callback)(fn)
        return fn

    return decorate


class FamilyGroup(click.Group):
    """A group whose subcommands are the families present, built on first use by `factory(name)`."""

    def __init__(self, *args, factory, listed=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._factory = factory
        self._listed = listed  # which families --help lists (default: all); the others still explain themselves

    def list_commands(self, ctx):
        from autotile.families import family_names

        return [name for name in family_names() if self._listed is None or self._listed(name)]

    def get_command(self, ctx, name):
        from autotile.families import family_names

        return self._factory(name) if name in family_names() else None
