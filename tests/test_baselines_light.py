"""Planning stays light: the planner modules never import torch (data-loader workers plan without it)."""

import subprocess
import sys

MODULES = ["baselines.registry", "baselines.ulysses", "baselines.wlbllm", "baselines.distca", "baselines.distca_items", "baselines.distca_paper",
           "baselines.dynamic_cp", "baselines.dynamic_cp_schedule",
           "baselines.libra_planners"]


def test_planners_do_not_import_torch():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in MODULES)
            + "from baselines.registry import get_planner, PLANNERS\n"
            + "[get_planner(n) for n in PLANNERS]\n"
            + "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            + "assert not bad, bad\nprint('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
