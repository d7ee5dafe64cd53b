"""`--workload PATH#COLUMN` names the length column of a multi-column file."""

import numpy as np
import pytest

from libra.data.source import resolve_workload


def _csv(tmp_path):
    path = tmp_path / "docs.csv"
    path.write_text("doc,num_tokens,other\na,10,1\nb,20,2\nc,30,3\n")
    return path


def test_hash_suffix_selects_the_column(tmp_path):
    path = _csv(tmp_path)
    src = resolve_workload(f"{path}#num_tokens")
    assert np.array_equal(np.sort(src.lengths), [10, 20, 30])


def test_multi_column_file_without_column_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="PATH#COLUMN"):
        resolve_workload(str(_csv(tmp_path))).lengths  # noqa: B018 (loading may be lazy)


def test_unknown_column_names_the_columns(tmp_path):
    with pytest.raises(ValueError, match="no column 'tokens'"):
        resolve_workload(f"{_csv(tmp_path)}#tokens").lengths  # noqa: B018


def test_empty_column_after_hash(tmp_path):
    with pytest.raises(ValueError, match="empty column"):
        resolve_workload(f"{_csv(tmp_path)}#")
