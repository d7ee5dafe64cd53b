"""The paper's Figure 12 numbers appear only beside runs they describe."""

import numpy as np
import pandas as pd

from experiments.common.paper import paper_settings
from experiments.common.sim_common import SETTINGS, make_shape, with_tap
from experiments.figures.straggler import summarize

SHAPE = make_shape(32, 4, 128)


def test_paper_settings_need_the_paper_workload_layout_and_shape():
    chosen = {"256k": SETTINGS["256k"], "1m": with_tap(SETTINGS["1m"], block_size=4096)}
    assert paper_settings("libra-prod", chosen, SHAPE) == {"256k"}
    assert paper_settings("wiki.txt.gz", chosen, SHAPE) == set()
    assert paper_settings("libra-prod", chosen, make_shape(16, 4, 128)) == set()


def test_summary_has_paper_columns_only_where_comparable():
    df = pd.read_csv("results/straggler/straggler.csv")
    assert "paper_mean_speedup" not in summarize(df, set())
    some = summarize(df, {"256k"})
    assert some.loc[some["setting"] == "256k", "paper_mean_speedup"].notna().any()
    assert some.loc[some["setting"] == "1m", "paper_mean_speedup"].isna().all()
    assert np.isfinite(summarize(df)["paper_mean_speedup"]).any()  # default: every paper setting
