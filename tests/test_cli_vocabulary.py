"""One CLI vocabulary: help text on every option of every command, and the common
options on every command that computes something."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from experiments.cli import COMMANDS, main

COMMON = ("--quick", "--no-progress", "--seed", "--out", "--force")
READERS = {"report": "--out", "compare": "--out", "gpu-summary": "--out"}  # read finished folders: no stream, nothing to recompute
PARTIAL = {"fit-links": ("--quick", "--seed", "--out")}  # one fit, no point cache and no progress bar


def _command(name: str) -> click.Command:
    ctx = main.make_context("libra-bench", [name], resilient_parsing=True)
    return main.get_command(ctx, name)


def _flags(command: click.Command) -> set[str]:
    return {f for p in command.params for f in [*getattr(p, "opts", []), *getattr(p, "secondary_opts", [])]}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_has_help(name):
    command = _command(name)
    bare = [p.opts[0] for p in command.params if isinstance(p, click.Option) and not p.hidden and not p.help]
    assert not bare, f"{name}: options without help text: {bare}"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_common_options_everywhere(name):
    want = (READERS[name],) if name in READERS else PARTIAL.get(name, COMMON)
    missing = [f for f in want if f not in _flags(_command(name))]
    assert not missing, f"{name} lacks {missing}"


def test_train_quick_keeps_what_is_given(tmp_path, monkeypatch):
    import json  # noqa: PLC0415

    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["train", "--nproc", "1", "--cp", "1", "--attention", "reference", "--quick",
                                    "--steps", "1", "--out", str(tmp_path / "t")])
    assert res.exit_code == 0, res.output
    cfg = json.loads((tmp_path / "t" / "run.json").read_text())["config"]
    assert cfg["steps"] == 1 and cfg["seq_len"] == 256 and cfg["model"]["layers"] == 1


def test_every_plot_goes_through_the_shared_helper():
    """Plots are saved by experiments.common.plotting.save_figure (one DPI, layout and close), not ad hoc."""
    from pathlib import Path  # noqa: PLC0415

    root = Path(__file__).resolve().parents[1] / "experiments"
    ad_hoc = [p.name for p in root.rglob("*.py") if p.name != "plotting.py" and ".savefig(" in p.read_text()]
    assert not ad_hoc, f"save plots with experiments.common.plotting.save_figure: {ad_hoc}"
