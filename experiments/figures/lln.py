"""`libra-bench lln` (Figure 4): production-order pool imbalance R - 1 against pool size P.

Libra sec. 3.2: pooling P consecutive (production-order) packed sequences concentrates each pool's
workload by the law of large numbers, but slowly: the paper reports R - 1 of about 1.08 (256K) and
0.90 (1M) at P = 8, and 0.09 / 0.08 even at P = 64. This command measures that curve on any
workload (a preset or a length file): per GBS window and pool size it records production-order
R - 1 and the lower bound no grouping can beat. Same outputs, caching and options as
`libra-bench vrsp` (see :mod:`experiments.figures.vrsp_sweep`), with strategy ``production`` only.
"""

from __future__ import annotations

import click

from experiments.common.options import grouping_sweep_options
from experiments.figures.vrsp_sweep import GroupingSweepConfig, print_summary, run_grouping_sweep


@click.command("lln")
@grouping_sweep_options()
def lln(workload, seq_len, gbs, pool_sizes, windows, seed, out, quick, force):
    """Figure 4: production-order R - 1 vs pool size P (1, 2, 4, ..., 64)."""
    df, paths = run_grouping_sweep(GroupingSweepConfig(
        name="lln", strategies=["production"], workload=workload, seq_len=seq_len, gbs=gbs,
        pool_sizes=pool_sizes, windows=windows, seed=seed, out=out, quick=quick, force=force))
    print_summary(df)
    click.echo(f"wrote {paths['csv']}, {paths['png']}, {paths['run']}")
