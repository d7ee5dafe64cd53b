"""`libra-bench fit-links`: writes a loadable profile whose fitted link reproduces the target share."""

import json

from click.testing import CliRunner

from experiments.cli import main
from libra.sim.profiles import load_profile


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
