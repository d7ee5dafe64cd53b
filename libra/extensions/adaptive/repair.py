"""Overload repair after a greedy placement (``libra-adaptive``; an extension beyond Libra sec. 4.3.2).

Algorithm 2 puts each tile on the cheapest worker within the soft target ``C = (1 + tau) * mean``
and, when no worker has room, on the least-loaded one, which then ends above ``C``. Under Q-home
retention (:func:`libra.extensions.adaptive.retention.place_retaining`) that is common on real corpora at 1M: every
Q-home first keeps its own light tiles, so when a long sample's late tiles (up to 0.97 of a
worker's mean load after the heavy-tile cut) come to be placed, no worker has room left for them.
On a Wikipedia 1M pool (4104 tiles on 128 workers) 32 tiles fell back; the workers that took
them ended at up to 1.18x the mean load while others stayed at 0.77x.

:func:`repair_overload` then moves tiles off every worker above ``C`` (the most loaded first): its
tiles leave in order of decreasing ``priority`` (``libra-adaptive`` passes work per byte moved,
the reverse of retention's order: the work cheapest to move goes first), each to the worker with
room (``load + tile <= C``) at the least link cost from the tile's Q-home, then the least load,
then the lowest id, until the worker is within ``C`` or none of its tiles fits anywhere. Workers
within ``C`` never leave it, so one pass suffices. Measured on 4 windows (``straggler``, jitter
on): ``libra-adaptive``'s mean speedup over Ulysses went up 3.9% on Wikipedia 1M and 4.7% on
ProLong 1M, 0.3-0.4% at 256K; libra-prod's placements never leave a worker above ``C``.

The Python loop below is the oracle and the fallback; :func:`libra.jit.placement.repair_overload`
makes the same moves (numba). Deterministic: a pure function of its inputs.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from libra.tap.placement import placer_module


class _RepairArrays(NamedTuple):
    """One repair's arrays, built once by :func:`repair_overload` and read by either loop (the
    Python :func:`_repair_python` takes them whole, the compiled kernel one by one), so both run
    on the very same inputs.

    Attributes:
        dest: int64 ``(T,)`` pool index of each tile's worker; the loops update it in place.
        load: float64 ``(T,)`` tile loads.
        loads: float64 ``(W,)`` each worker's load (its base plus its tiles); updated in place.
        cap: the soft target ``C``.
        over: the workers above ``cap``, in repair order (the most loaded first, ties by id).
        by_worker: tile ids grouped by worker, each worker's in leaving order (decreasing priority,
            ties by tile index); ``starts``: int ``(W + 1,)``: worker ``w``'s tiles are
            ``by_worker[starts[w]:starts[w + 1]]``.
        home: int64 ``(T,)`` pool index of each tile's Q-home.
        lw: int64 ``(W, W)`` cost of a byte between workers.
    """

    dest: np.ndarray
    load: np.ndarray
    loads: np.ndarray
    cap: float
    over: np.ndarray
    by_worker: np.ndarray
    starts: np.ndarray
    home: np.ndarray
    lw: np.ndarray


def repair_overload(dest: np.ndarray, load: np.ndarray, base: np.ndarray, cap: float, priority: np.ndarray,
                    home: np.ndarray, lw: np.ndarray, placer: str = "auto") -> tuple[np.ndarray, int]:
    """Move tiles off the workers a placement left above ``cap`` (module docstring).

    Args:
        dest: int ``(T,)`` pool index (into the sorted workers) of each tile's worker.
        load: float ``(T,)`` tile loads; ``base``: float ``(W,)`` each worker's load before any tile.
        cap: the soft target ``C`` the placement used.
        priority: float ``(T,)``: a worker's tiles leave in decreasing priority (ties: tile index).
        home: int ``(T,)`` pool index of each tile's Q-home.
        lw: int ``(W, W)`` cost of a byte between workers (:func:`libra.tap.placement.link_matrix`).
        placer: ``"auto"``, ``"numba"`` or ``"python"`` (:data:`libra.tap.placement.PLACERS`): the
            same moves either way.

    Returns:
        ``(new dest, tiles moved)``; ``dest`` itself is not modified.

    Raises:
        ValueError: arrays whose lengths disagree, a ``dest`` or ``home`` outside ``[0, W)``, or
            ``lw`` not ``(W, W)``.
    """
    dest = np.array(dest, dtype=np.int64)
    load = np.asarray(load, dtype=np.float64)
    _check(dest, load, base, priority, home, lw)
    loads = np.bincount(dest, weights=load, minlength=len(base)) + base  # the kernels' summation order
    over = np.flatnonzero(loads > cap)
    if not len(over):
        return dest, 0
    over = over[np.lexsort((over, -loads[over]))]  # the most loaded first, ties by id
    by_worker = np.lexsort((np.arange(len(dest)), -np.asarray(priority, dtype=np.float64), dest))
    starts = np.searchsorted(dest[by_worker], np.arange(len(base) + 1))
    r = _RepairArrays(dest, load, loads, float(cap), over, by_worker, starts, np.asarray(home, dtype=np.int64),
                      np.asarray(lw, dtype=np.int64))
    jit = placer_module(placer)
    # the compiled kernel takes the same arrays one by one, in the bundle's field order
    moved = _repair_python(r) if jit is None else jit.repair_overload(*r)
    return dest, int(moved)


def _check(dest, load, base, priority, home, lw) -> None:
    """ValueError unless the arrays describe one placement of ``T`` tiles on ``W`` workers."""
    n, t = len(base), len(dest)
    if not (np.shape(load) == np.shape(priority) == np.shape(home) == (t,)) or np.shape(lw) != (n, n):
        raise ValueError(f"repair_overload: {t} tiles need (T,) load, priority and home and a (W, W) link "
                         f"matrix for W = {n}; got {np.shape(load)}, {np.shape(priority)}, {np.shape(home)}, "
                         f"{np.shape(lw)}")
    for name, a in (("dest", dest), ("home", np.asarray(home))):
        if t and (a.min() < 0 or a.max() >= n):
            raise ValueError(f"repair_overload: {name} must index the {n} workers")


def _repair_python(r: _RepairArrays) -> int:
    """The repair loop (``r.dest`` and ``r.loads`` updated in place); returns the tiles moved.
    Each overloaded worker (``r.over``, in order) sheds its tiles in leaving order
    (:class:`_RepairArrays`) until it is within ``r.cap`` or none of its tiles fits elsewhere."""
    dest, load, loads, cap, by_worker, starts, home, lw = (r.dest, r.load, r.loads, r.cap, r.by_worker, r.starts,
                                                           r.home, r.lw)
    moved = 0
    ids = np.arange(len(loads))
    for w in r.over.tolist():
        for t in by_worker[starts[w]:starts[w + 1]].tolist():
            if loads[w] <= cap:
                break
            f = load[t]
            ok = loads + f <= cap
            ok[w] = False
            if not ok.any():
                continue
            cost = lw[home[t]]
            best = ok & (cost == cost[ok].min())
            v = int(ids[best][np.argmin(loads[best])])  # least load, then the lowest id
            dest[t] = v
            loads[w] -= f
            loads[v] += f
            moved += 1
    return moved
