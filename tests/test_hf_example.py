"""``examples/hf_qwen3.py`` end to end (slow: every rank JIT-compiles the numba TAP kernels).

The example's contract: its last line, on stdout and stderr together, is
``loss_rel_err=<x> grad_rel_err=<y>``, both below 1e-9 in float64.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the Hugging Face example needs the [hf] extra (pip install -e '.[hf]')")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("nproc, planner", [(2, "libra"), (4, "libra"), (4, "libra-adaptive")])
def test_example_matches_the_stock_model_and_ends_with_the_result_line(nproc, planner):
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_qwen3.py"), "--nproc", str(nproc), "--steps", "2",
                          "--planner", planner], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:]
    last = run.stdout.rstrip("\n").splitlines()[-1]
    m = re.fullmatch(r"loss_rel_err=(\S+) grad_rel_err=(\S+)", last)
    assert m, run.stdout[-4000:]
    assert float(m.group(1)) < 1e-9 and float(m.group(2)) < 1e-9, last
