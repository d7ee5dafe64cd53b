"""Every registered planner says where its algorithm comes from, and the report prints it.

A competitor without an origin would leave REPRODUCTION.md unable to say what its row runs; a
commit that drifted from the one its ``docs/methods`` page cites would say it wrongly.
"""

from pathlib import Path

import pandas as pd
import pytest

from baselines.origins import ORIGINS, competitors
from baselines.registry import PLANNERS
from experiments.common.report_competitors import LEADERS, origin_lines, section, speedup_lines

ROOT = Path(__file__).resolve().parents[1]


def test_every_registered_planner_has_an_origin():
    assert set(PLANNERS) - set(ORIGINS) == set(), "registered planners without an origin in baselines/origins.py"
    assert set(ORIGINS) - set(PLANNERS) == set(), "origins of planners that are not registered"


@pytest.mark.parametrize("origin", competitors(), ids=lambda o: o.method)
def test_a_competitor_names_what_it_was_written_from(origin):
    assert origin.algorithm and origin.reference
    assert (ROOT / origin.doc).is_file(), origin.doc
    if origin.repository is not None:
        assert origin.paths, "a repository without the paths that were read"
    if origin.commit is not None:  # the commit a methods page cites is the one the report prints
        doc = (ROOT / origin.doc).read_text()
        assert origin.commit in doc, f"{origin.doc} does not cite commit {origin.commit}"
        assert all(p.split(" (")[0] in doc for p in origin.paths), f"{origin.doc} does not cite {origin.paths}"


def test_the_distca_rows_say_how_they_relate_to_the_papers_distca_number():
    assert "what the paper ran" in ORIGINS["distca-paper"].paper_distca
    assert "not what the paper ran" in ORIGINS["distca"].paper_distca
    assert not any(o.competitor for o in ORIGINS.values() if o.method.startswith("libra"))


def test_the_origin_table_lists_every_competitor_once():
    body = origin_lines()[2:]
    assert [ln.split("|")[1].strip().strip("`") for ln in body] == [o.method for o in competitors()]
    assert "`00c51e13247685110aec81e60aa3db91cbdbff7d`" in "\n".join(body)


def test_the_speedup_table_gives_each_leaders_lead_per_step_and_per_window():
    summ = pd.DataFrame({"mean_ms": [400.0, 300.0, 100.0, 80.0], "window_ms": [1600.0, 1500.0, 400.0, 320.0]},
                        index=pd.Index(["ulysses", "dynamic-cp", "libra", "libra-adaptive"], name="method"))
    lines = speedup_lines([("libra-prod", "256K", "results/straggler", summ)])
    rows = {ln.split("|")[3].strip().strip("`"): [c.strip() for c in ln.split("|")] for ln in lines[2:]}
    assert list(rows) == ["ulysses", "dynamic-cp", *LEADERS]
    assert rows["dynamic-cp"][6:8] == ["3.00x / 3.75x", "3.75x / 4.69x"]
    assert rows["libra"][6:8] == ["-", "-"]
    assert section([])[1] == "## Competitors"
