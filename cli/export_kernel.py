"""`autotile export-kernel FAMILY [shape options] --out FILE`: the tuned kernel as a standalone Triton module."""
from __future__ import annotations

from pathlib import Path

import click

from autotile.cli.common import FamilyGroup, db_option, family_options, friendly_errors, named_file, refuse_overwriting_database


def _make_export_command(name: str):
    from autotile.families import get_family

    family = get_family(name)

    @click.command(name=name, help=f"Write the tuned {name} kernel for one problem as a standalone Triton module.")
    @family_options(family)
    @click.option("--out", "out", required=True, type=click.Path(dir_okay=False, path_type=Path), callback=named_file,
                  help="the .py file to write ('-': standard output)")
    @click.option("--config", "config_json", default=None,
                  help="config JSON to bake in instead of the stored winner (validated against the space); axes it "
                       "leaves out take the default config's values")
    @click.option("--gpu", default="auto", show_default=True,
                  help="device whose winner to export (h200, ..., auto, or interpret)")
    @db_option
    @friendly_errors
    def command(out, config_json, gpu, db_url, **options):
        from autotile.device import resolve_gpu
        from autotile.errors import BadInputError
        from autotile.export_kernel import ExportNotSupportedError, export_kernel, export_not_supported_reason, write_kernel
        from autotile.space import Config

        refuse_overwriting_database(out, db_url)
        reason = export_not_supported_reason(name)
        if reason:
            raise ExportNotSupportedError(reason)
        problems = family.problems_from_cli(**options)
        if len(problems) != 1:
            raise BadInputError(f"export-kernel writes one kernel: give one {name} problem's shape "
                                f"(these options give {len(problems)} problems)")
        device = resolve_gpu(gpu, planned=True)  # (nothing runs here: a named GPU's winner exports from anywhere)
        config = Config.from_json(config_json) if config_json else None
        kernel = export_kernel(name, problems[0], device, db_url=db_url, config=config)
        to_stdout = str(out) == "-"
        if to_stdout:
            click.echo(kernel.source)
        else:
            write_kernel(kernel, out)
        click.echo(f"wrote {'the module to standard output' if to_stdout else out}: {name} {kernel.problem_key}\n"
                   f"  config {kernel.config.to_json()}\n"
                   f"  from {kernel.origin}; call its {kernel.entry_point}(...) (the launcher at the end of the file)",
                   err=to_stdout)

    return command


def _exportable(name: str) -> bool:
    from autotile.export_kernel import export_not_supported_reason

    return export_not_supported_reason(name) is None


export_kernel_command = FamilyGroup(
    name="export-kernel", factory=_make_export_command, listed=_exportable,
    help="Write a tuned kernel as a standalone Triton module (config baked in, small launcher; "
         "gemm, elementwise and paged).")
