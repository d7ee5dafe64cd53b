"""`libra-bench fit-links`: writes a loadable profile whose fitted link reproduces the target share."""

import json

import pytest
from click.testing import CliRunner

from experiments.cli import main
from libra.sim.profiles import load_profile


@pytest.mark.slow
def test_fit_writes_a_profile_that_hits_the_target(tmp_path):
    out = tmp_path / "p.json"
    res = CliRunner().invoke(main, ["fit-links", "--windows", "1", "--target", "0.5", "--name", "test-fit",
                                    "--out-profile", str(out), "--out", str(tmp_path / "log")])
    assert res.exit_code == 0, res.output
    prof = load_profile(out)
    base = load_profile("h100-roce-v1")
    assert prof.name == "test-fit"
    assert prof.links["inter_supernode"].bandwidth_gbps < base.links["inter_supernode"].bandwidth_gbps
    assert prof.links["roce"] == base.links["roce"] and prof.kernel == base.kernel
    log = json.loads((tmp_path / "log" / "fit_log.json").read_text())
    assert abs(log["metric_at_stored"] - 0.5) < 0.01
    assert "FITTED" in prof.source["inter_supernode_fit"]


def test_bad_input_is_a_usage_error(tmp_path):
    for args, msg in ((["--setting", "2m"], "unknown setting"), (["--link", "pcie"], "no link class"),
                      (["--pool-size", "3"], "must divide DP"), (["--target", "-1"], "must be > 0")):
        res = CliRunner().invoke(main, ["fit-links", "--windows", "1", "--out-profile", str(tmp_path / "x.json"),
                                        "--out", str(tmp_path), *args])
        assert res.exit_code != 0 and msg in res.output, (args, res.output)


def _fake_fit(fit):
    base, name, link, target, windows = fit.base_profile, fit.name, fit.link, fit.target, fit.windows
    data = load_profile(base).to_dict()
    data["name"] = name
    data["links"][link]["bandwidth_gbps"] = round(10.0 * target + windows, 2)  # depends on the options
    return data, {"base": base, f"metric_at_{base}": 0.1, "fit": {"bandwidth_gbps": 1.0},
                  "stored_bandwidth_gbps": 1.0, "metric_at_stored": target}


def test_an_ad_hoc_fit_never_replaces_the_committed_profile(tmp_path, monkeypatch):
    # `fit-links --quick` wrote its one-window fit over libra/sim/profiles/paper-inferred-v1.json,
    # which every paper-inferred result was computed with
    import experiments.figures.fit_links as fl
    from libra.sim.profiles import PROFILE_DIR

    committed = (PROFILE_DIR / "paper-inferred-v1.json").read_text()
    monkeypatch.setattr(fl, "fit_profile", _fake_fit)
    monkeypatch.chdir(tmp_path)
    for args in (["--quick"], ["--target", "0.5"], ["--windows", "2"], ["--quick"]):
        res = CliRunner().invoke(main, ["fit-links", *args])
        assert res.exit_code == 0, (args, res.output)
        assert "runs/fit-links/paper-inferred-v1-" in res.output  # keyed by the options: one folder per fit
        assert (PROFILE_DIR / "paper-inferred-v1.json").read_text() == committed
    folders = sorted((tmp_path / "runs/fit-links").iterdir())
    assert len(folders) == 3 and all((f / "fit_log.json").is_file() and (f / "paper-inferred-v1.json").is_file()
                                     for f in folders)
    assert not (tmp_path / "results").exists()
    assert fl.default_paths(fl.PAPER_FIT, quick=False)[0] == PROFILE_DIR / "paper-inferred-v1.json"  # make paper-inferred


def test_a_profile_file_holding_another_fit_is_replaced_only_with_overwrite(tmp_path, monkeypatch):
    import experiments.figures.fit_links as fl

    monkeypatch.setattr(fl, "fit_profile", _fake_fit)
    out = tmp_path / "mine.json"
    args = ["fit-links", "--name", "mine", "--out-profile", str(out), "--out", str(tmp_path / "log")]
    assert CliRunner().invoke(main, args + ["--target", "0.5"]).exit_code == 0
    first = out.read_text()
    assert CliRunner().invoke(main, args + ["--target", "0.5"]).exit_code == 0  # the same fit again: fine
    res = CliRunner().invoke(main, args + ["--target", "0.6"])
    assert res.exit_code == 2 and "holds another profile; pass --overwrite" in res.output, res.output
    assert out.read_text() == first
    assert CliRunner().invoke(main, args + ["--target", "0.6", "--overwrite"]).exit_code == 0
    assert load_profile(out).links["inter_supernode"].bandwidth_gbps == 10.0


@pytest.mark.parametrize("name", ["x/../../../escaped", "..", ".hidden", "a\\b", ""])
def test_a_name_that_is_a_path_is_refused(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["fit-links", "--quick", "--name", name])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "--name" in res.output and "not a plain name" in res.output
    assert list(tmp_path.iterdir()) == []
