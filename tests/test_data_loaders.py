"""Length-file loaders and workload resolution (libra/data/loaders.py, libra/data/source.py)."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pandas as pd
import pytest

from libra.data.loaders import load_lengths
from libra.data.source import FileSource, PresetSource, resolve_workload

LENGTHS = [5, 300, 7, 1, 42]


@pytest.fixture
def files(tmp_path):
    out = {}
    (tmp_path / "a.txt").write_text("\n".join(map(str, LENGTHS)) + "\n\n")
    out["txt"] = tmp_path / "a.txt"
    with gzip.open(tmp_path / "a.txt.gz", "wt") as fh:
        fh.write("\n".join(map(str, LENGTHS)) + "\n")
    out["txt.gz"] = tmp_path / "a.txt.gz"
    (tmp_path / "a.json").write_text(json.dumps(LENGTHS))
    out["json"] = tmp_path / "a.json"
    pd.DataFrame({"doc": range(5), "tokens": LENGTHS}).to_csv(tmp_path / "a.csv", index=False)
    out["csv"] = tmp_path / "a.csv"
    pd.DataFrame({"length": LENGTHS}).to_csv(tmp_path / "b.csv.gz", index=False)
    out["csv.gz"] = tmp_path / "b.csv.gz"
    pd.DataFrame({"length": LENGTHS}).to_parquet(tmp_path / "a.parquet")
    out["parquet"] = tmp_path / "a.parquet"
    np.save(tmp_path / "a.npy", np.array(LENGTHS, dtype=np.int32))
    out["npy"] = tmp_path / "a.npy"
    # what datasets.Dataset.to_json writes: one object per line; the length under its only key
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"num_tokens": n}) + "\n" for n in LENGTHS) + "\n")
    out["jsonl"] = tmp_path / "a.jsonl"
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as fh:
        fh.write("".join(f"{n}\n" for n in LENGTHS))
    out["jsonl.gz"] = tmp_path / "a.jsonl.gz"
    return out


@pytest.mark.parametrize("kind", ["txt", "txt.gz", "json", "jsonl", "jsonl.gz", "csv", "csv.gz", "parquet", "npy"])
def test_every_format_round_trips(files, kind):
    column = "tokens" if kind == "csv" else None
    got = load_lengths(files[kind], column=column)
    assert got.dtype == np.int64 and got.tolist() == LENGTHS


@pytest.mark.parametrize("lines, column, match", [
    ('{"id": 1, "length": 5}\n{"id": 2, "length": 0}\n', None, r"line 2: sample length must be a positive integer, got 0"),
    ('{"id": 1, "n": 5}\n', None, r"several columns \['id', 'n'\]; name the length column"),
    ('{"n": 5}\n{"m": 6}\n', None, r"line 2: no key 'n'"),
    ('{"n": 5}\n\n{"n": "7"}\n', "n", r"line 3: .* got '7'"),
    ('5\n{"n": 6\n', None, r"line 2: not valid JSON"),
])
def test_jsonl_bad_values_name_the_line(tmp_path, lines, column, match):
    path = tmp_path / "b.jsonl"
    path.write_text(lines)
    with pytest.raises(ValueError, match=match):
        load_lengths(path, column=column)
    path.write_text('{"id": 1, "n": 5}\n{"id": 2, "n": 9}\n')
    assert load_lengths(path, column="n").tolist() == [5, 9]  # or PATH#n on the command line


def test_json_objects_with_column(tmp_path):
    path = tmp_path / "o.json"
    path.write_text(json.dumps([{"n": 3}, {"n": 4}]))
    assert load_lengths(path, column="n").tolist() == [3, 4]
    path.write_text(json.dumps({"lengths": [9, 8]}))
    assert load_lengths(path).tolist() == [9, 8]


@pytest.mark.parametrize("content, match", [
    ("5\n0\n7\n", r"line 2: sample length must be a positive integer, got 0"),
    ("5\n7\n-3\n", r"line 3: .* got -3"),
    ("5\n2.5\n", r"line 2: .* got '2.5'"),
    ("5\nabc\n", r"line 2: .* got 'abc'"),
    ("5\n6 7\n", r"line 2: .* got '6 7'"),
])
def test_txt_bad_values_name_file_and_line(tmp_path, content, match):
    path = tmp_path / "bad.txt"
    path.write_text(content)
    with pytest.raises(ValueError, match=match) as info:
        load_lengths(path)
    assert "bad.txt" in str(info.value)


def test_json_bad_values_name_index(tmp_path):
    path = tmp_path / "bad.json"
    for data, match in [([3, 0], "index 1: .* got 0"), ([3, 1.5], "index 1: .* got 1.5"),
                        ([3, "4"], "index 1: .* got '4'"), ([True], "index 0"), ({"x": 1}, "no key 'lengths'"),
                        (7, "expected a JSON list")]:
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=match):
            load_lengths(path)


def test_csv_bad_values_name_row(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("length\n4\n5\n-1\n")
    with pytest.raises(ValueError, match=r"bad.csv: row 3 of column 'length': .* got -1"):
        load_lengths(path)
    path.write_text("length\n4\nfoo\n")
    with pytest.raises(ValueError, match=r"row 2 of column 'length'.*'foo'"):
        load_lengths(path)
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="several columns"):
        load_lengths(path)
    with pytest.raises(ValueError, match="no column 'zzz'"):
        load_lengths(path, column="zzz")


def test_npy_bad(tmp_path):
    np.save(tmp_path / "b.npy", np.array([[1, 2]]))
    with pytest.raises(ValueError, match="1-D"):
        load_lengths(tmp_path / "b.npy")
    np.save(tmp_path / "c.npy", np.array([4, 0]))
    with pytest.raises(ValueError, match="c.npy: index 1"):
        load_lengths(tmp_path / "c.npy")


def test_empty_npy(tmp_path):
    # the only format whose emptiness reaches the shared value check (the others fail while parsing)
    np.save(tmp_path / "e.npy", np.array([], dtype=np.int64))
    with pytest.raises(ValueError, match="e.npy: no sample lengths found"):
        load_lengths(tmp_path / "e.npy")


@pytest.mark.parametrize("name, content", [("e.txt", ""), ("e2.txt", "\n\n"), ("e.json", "[]"), ("e.csv", ""),
                                           ("e3.json", ""), ("e.jsonl", "\n\n")])
def test_empty_files(tmp_path, name, content):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match="empty"):
        load_lengths(tmp_path / name)


def test_unknown_type_and_missing_file(tmp_path):
    (tmp_path / "x.xlsx").write_text("1")
    with pytest.raises(ValueError, match="unknown length-file type"):
        load_lengths(tmp_path / "x.xlsx")
    with pytest.raises(ValueError, match="no such length file"):
        load_lengths(tmp_path / "missing.txt")


def test_resolve_workload(files, tmp_path):
    assert isinstance(resolve_workload("libra-prod"), PresetSource)
    src = resolve_workload(str(files["json"]))
    assert isinstance(src, FileSource) and src.name == "a.json"
    assert resolve_workload(src) is src
    with pytest.raises(ValueError, match=r"unknown workload 'libra-prd'.*libra-prod"):
        resolve_workload("libra-prd")
    (tmp_path / "x.xlsx").write_text("1")
    with pytest.raises(ValueError, match="unknown type"):
        resolve_workload(str(tmp_path / "x.xlsx"))
    with pytest.raises(ValueError, match="does not exist"):
        resolve_workload(str(tmp_path / "nope.txt"))
    with pytest.raises(ValueError, match="preset name or a length-file path"):
        resolve_workload(3)


def test_file_source_offsets_and_cycling(files):
    src = resolve_workload(str(files["txt"]))
    assert src.take(1, seed=0).tolist() == [5]
    # more tokens than the file holds: cycles from the start
    stream = src.take(2 * sum(LENGTHS) + 1, seed=0)
    assert stream.tolist() == LENGTHS * 2 + [5]
    assert src.take(400, seed=7).tolist() == src.take(400, seed=7).tolist()
    starts = {int(src.take(1, seed=s)[0]) for s in range(1, 30)}
    assert len(starts) > 1  # different seeds start at different offsets
    with pytest.raises(ValueError, match="n_tokens"):
        src.take(0)
    with pytest.raises(ValueError, match="seed"):
        src.take(5, seed=-1)


def test_public_files_load(workloads_dir):
    wiki = resolve_workload(str(workloads_dir / "flexsp_wikipedia.txt.gz"))
    assert wiki.lengths.size == 1_000_000 and int(wiki.lengths.sum()) == 1_013_648_780
    prolong = load_lengths(workloads_dir / "distca_dist_prolong.json")
    assert prolong.size == 77_932 and np.median(prolong) == 1913.5


# -- lengths out of range and unreadable files: one ValueError naming the file, never a wrap ---------


@pytest.mark.parametrize("name, write, shown", [
    ("big.json", lambda p: p.write_text("[1e19, 5]"), "length 1e+19 at index 0"),
    ("huge.txt", lambda p: p.write_text("100\n99999999999999999999999\n"), "length 99999999999999999999999 at line 2"),
    ("u64.npy", lambda p: np.save(p, np.array([7, 2**63 + 5], dtype=np.uint64)), "length 9223372036854775813 at index 1"),
    ("f.npy", lambda p: np.save(p, np.array([3.0, 1e19])), "length 1e+19 at index 1"),
    ("ten.txt", lambda p: p.write_text("\n".join(["1000000000000000000"] * 10)), "at line 1"),
    ("over.csv", lambda p: p.write_text("length\n5\n18446744073709551615\n"), "at row 2 of column 'length'"),
    ("edge.jsonl", lambda p: p.write_text(f"{2**40}\n{2**40 + 1}\n"), f"length {2**40 + 1} at line 2"),
])
def test_a_length_above_2_40_is_out_of_range(tmp_path, name, write, shown):
    write(tmp_path / name)
    with pytest.raises(ValueError, match="out of range") as info:
        load_lengths(tmp_path / name)
    assert str(info.value).startswith(f"{tmp_path / name}: length ") and shown in str(info.value)


def test_lengths_up_to_2_40_load_and_a_total_of_2_62_is_refused(tmp_path):
    (tmp_path / "ok.txt").write_text(f"{2**40}\n1\n")
    assert load_lengths(tmp_path / "ok.txt").tolist() == [2**40, 1]
    np.save(tmp_path / "sum.npy", np.full(2**22, 2**40, dtype=np.int64))  # each in range, total 2^62
    with pytest.raises(ValueError, match=r"sum.npy: length total 4.612e\+18 of 4194304 samples out of range"):
        load_lengths(tmp_path / "sum.npy")


@pytest.mark.parametrize("name, write, match", [
    ("cut.txt.gz", lambda p: p.write_bytes(gzip.compress(b"12\n" * 5000)[:40]), "truncated compressed file"),
    ("plain.txt.gz", lambda p: p.write_text("12\n13\n"), "not a gzip file"),
    ("bin.txt", lambda p: p.write_bytes(b"\xff\xfe\x00\x01abc"), r"not UTF-8 text \(byte ff at offset 0\)"),
    ("cut.csv.gz", lambda p: p.write_bytes(gzip.compress(b"length\n" + b"12\n" * 5000)[:40]), "truncated"),
    ("bad.parquet", lambda p: p.write_text("not parquet"), "not a readable Parquet file"),
])
def test_unreadable_files_name_the_file(tmp_path, name, write, match):
    write(tmp_path / name)
    with pytest.raises(ValueError, match=match) as info:
        load_lengths(tmp_path / name)
    assert str(info.value).startswith(f"{tmp_path / name}: ")


def test_a_named_column_is_part_of_the_workload_name(tmp_path):
    pd.DataFrame({"doc": [1, 2], "tokens": [5, 6]}).to_parquet(tmp_path / "t.parquet")
    assert resolve_workload(f"{tmp_path}/t.parquet#tokens").name == "t.parquet#tokens"
    np.save(tmp_path / "t.npy", np.array([5, 6]))
    assert resolve_workload(str(tmp_path / "t.npy")).name == "t.npy"


def test_cycling_a_file_of_tiny_lengths_past_the_sample_cap_is_an_error(tmp_path):
    (tmp_path / "ones.txt").write_text("1\n1\n")
    with pytest.raises(ValueError, match=r"ones.txt: .* need more than 268435456 samples"):
        resolve_workload(str(tmp_path / "ones.txt")).take(2**29)
