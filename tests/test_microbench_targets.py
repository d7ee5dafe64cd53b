"""The CPU microbench's targets live in the command: `microbench` recognises their reference cases (the
layout of its reference command and the skewed / uniform length files) and prints each target's
verdict; any other run gets none."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from experiments.measured import microbench as mb
from experiments.measured.microbench_targets import Target, reference_targets
from libra.data.windows import gbs_windows

WORKLOADS = Path(__file__).resolve().parents[1] / "workloads"


def _cfg(seq_len: int, block: int, workload: str, **over) -> mb.MicrobenchConfig:
    args = dict(dp=2, cp=1, seq_len=seq_len, gbs=2, tap=replace(mb.DEFAULT_TAP, block_size=block, head_split=2),
                q_heads=8, kv_heads=2, head_dim=64, dtype="fp32", device="cpu", backend="auto", comm="p2p",
                methods="ulysses,libra", windows=1, workload=workload, seed=0, repeats=3, warmup=1, backward=True,
                timeout=60.0)
    return mb.MicrobenchConfig(**{**args, **over})


def _targets(cfg: mb.MicrobenchConfig) -> list[Target]:
    wins = gbs_windows(cfg.workload, cfg.seq_len, cfg.gbs, cfg.windows, seed=cfg.seed)
    return reference_targets(cfg, wins)


@pytest.mark.parametrize(("seq_len", "block", "name", "column", "bound"), [
    (8192, 1024, "skewed-8k.txt", "ideal_ratio", 1.08),
    (16384, 2048, "skewed-16k.txt", "ideal_ratio", 1.05),
    (8192, 1024, "uniform-1024.txt", "cpu_vs_ulysses", 1.03),
])
def test_reference_cases_carry_their_target(seq_len, block, name, column, bound):
    [t] = _targets(_cfg(seq_len, block, str(WORKLOADS / name)))
    assert (t.method, t.column, t.bound) == ("libra", column, bound)


@pytest.mark.parametrize("over", [{"head_dim": 32}, {"dtype": "bf16"}, {"backward": False},
                                  {"tap": replace(mb.DEFAULT_TAP, block_size=1024, head_split=2, pipeline_chunks=1)}])
def test_other_layouts_get_no_target(over):
    assert _targets(_cfg(8192, 1024, str(WORKLOADS / "skewed-8k.txt"), **over)) == []


def test_other_lengths_get_no_target():
    assert _targets(_cfg(8192, 1024, str(WORKLOADS / "skewed-16k.txt"))) == []  # a 16K sample does not fit 8K
    assert _targets(_cfg(8192, 1024, "libra-prod")) == []
    assert _targets(_cfg(16384, 2048, str(WORKLOADS / "uniform-1024.txt"))) == []  # uniform: S = 8K only


def test_verdicts():
    t = Target("libra", "ideal_ratio", 1.08, "case")
    summary = pd.DataFrame({"method": ["ulysses", "libra"], "ideal_ratio": [1.7, 1.07]})
    assert "libra ideal_ratio 1.070 <= 1.08 (met;" in t.line(summary)
    summary.loc[1, "ideal_ratio"] = 1.2
    assert "(NOT met;" in t.line(summary) and "median of >= 3 runs" in t.line(summary)
    assert t.line(summary[summary["method"] == "ulysses"]) is None  # libra not measured
    assert Target("libra", "cpu_vs_ulysses", 1.03, "case").line(summary) is None  # no such column


@pytest.mark.slow
def test_microbench_prints_and_records_its_targets(tmp_path, monkeypatch):
    """The wiring, on a quick run made to carry a target (a reference case takes minutes)."""
    import json  # noqa: PLC0415

    from click.testing import CliRunner  # noqa: PLC0415

    from experiments.cli import main  # noqa: PLC0415

    seen = []

    def targets(cfg, windows):
        seen.append((cfg.seq_len, len(windows)))
        return [Target("libra", "cpu_vs_ulysses", 99.0, "a quick run")]

    monkeypatch.setattr(mb, "reference_targets", targets)
    res = CliRunner().invoke(main, ["microbench", "--quick", "--nproc", "2", "--dp", "2", "--cp", "1", "--methods",
                                    "ulysses,libra", "--oversubscribe", "--no-progress", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert seen == [(1024, 1)]
    assert "target (a quick run): libra cpu_vs_ulysses" in res.output and "<= 99.0 (met;" in res.output
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["targets"] == [{"method": "libra", "column": "cpu_vs_ulysses", "bound": 99.0, "case": "a quick run"}]
