"""`autotile warmup`: compile what the ops will serve for a model's shapes, before its first request."""
from __future__ import annotations

import click

from autotile.cli.common import friendly_errors


@click.command("warmup")
@click.option("--model", default=None, metavar="NAME", help="a model of the table (autotile.models), e.g. llama3-8b")
@click.option("--dims", default=None, metavar="hidden=N,intermediate=N,heads=N,kv_heads=N,head_dim=N",
              help="a model that is not in the table")
@click.option("--tokens", default=None, metavar="1,2,4,...",
              help="token counts of the projections (default: every bucket 1..8192); give the ones the engine runs, "
                   "its CUDA-graph batch sizes and prefill chunk")
@click.option("--prefill", default=None, metavar="1x4096,4x2048",
              help="prefill attention calls, BATCHxTOKENS (default: none)")
@click.option("--backward", is_flag=True, help="a training step of each attention call too")
@click.option("--dtype", type=click.Choice(["bf16", "fp16"]), default="bf16", show_default=True)
@click.option("--layout", type=click.Choice(["bshd", "bhsd"]), default="bshd", show_default=True,
              help="attention tensors as (B, S, H, D) projections seen as (B, H, S, D), or contiguous (B, H, S, D)")
@friendly_errors
def warmup_command(model, dims, tokens, prefill, backward, dtype, layout):
    """Call the ops once for every shape a model runs, on this machine's GPU, so that every kernel they serve is
    compiled (Triton's on-disk cache keeps it for later processes) before the first request meets the stall."""
    from autotile.runtime.warmup import warmup

    header = [f"{'op':<30} {'shape':<44} {'first s':>8} {'again ms':>9}  served"]

    def report(call):
        while header:
            click.echo(header.pop())
        click.echo(f"{call.op:<30} {call.shape:<44} {call.first_s:>8.2f} {call.again_s * 1e3:>9.2f}  {call.served}")

    warmed = warmup(model, dims=dims, tokens=tokens, prefill=prefill, dtype=dtype, layout=layout, backward=backward,
                    report=report)
    total = sum(c.first_s for c in warmed)
    slow = sorted(warmed, key=lambda c: -c.first_s)[:3]
    click.echo(f"{len(warmed)} calls warmed in {total:.1f} s of first calls; the slowest: "
               + ", ".join(f"{c.op} {c.shape} {c.first_s:.1f} s" for c in slow))
