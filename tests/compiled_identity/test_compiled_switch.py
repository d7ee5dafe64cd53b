"""The one switch (:mod:`libra.jit`): which implementation an ``impl``/``placer`` choice runs.

Unknown names are ValueErrors naming the choices; ``"auto"`` runs the compiled kernels where numba
imports and the Python/numpy code where it does not; ``"numba"`` without numba is an ImportError
naming the extra; warmup compiles once per process; :func:`libra.jit.compiled` names only the
kernel modules.
"""

from __future__ import annotations

import sys

import pytest
from test_tap_strategies import placed_with

from libra import jit as kernels
from libra.config import ParallelConfig
from libra.plan import SequenceLayout
from libra.sim import cost as cost_mod
from libra.sim.cost import CostModel
from libra.sim.profiles import load_profile
from libra.sim.topology import Topology
from libra.tap import exchange, tiles
from libra.tap.exchange import build_transfers
from libra.tap.placement import available_placers, default_placer, place_tiles, warmup
from libra.tap.tiles import make_tiles
from libra.workload import AttentionShape

PROFILE = load_profile("h100-roce-v1")
UNIT = AttentionShape(1, 1, 1, 2)


def _cost_model(impl):
    return CostModel(PROFILE, Topology(PROFILE, ParallelConfig(dp=2, cp=1, gbs=2, seq_len=64)), impl=impl)


def _one_pool():
    seqs = [SequenceLayout.contiguous(0, 0, [4, 4], 2)]
    return seqs, make_tiles(seqs, 2, 1, UNIT)


@pytest.mark.parametrize("call, match", [
    (lambda: make_tiles(_one_pool()[0], 4, 1, UNIT, impl="cuda"), "impl must be"),
    (lambda: build_transfers(_one_pool()[0], placed_with(_one_pool()[1], [0, 0, 1, 1]), UNIT, impl="fortran"),
     "impl must be"),
    (lambda: _cost_model("gpu"), "impl must be one of auto, numba, numpy, got 'gpu'"),
    (lambda: place_tiles(_one_pool()[1], _one_pool()[0], [0, 1], UNIT, placer="jit"), "placer must be one of"),
    (lambda: warmup("fast"), "placer must be one of"),
], ids=["tiles", "exchange", "cost", "placement", "placement-warmup"])
def test_unknown_implementation_is_a_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_compiled_names_only_the_kernel_modules():
    with pytest.raises(ValueError, match="unknown compiled module 'placer_jit'"):
        kernels.compiled("placer_jit")  # a typo must not read as "numba missing"


@pytest.mark.numba
def test_auto_uses_numba_and_warmup_compiles_once():
    assert default_placer() == "numba" and available_placers() == ("numba", "python")
    assert tiles.tiles_impl() == exchange.exchange_impl() == cost_mod.cost_impl() == "numba"
    assert warmup() >= 0.0
    assert warmup() < 1.0  # already compiled in this process
    assert warmup("python") == 0.0
    assert tiles.warmup() >= 0.0 and exchange.warmup() >= 0.0
    assert kernels.warmup("cost") >= 0.0 and kernels.warmup("layout") >= 0.0


def test_without_numba_auto_falls_back(monkeypatch):
    """No numba: importing a kernel module fails cleanly (so :func:`libra.jit.compiled` reports
    None), ``auto`` runs the Python/numpy code, and ``numba`` is an ImportError naming the extra."""
    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` now raises ImportError
    monkeypatch.delitem(sys.modules, "libra.jit.placement", raising=False)
    assert kernels.compiled.__wrapped__("placement") is None
    monkeypatch.setattr(kernels, "compiled", lambda name: None)  # every compiled module, as without numba
    assert default_placer() == "python" and available_placers() == ("python",)
    assert cost_mod.cost_impl() == "numpy" and _cost_model("auto")._jit is None
    assert tiles.tiles_impl() == exchange.exchange_impl() == "numpy"
    assert warmup() == tiles.warmup() == exchange.warmup() == kernels.warmup("cost") == 0.0
    seqs = [SequenceLayout.contiguous(0, 0, [1, 7], 2), SequenceLayout.contiguous(1, 1, [8], 2)]
    shape = AttentionShape(4, 2, 4)
    tiled = make_tiles(seqs, 2, 2, shape)
    placed, fallback = place_tiles(tiled, seqs, range(4), shape, tau=0.0)
    ref, fb_ref = place_tiles(tiled, seqs, range(4), shape, tau=0.0, placer="python")
    assert placed.dest.tolist() == ref.dest.tolist() and fallback == fb_ref
    with pytest.raises(ImportError, match=r"\.\[fast\]"):
        place_tiles(tiled, seqs, range(4), shape, placer="numba")
    with pytest.raises(ImportError, match=r"\.\[fast\]"):
        _cost_model("numba")
