"""Where the templates and the shipped tuning database live, installed or in a checkout."""
from __future__ import annotations

from importlib import resources
from pathlib import Path


def _package_folder(subpackage: str, checkout_folder: str) -> Path:
    try:
        path = Path(str(resources.files(f"autotile.{subpackage}")))
        if path.is_dir():
            return path
    except ModuleNotFoundError:
        pass
    # A source checkout that was not pip-installed: the folder sits beside the package.
    return Path(__file__).resolve().parent.parent / checkout_folder


def templates_dir() -> Path:
    return _package_folder("templates", "templates")


def shipped_db_path() -> Path:
    return _package_folder("tuning_db", "tuning_db") / "winners.sqlite"


def shipped_dump_path() -> Path:
    return _package_folder("tuning_db", "tuning_db") / "winners.txt"
