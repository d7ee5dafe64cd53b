"""Printed summary tables (experiments.common.sim_common.format_table)."""

import numpy as np
import pandas as pd

from experiments.common.sim_common import format_table


def test_paper_columns_without_a_value_are_not_printed():
    df = pd.DataFrame({"setting": ["dp8-cp2", "dp8-cp2"], "total": [1.0, 2.0], "paper_comm": [np.nan, np.nan],
                       "paper_compute": [np.nan, 0.5], "other": [np.nan, np.nan]})
    text = format_table(df, ["setting", "total", "paper_comm", "paper_compute", "other"])
    header = text.splitlines()[0].split()
    # the paper had no number for this layout: no all-nan column; a paper column with a value stays,
    # and a measured column stays even when empty (that is a result, not a missing reference)
    assert header == ["setting", "total", "paper_compute", "other"]
    assert "0.500" in text and "nan" in text.splitlines()[1]
