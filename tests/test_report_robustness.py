"""The report shows how each headline speedup holds over the profile ensemble.

A tiny real ``robustness`` run (its setting relabelled 256K, its workload renamed where a corpus is
needed) feeds the "Robustness over the profile ensemble" section and the range beside the Figure 12
rows; without a run the section says ``not run`` with ``make robustness`` and the rows are unchanged.
"""

import json
import shutil

import pandas as pd
import pytest
from click.testing import CliRunner
from test_report_fig12 import make_results, rows_of

from experiments.cli import main
from experiments.common.report import generate
from experiments.common.report_robustness import ADAPTIVE_FLOOR

TINY = ["--dp", "2", "--cp", "2", "--seq-len", "16K", "--gbs", "4", "--windows", "1", "--no-progress"]
WIKIPEDIA = "../shared/workloads/flexsp_wikipedia.txt.gz"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One real robustness run of libra-prod on a tiny layout."""
    out = tmp_path_factory.mktemp("robustness") / "run"
    res = CliRunner().invoke(main, ["robustness", *TINY, "--methods", "ulysses,libra,libra-adaptive", "--out", str(out)])
    assert res.exit_code == 0, res.output
    return out


def place(run, folder, workload=None, finished=None, edit=None):
    """A copy of ``run`` at ``folder`` with its setting named 256k (the paper's), and optionally another
    workload name, finish time or summary edit."""
    shutil.copytree(run, folder)
    summary = (edit or (lambda d: d))(pd.read_csv(folder / "robustness_summary.csv").assign(setting="256k"))
    summary.to_csv(folder / "robustness_summary.csv", index=False)
    record = json.loads((folder / "run.json").read_text())
    record["config"]["workload"] = workload or record["config"]["workload"]
    record["finished_utc"] = finished or record["finished_utc"]
    (folder / "run.json").write_text(json.dumps(record))
    return summary.set_index("method")


def section_of(md: str) -> str:
    return md.split("## Robustness over the profile ensemble")[1].split("\n## ")[0]


def test_without_a_run_the_section_says_not_run_and_rows_are_unchanged(tmp_path):
    root = tmp_path / "results"
    make_results(root)
    md = generate(root, tmp_path / "R.md")[0].read_text()
    sec = section_of(md)
    for name in ("libra-prod", "wikipedia", "prolong"):
        assert f"- {name}: not run (`make robustness`)" in sec
    assert "chosen by the model that scores it" in sec
    assert "ensemble range" not in md


def test_ranges_beside_the_headline_rows_and_in_the_section(tmp_path, tiny_run):
    root = tmp_path / "results"
    make_results(root)
    prod = place(tiny_run, root / "robustness" / "libra-prod")
    wiki = place(tiny_run, root / "robustness" / "wikipedia", workload=WIKIPEDIA,
                 edit=lambda d: d.assign(speedup_min=d["speedup_min"] * 0.5))
    md = generate(root, tmp_path / "R.md")[0].read_text()
    rows = rows_of(md)

    libra = prod.loc["libra"]
    speed = rows[("Fig. 12", "256K", "Libra mean-str")]
    assert f"ensemble range [{libra['speedup_min']:.2f}x, {libra['speedup_max']:.2f}x] (`results/robustness/libra-prod`)" \
        in speed
    w = rows[("Fig. 12 (flexsp_wikipedia.txt.gz)", "256K", "Libra mean-str")]
    assert f"ensemble range [{wiki.loc['libra', 'speedup_min']:.2f}x" in w and "results/robustness/wikipedia" in w
    assert "ensemble range" not in rows[("Fig. 12", "1M", "Libra mean-str")]          # the run covers 256K only
    assert "ensemble range" not in rows[("Fig. 12 (distca_dist_prolong.json)", "256K", "Libra mean-str")]

    sec = section_of(md)
    ada = prod.loc["libra-adaptive"]
    line = next(ln for ln in sec.splitlines() if ln.startswith("| libra-prod | 256K | `libra-adaptive`"))
    assert f"| {ada['speedup']:.2f}x | [{ada['speedup_min']:.2f}, {ada['speedup_max']:.2f}] | " \
           f"`{ada['speedup_min_member']}` | [{ada['truth_speedup_min']:.2f}, {ada['truth_speedup_max']:.2f}] | " \
           f"{ada['vs_libra_min']:.3f} ({ada['vs_libra_window_min']:.3f})" in line
    assert "| libra-prod | 256K | `ulysses`" not in sec and "| wikipedia | 256K | `libra`" in sec
    met = "met" if min(ada["vs_libra_min"], ada["vs_libra_window_min"]) >= ADAPTIVE_FLOOR else "NOT met"
    assert f"- libra-prod 256K: libra-adaptive's worst ratio to libra over the ensemble {ada['vs_libra_min']:.3f}" in sec
    assert sec.count(f"target >= {ADAPTIVE_FLOOR:.2f} {met}\n") >= 1
    assert "- prolong: not run (`make robustness`)" in sec and "libra-prod: not run" not in sec
    assert "Ensemble: `default-v2`." in sec
    sources = md.split("## Sources")[1]
    assert "`results/robustness/libra-prod` | robustness | libra-prod" in sources


def test_the_latest_run_wins_and_a_miss_of_the_floor_says_not_met(tmp_path, tiny_run):
    root = tmp_path / "results"
    place(tiny_run, root / "old", finished="2000-01-01T00:00:00+00:00")
    place(tiny_run, root / "new", finished="2100-01-01T00:00:00+00:00",
          edit=lambda d: d.assign(vs_libra_window_min=0.9))
    sec = section_of(generate(root, tmp_path / "R.md")[0].read_text())
    assert "`results/new`" in sec and "`results/old`" not in sec
    assert "worst window 0.900): target >= 0.98 NOT met" in sec
