"""`libra-bench report`: numbers flow from result CSVs to REPRODUCTION.md; missing rows say "not run"."""

import json

import pandas as pd
import pytest
from click.testing import CliRunner

from experiments.cli import main
from experiments.common.report import discover, generate, verdict

PROFILE = {"name": "h100-roce-v2", "description": "public-fact defaults, not a measurement"}


def write_run(folder, experiment, config, csv_name, df, sha="0123456789abcdef", profile=PROFILE):
    folder.mkdir(parents=True, exist_ok=True)
    df.to_csv(folder / f"{csv_name}.csv", index=False)
    record = {"experiment": experiment, "config": config, "finished_utc": "2026-01-01T00:00:00+00:00",
              "environment": {"git_sha": sha, "cpu_count": 2}}
    if profile is not None:
        record["profile"] = profile
    (folder / "run.json").write_text(json.dumps(record))


def straggler_fixture(folder):
    """256K: Ulysses 300 ms every step, WLB-LLM 200, DistCA 150, TAP 140/180, TAP+VRSP 120, Libra 100."""
    ms = {"ulysses": (300.0, 300.0), "wlb-llm": (150.0, 250.0), "distca-paper": (150.0, 150.0),
          "libra-tap": (140.0, 180.0), "libra-tap-vrsp": (120.0, 120.0), "libra": (100.0, 100.0)}
    rows = [{"workload": "libra-prod", "setting": "256k", "method": m, "window": 0, "step": k,
             "straggler_ms": v[k], "compute_ms": v[k], "comm_exposed_ms": 0.0, "balance_bound_ms": 50.0,
             "bound_ratio": v[k] / 50.0} for m, v in ms.items() for k in (0, 1)]
    cfg = {"workload": "libra-prod", "windows": 1, "wlb_rejoin": "none", "profile": PROFILE,
           "settings": [{"name": "256k", "dp": 32, "cp": 8}]}
    write_run(folder, "straggler", cfg, "straggler", pd.DataFrame(rows), sha="abcdef0123456789-dirty")


def test_numbers_flow_from_csv_to_markdown(tmp_path):
    root = tmp_path / "results"
    straggler_fixture(root / "somewhere" / "renamed")  # discovery goes by run.json, not the folder name
    lln = pd.DataFrame([{"workload": "libra-prod", "seq_len": 262144, "gbs": 128, "strategy": "production",
                         "pool_size": p, "window": w, "r_minus_1": v, "r_minus_1_lower_bound": 0.0}
                        for p, vals in ((8, (1.2, 1.268)), (64, (0.1, 0.12))) for w, v in enumerate(vals)])
    write_run(root / "fig4" / "256k", "lln", {"workload": {"kind": "preset", "name": "libra-prod"},
                                               "seq_len": 262144, "gbs": 128, "windows": 2}, "lln", lln, profile=None)
    grid = pd.DataFrame([{"setting": "256k", "method": m, "block_size": b, "head_split": h, "window": 0, "step": 0,
                          "straggler_ms": v} for m, b, h, v in (("ulysses", 0, 0, 200.0),
                                                               ("libra-tap-vrsp", 8192, 4, 100.0),
                                                               ("libra-tap-vrsp", 2048, 1, 160.0))])
    write_run(root / "grid", "grid-search", {"workload": "libra-prod", "windows": 16, "profile": PROFILE},
              "grid-search", grid)
    bench = {"machine_info": {}, "commit_info": {"id": "feedbeef00"}, "datetime": "2026-01-01T00:00:00",
             "benchmarks": [{"name": "test_vrsp_p8[128]", "stats": {"median": 5.0e-5}},
                            {"name": "test_vrsp_p8[256]", "stats": {"median": 1.2e-4}}]}
    (root / "bench").mkdir()
    (root / "bench" / "vrsp.json").write_text(json.dumps(bench))
    # a point cache and a broken record must not break discovery
    (root / "grid" / ".points" / "x").mkdir(parents=True)
    (root / "grid" / ".points" / "x" / "run.json").write_text("{not json")
    (root / "broken").mkdir()
    (root / "broken" / "run.json").write_text("{not json")

    out = tmp_path / "REPRODUCTION.md"
    r = CliRunner().invoke(main, ["report", "--results", str(root), "--out", str(out)])
    assert r.exit_code == 0, r.output
    md = out.read_text()
    lines = {ln.split("|")[1].strip() + "/" + ln.split("|")[2].strip() + "/" + ln.split("|")[3].strip()[:12]: ln
             for ln in md.splitlines() if ln.startswith("| ") and ln.count("|") > 6}
    row = next(v for k, v in lines.items() if k.startswith("Fig. 12/256K/Libra mean-s"))
    assert "3.00x; worst step 3.00x" in row  # 300 / 100 from the CSV
    assert "(h100-roce-v2, abcdef0-dirty)" in row and "results/somewhere/renamed" in row
    assert "agrees (ratios within 15%)" in row  # 3.00 vs 2.91 and 3.00 vs 3.14
    wlb = next(v for k, v in lines.items() if k.startswith("Fig. 12/256K/Libra vs WLB"))
    assert "mean -50.0%, max -60.0%" in wlb  # 1 - 100/200, 1 - 100/250
    assert "WLB max -16.7% vs Ulysses" in wlb and "rejoin=none" in wlb
    abl = next(v for k, v in lines.items() if k.startswith("Fig. 12/256K/VRSP trims"))
    assert "VRSP 33.3%; Pipeliner 16.7%" in abl  # 1 - 120/180, 1 - 100/120
    fig4 = next(v for k, v in lines.items() if k.startswith("Fig. 4/256K"))
    assert "P=8: 1.23; P=64: 0.11" in fig4 and "synthetic libra-prod stands in" in fig4
    fig16 = next(v for k, v in lines.items() if k.startswith("Fig. 16/256K"))
    assert "H=4,B=8192: 2.00x; H=1,B=2048: 1.25x; H=1,B=16384: nan" in fig16
    assert "profile h100-roce-v2 is public-fact based" in fig16
    assert "50 us (D=128), 120 us (D=256)" in md and "pytest-benchmark, feedbee" in md
    # rows without results say so, with the command that produces them
    fig13 = next(v for k, v in lines.items() if k.startswith("Fig. 13/1M"))
    assert "not run: `libra-bench dp-scaling" in fig13
    one_m = next(v for k, v in lines.items() if k.startswith("Fig. 12/1M/Libra mean-s"))
    assert "not run: `libra-bench straggler" in one_m
    assert "Unreadable run records" in md and "broken" in md and ".points" not in md
    # deterministic: the same results give the same bytes
    out2 = tmp_path / "again.md"
    generate(root, out2)
    assert out2.read_text() == md


def test_report_on_a_real_grid_search_run(tmp_path):
    root = tmp_path / "results"
    g = CliRunner().invoke(main, ["grid-search", "--quick", "--no-progress", "--setting", "256k", "--head-splits",
                                 "4", "--block-sizes", "8192", "--out", str(root / "fig16")])
    assert g.exit_code == 0, g.output
    speedup = pd.read_csv(root / "fig16" / "grid-search_summary.csv")["speedup"].iloc[0]
    out = tmp_path / "R.md"
    r = CliRunner().invoke(main, ["report", "--results", str(root), "--out", str(out)])
    assert r.exit_code == 0, r.output
    md = out.read_text()
    assert f"H=4,B=8192: {speedup:.2f}x" in md
    assert "only 1 window(s)" in md
    assert md.count("not run:") >= 20  # everything else is missing
    assert "rows computed" in r.output and "not run" in r.output


def test_report_bad_results_folder(tmp_path):
    r = CliRunner().invoke(main, ["report", "--results", str(tmp_path / "nope"), "--out", str(tmp_path / "x.md")])
    assert r.exit_code != 0 and "does not exist" in r.output
    with pytest.raises(ValueError, match="nope"):
        discover(tmp_path / "nope")


def test_report_csv_missing_is_a_clear_error(tmp_path):
    root = tmp_path / "results"
    (root / "x").mkdir(parents=True)
    (root / "x" / "run.json").write_text(json.dumps({"experiment": "dp-scaling", "config": {}}))
    with pytest.raises(ValueError, match="dp-scaling.csv is missing"):
        generate(root, tmp_path / "r.md")


def test_verdict_rules():
    assert verdict([(1.0, 1.1, "rel")]).startswith("agrees")
    assert verdict([(2.0, 1.0, "rel")]) == "differs (ratios up to 100% off)"
    assert verdict([(0.30, 0.10, "abs")]) == "differs (fractions up to 0.20 off)"
    assert verdict([(0.01, 0.007, "below")]).startswith("differs (0.01 above the bound")
    assert verdict([(0.005, 0.007, "below")]) == "agrees (within the bound)"
    assert verdict([(float("nan"), 1.0, "rel")]) == "no comparable number"


def test_runs_with_another_profile_go_to_a_sensitivity_table(tmp_path):
    """A sensitivity run (other profile, finished later) never replaces the default-profile source."""
    straggler_fixture(tmp_path / "default")
    straggler_fixture(tmp_path / "other")
    other = {"name": "paper-inferred-v1", "description": "PAPER-INFERRED, not public facts"}
    record = json.loads((tmp_path / "other" / "run.json").read_text())
    record.update(profile=other, finished_utc="2026-02-01T00:00:00+00:00")
    record["config"]["profile"] = other
    (tmp_path / "other" / "run.json").write_text(json.dumps(record))
    path, _rows = generate(tmp_path, tmp_path / "R.md")
    main_part, _, extra = path.read_text().partition("## Profile sensitivity: `paper-inferred-v1`")
    assert extra, "no sensitivity section"
    main_rows = [line for line in main_part.splitlines() if line.startswith("| Fig. 12")]
    assert main_rows and all("/default`" in line or "not run" in line for line in main_rows)
    assert any("/default`" in line for line in main_rows)
    assert "/other`" in extra and "partly fitted to the paper" in extra


def test_an_ad_hoc_report_never_replaces_the_committed_one(tmp_path, monkeypatch):
    # `report --results runs` (a user's own runs) wrote over results/REPRODUCTION.md by default
    from experiments.common.report import default_report_path

    assert default_report_path("results", "h100-roce-v2").as_posix() == "results/REPRODUCTION.md"
    assert default_report_path("runs", "h100-roce-v2").as_posix() == "runs/report/runs-h100-roce-v2/REPRODUCTION.md"
    assert default_report_path("results", "paper-inferred-v1").parts[:2] == ("runs", "report")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    r = CliRunner().invoke(main, ["report", "--results", "runs"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "runs/report/runs-h100-roce-v2/REPRODUCTION.md").is_file()
    assert not (tmp_path / "results").exists()


def _calibrate_run(folder, heads_keep, length_keep, device="cuda"):
    """A calibrate record: heads curve kept fraction per heads, length curve per block length."""
    rows = [{"sweep": "heads", "pass": p, "length": 16384, "documents": 4, "heads": h, "normalized": v}
            for p in ("fwd", "bwd") for h, v in heads_keep.items()]
    rows += [{"sweep": "length", "pass": p, "length": L, "documents": 1, "heads": 32, "normalized": v}
             for p in ("fwd", "bwd") for L, v in length_keep.items()]
    write_run(folder, "calibrate", {"device": device, "backend": "aten-flash", "dtype": "bf16", "q_heads": 32,
                                    "heads_length": 16384}, "calibrate", pd.DataFrame(rows),
              profile={"name": "nvidia-h200-aten-flash-measured"})


def test_fig5_row_compares_fewer_heads_with_shorter_blocks(tmp_path):
    from experiments.common.report import discover, rows_fig5

    _calibrate_run(tmp_path / "gpu" / "calibrate", {8: 0.99, 32: 1.0}, {4096: 0.77, 16384: 1.0, 65536: 1.0})
    row = rows_fig5(discover(tmp_path)[0])[0]
    assert "8 of 32 heads per call keep 0.99" in row.ours and "a 4096-token block keeps 0.77" in row.ours
    assert verdict(row.pairs).startswith("agrees")
    _calibrate_run(tmp_path / "gpu2" / "calibrate", {8: 0.5, 32: 1.0}, {4096: 0.77, 16384: 1.0})
    src = discover(tmp_path / "gpu2")[0]
    assert verdict(rows_fig5(src)[0].pairs).startswith("differs")
    # the record's measured profile is an output: the row is in the main table, not a sensitivity one
    out, rows = generate(tmp_path, tmp_path / "R.md")
    assert any(r.key == "fig5" and r.source is not None for r in rows)


def test_sec67_row_takes_the_backend_the_gpu_run_used_and_lists_the_others(tmp_path):
    from experiments.common.report import rows_sec67

    def fid(folder, backend, ratio):
        df = pd.DataFrame([{"quantity": q, "ratio": ratio, "passed": True} for q in ("out", "dq", "dk", "dv")])
        write_run(folder, "fidelity", {"device": "cuda", "backend": backend, "dtype": "bf16"}, "fidelity", df,
                  profile=None)

    fid(tmp_path / "gpu" / "fidelity", "aten-flash", 0.7)
    fid(tmp_path / "gpu" / "fidelity-torch-varlen", "torch-varlen", 0.9)  # same finish time, later label
    row = rows_sec67(discover(tmp_path)[0])[0]
    assert row.setting == "cuda aten-flash bf16" and "torch-varlen: fwd 0.90" in row.ours
