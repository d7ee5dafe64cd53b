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
    assert "step 0: loss" in run.stdout and "step 1: loss" in run.stdout  # each step as it finishes
    last = run.stdout.rstrip("\n").splitlines()[-1]
    m = re.fullmatch(r"loss_rel_err=(\S+) grad_rel_err=(\S+)", last)
    assert m, run.stdout[-4000:]
    assert float(m.group(1)) < 1e-9 and float(m.group(2)) < 1e-9, last


@pytest.mark.slow
def test_the_example_says_what_it_is_doing_while_nothing_finishes(capsys):
    import importlib.util  # noqa: PLC0415
    import time  # noqa: PLC0415

    spec = importlib.util.spec_from_file_location("hf_qwen3_example", ROOT / "examples" / "hf_qwen3.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with example.Heartbeat(steps=2, every_s=0.5) as beat:
        time.sleep(1.8)  # the ranks start
        beat.step({"step": 0, "loss": 5.5})
        beat.phase = "the single-process reference"
        time.sleep(1.8)
    out, err = capsys.readouterr()
    assert "step 0: loss 5.500000" in out
    beats = err.splitlines()
    assert beats[0].startswith("hf_qwen3: starting the ranks; 0 of 2 steps done")
    assert any(b.startswith("hf_qwen3: the single-process reference; 1 of 2 steps done") for b in beats), beats
