"""Pieces every `autotile` command shares: error reporting, the --db option, family problem options."""
from __future__ import annotations

import functools

import click

from autotile.errors import AutotileError


def friendly_errors(fn):
    """AutotileError -> a one-line message and exit status 1, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except AutotileError as exc:
            raise click.ClickException(str(exc)) from None

    return wrapper


db_option = click.option("--db", "db_url", default=None, envvar="AUTOTILE_DB",
                         help="SQLAlchemy URL or SQLite file of the tuning database (default: the user cache dir).")


def family_options(family):
    """Click options built from a family's problem options (`Family.cli_options`)."""

    def decorate(fn):
        for opt in reversed(family.cli_options):
            flag = "--" + opt.name.replace("_", "-")
            if opt.type is bool:
                fn = click.option(flag + "/--no-" + opt.name.replace("_", "-"), opt.name, default=bool(opt.default),
                                  help=opt.help)(fn)
            else:
                kind = click.Choice(opt.choices) if opt.choices else opt.type
                default = opt.default
                if opt.multiple and default is not None and not isinstance(default, (tuple, list)):
                    default = (default,)  # click takes the default of a repeatable option as a sequence
                fn = click.option(flag, opt.name, type=kind, default=default, help=opt.help,
                                  multiple=opt.multiple, show_default=opt.default is not None)(fn)
        return fn

    return decorate


class FamilyGroup(click.Group):
    """A group whose subcommands are the families present, built on first use by `factory(name)`."""

    def __init__(self, *args, factory, **kwargs):
        super().__init__(*args, **kwargs)
        self._factory = factory

    def list_commands(self, ctx):
        from autotile.families import family_names

        return family_names()

    def get_command(self, ctx, name):
        from autotile.families import family_names

        return self._factory(name) if name in family_names() else None
