"""`libra-bench`: one click command per paper experiment.

Commands live in their own modules and are imported lazily, so `libra-bench --help` stays fast and
a broken optional dependency of one experiment (e.g. a GPU-only backend) does not break the others.
"""

from __future__ import annotations

import importlib
import importlib.util

import click

# command name -> "module:attribute" of a click.Command
COMMANDS: dict[str, str] = {
    "lln": "experiments.figures.lln:lln",
    "vrsp": "experiments.figures.vrsp_sweep:vrsp",
    "plan-cost": "experiments.figures.plan_cost:plan_cost",
    "straggler": "experiments.figures.straggler:straggler",
    "pool-sweep": "experiments.figures.pool_sweep:pool_sweep",
    "grid-search": "experiments.figures.grid_search:grid_search",
    "variability": "experiments.figures.variability:variability",
    "tune": "experiments.figures.tune:tune",
    "report": "experiments.common.report:report",
    "compare": "experiments.common.compare:compare",
    "microbench": "experiments.measured.microbench:microbench",
    "train": "experiments.measured.train:train",
    "dp-scaling": "experiments.figures.dp_scaling:dp_scaling",
    "pp-balance": "experiments.figures.pp_balance:pp_balance",
    "e2e": "experiments.figures.e2e:e2e",
    "calibrate": "experiments.measured.calibrate:calibrate",
    "sim-check": "experiments.measured.sim_check:sim_check",
    "fidelity": "experiments.measured.fidelity:fidelity",
    "kernel-sweep": "experiments.measured.kernel_sweep:kernel_sweep",
    "gpu-summary": "experiments.measured.gpu_summary:gpu_summary",
    "tile-overhead": "experiments.measured.tile_overhead:tile_overhead",
    "fit-links": "experiments.figures.fit_links:fit_links",
    "robustness": "experiments.figures.robustness:robustness",
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def list_commands(self, ctx):
        return sorted(name for name in COMMANDS if self._available(name))

    @staticmethod
    def _available(name: str) -> bool:
        module = COMMANDS[name].split(":")[0]
        return importlib.util.find_spec(module) is not None

    def get_command(self, ctx, name):
        if name not in COMMANDS or not self._available(name):
            return None
        from experiments.common.options import with_config_option  # noqa: PLC0415

        module, attr = COMMANDS[name].split(":")
        return with_config_option(getattr(importlib.import_module(module), attr))


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="libra-bench")
def main() -> None:
    """Libra-bench: reproduce and compare bounded attention pools (Libra) against Ulysses,
    WLB-LLM and DistCA, in simulation (default) or measured with torch.distributed."""


if __name__ == "__main__":
    main()
