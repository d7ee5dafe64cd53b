"""Golden outputs of TAP placement (Libra sec. 4.3.2, Algorithm 2): exact destinations and fallbacks.

``tests/data/placement_golden.json`` pins, for a fixed set of pools, every tile's destination and
the fallback count that :func:`libra.tap.placement.place_tiles` returned when the fixture was made.
It guards refactors of the placer (the oracle tests only sample small random pools): any change of
a choice, including a tie-break, fails here. The cases cover both implementations
(``_place_grouped`` for SH-tiles, ``_place_dense`` for tiles that are not a block partition) and
the FLOPs-only path, GQA shapes whose tiles span one or several KV atoms, permuted and scattered
holder layouts, long samples that cross blocks and holders, ``tau`` in {0, 0.03, 0.2}, caller
``weights=`` (with ties and zeros), and pools where the least-loaded fallback fires. Every case
runs through each available placer (the Python loops, which make the fixture, and the compiled
numba kernels when numba is installed).

Every case's *inputs* are stored in the fixture too (sample lengths, layouts, explicit tiles), so it
does not depend on a random generator's stream; weights come from an integer hash of the tile index.

Regenerate (only when the placement is meant to change, and say why in the commit)::

    .venv/bin/python tests/test_tap_placement_golden.py --regenerate
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from libra.plan import SequenceLayout, TileTable, tile_flops
from libra.tap.placement import PlacementPolicy, available_placers, is_block_partition, place_tiles
from libra.tap.tiles import PoolTiles, kv_atoms, make_tiles, pool_index
from libra.workload import AttentionShape

FIXTURE = Path(__file__).resolve().parent / "data" / "placement_golden.json"
SEED = 20240610

# (hq, hkv, H choices): GQA groups of 4, 8, 1, and shapes whose head shards straddle KV heads
# (hq=12/hkv=4 with H=6, hq=6/hkv=3 with H=2: tiles spanning two KV atoms)
SHAPES = [(8, 2, (1, 2, 4, 8)), (32, 4, (1, 2, 4, 8)), (4, 4, (1, 2, 4)), (32, 8, (2, 4, 8)),
          (12, 4, (6, 3, 2)), (6, 3, (2, 3))]


# --------------------------------------------------------------------------------------------
# case inputs (stored in the fixture)
# --------------------------------------------------------------------------------------------


def _skewed_lengths(rng, total: int, style: str) -> list[int]:
    """Sample lengths summing to ``total``: long-tailed (mostly short, some spanning blocks and
    holders), a single sample, or equal samples (many FLOPs ties)."""
    if style == "single":
        return [total]
    if style == "uniform":
        n = int(rng.choice([d for d in (1, 2, 4, 8, 16) if total % d == 0]))
        return [total // n] * n
    out, left = [], total
    while left:
        r = rng.random()
        if r < 0.12:
            n = int(rng.integers(total // 2, total + 1))  # a long sample
        elif r < 0.35:
            n = int(rng.integers(1, max(2, total // 4)))
        else:
            n = int(rng.integers(1, max(2, total // 32)))
        n = min(n, left)
        out.append(n)
        left -= n
    return out


def _weights_spec(rng, i: int):
    mode = [None, None, "perturb", "random", "zeros"][i % 5]
    return None if mode is None else {"mode": mode, "salt": int(rng.integers(0, 1000))}


def _standard_spec(rng, i: int, dense: bool = False, mixed: bool = False, large: bool = False) -> dict:
    """A pool of P DP ranks with CP each, sequence j on DP rank ``p0 + j``. ``large``: P = 8,
    CP = 8, 32 blocks of 64 tokens per sequence (a scaled-down 256K pool, 512-1024 tiles)."""
    hq, hkv, splits = SHAPES[i % len(SHAPES)]
    if dense:
        splits = tuple(h for h in splits if h > 1)  # overlapping tiles need a second head shard
    p = int(rng.choice([1, 2, 4, 8])) if not dense else int(rng.choice([1, 2, 3]))
    cp = int(rng.choice([1, 2, 4]))
    block = int(rng.choice([4, 8, 16, 64] if not dense else [2, 4, 8]))
    k = int(rng.integers(1, 5)) if not dense else int(rng.integers(1, 3))
    if p * cp * k * len(splits) > 256:  # keep the fixture small
        k = 1
    if large:
        p, cp, block, k, splits = 8, 8, 64, 4, tuple(h for h in splits if h in (2, 4))
    total = block * k * cp
    style = ["skewed", "skewed", "skewed", "single", "uniform"][int(rng.integers(0, 5))]
    perm = bool(rng.random() < 0.3) and cp > 1
    spec = {
        "kind": "standard", "path": "dense" if dense else "grouped",
        "p": p, "p0": int(rng.integers(0, 2)), "cp": cp, "block": block,
        "head_split": int(rng.choice(splits)), "shape": [hq, hkv, int(rng.choice([4, 8, 128])), 2],
        "lengths": [_skewed_lengths(rng, total, style) for _ in range(p)],
        "ranks": [rng.permutation(cp).tolist() if perm else list(range(cp)) for _ in range(p)],
        "tau": [0.0, 0.03, 0.2][i % 3], "comm_aware": True, "weights": _weights_spec(rng, i),
    }
    if mixed:  # odd sequences use another head split: tiles of even ones span several KV atoms
        others = [h for h in splits if h != spec["head_split"]]
        spec["head_split_odd"] = int(rng.choice(others))
    return spec


def _scattered_spec(rng, i: int, dense: bool) -> dict:
    """Arbitrary holder partitions (unequal ranges, a worker holding non-adjacent ranges) with
    explicit tiles: holder ranges (or pieces) x head shards. ``dense``: the head shards of a holder
    range cut it at different points, so tiles overlap (not a block partition)."""
    hq, hkv, splits = SHAPES[i % len(SHAPES)]
    n_workers = int(rng.integers(1, 7))
    workers = sorted(rng.choice(np.arange(2, 14), n_workers, replace=False).tolist())
    seqs, rows = [], []
    for s in range(int(rng.integers(1, 4))):
        total = int(rng.integers(2, 60 if dense else 200))
        cuts = sorted(set(rng.integers(1, total, int(rng.integers(0, 7))).tolist()))
        starts, ends = [0] + cuts, cuts + [total]
        holders = [int(rng.choice(workers)) for _ in starts]
        seqs.append({"lengths": _skewed_lengths(rng, total, "skewed"), "starts": starts, "ends": ends,
                     "holders": holders})
        split = int(rng.choice(splits))
        width = hq // split
        for a, b, w in zip(starts, ends, holders):
            mid = int(rng.integers(a, b + 1))
            for h in range(split):
                if dense:
                    mid = int(rng.integers(a, b + 1))
                for lo, hi in ((a, mid), (mid, b)) if a < mid < b else ((a, b),):
                    rows.append([s, lo, hi, h * width, (h + 1) * width, w])
    if dense and len(rows) and not _rows_overlap(rows):
        s, lo, hi, hs, he, w = rows[0]
        a = next(j for j, sq in enumerate(seqs[s]["starts"]) if sq <= lo < seqs[s]["ends"][j])
        rows.append([s, seqs[s]["starts"][a], seqs[s]["ends"][a], hs, he, w])  # overlaps its pieces
    return {"kind": "scattered", "path": "dense" if dense else "grouped", "shape": [hq, hkv, 8, 2],
            "workers": workers, "sequences": seqs, "tiles": rows, "tau": [0.0, 0.03, 0.2][i % 3],
            "comm_aware": True, "weights": _weights_spec(rng, i)}


def _rows_overlap(rows) -> bool:
    ranges = sorted({(s, lo, hi) for s, lo, hi, *_ in rows})
    return any(a[0] == b[0] and b[1] < a[2] for a, b in zip(ranges, ranges[1:]))


def build_specs() -> list[dict]:
    """The case inputs (only used to regenerate the fixture)."""
    rng = np.random.default_rng(SEED)
    specs = [_standard_spec(rng, i) for i in range(36)]
    specs += [_standard_spec(rng, i, mixed=True) for i in range(36, 42)]
    specs += [_standard_spec(rng, i, dense=True) for i in range(42, 48)]
    specs += [_scattered_spec(rng, i, dense=False) for i in range(48, 56)]
    specs += [_scattered_spec(rng, i, dense=True) for i in range(56, 64)]
    specs += [_standard_spec(rng, i, large=True) for i in (64, 65, 66, 67, 69, 70)]
    for i in (3, 4, 12, 22, 30):
        specs[i].update(comm_aware=False, path="flops_only")  # the FLOPs-only heap
    return specs


# --------------------------------------------------------------------------------------------
# building and running a case
# --------------------------------------------------------------------------------------------


def _weights(spec, flops: np.ndarray):
    """Deterministic per-tile loads from an integer hash of the tile index (no RNG stream)."""
    if spec is None:
        return None
    t = np.arange(len(flops), dtype=np.int64)
    u = ((t * 7919 + spec["salt"] * 104729) % 1009).astype(np.float64) / 1009.0
    if spec["mode"] == "perturb":
        return flops * (0.5 + u)
    if spec["mode"] == "random":
        return 1.0 + np.floor(u * 40.0)  # independent of FLOPs, with many ties
    w = flops * (0.5 + u)
    w[t % 5 == 0] = 0.0
    return w


def _standard_tiles(spec, sequences, shape):
    tiles = make_tiles(sequences, spec["block"], spec["head_split"], shape)
    if "head_split_odd" in spec:
        odd = make_tiles(sequences, spec["block"], spec["head_split_odd"], shape)
        tiles = TileTable.concat([tiles.select(tiles.seq % 2 == 0), odd.select(odd.seq % 2 == 1)])
    if spec["path"] == "dense":
        # not a block partition: shards other than the first of each holder range's first block
        # lose their first row to a one-row tile of their own, so tiles [a, a+B) and [a+1, a+B) overlap
        cols = {k: getattr(tiles, k).copy() for k in TileTable.FIELDS}
        per = int(sequences[0].holder_end[0] - sequences[0].holder_start[0])
        cut = (cols["q_end"] - cols["q_start"] >= 2) & (cols["head_start"] > 0) & (cols["q_start"] % per == 0)
        one = {k: v[cut] for k, v in cols.items()}
        one["q_end"] = one["q_start"] + 1
        cols["q_start"] = np.where(cut, cols["q_start"] + 1, cols["q_start"])
        for c in (cols, one):
            c["flops"] = _recount(sequences, c, shape)
        tiles = TileTable.concat([TileTable(**cols), TileTable(**one)])
    return tiles


def _recount(sequences, cols, shape) -> np.ndarray:
    """Forward FLOPs of explicit tile rows (``cols``: TileTable columns)."""
    rows = zip(cols["seq"], cols["q_start"], cols["q_end"], cols["head_start"], cols["head_end"])
    return np.array([float(tile_flops(sequences[s], [lo], [hi], he - hs, shape.head_dim)[0])
                     for s, lo, hi, hs, he in rows])


def build_case(spec):
    """``(tiles, sequences, workers, shape, kwargs)`` of one fixture case."""
    hq, hkv, d, nbytes = spec["shape"]
    shape = AttentionShape(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype_bytes=nbytes)
    if spec["kind"] == "standard":
        cp, p0 = spec["cp"], spec["p0"]
        sequences = []
        for j, (lengths, ranks) in enumerate(zip(spec["lengths"], spec["ranks"])):
            seq = SequenceLayout.contiguous(j, p0 + j, lengths, cp)
            if ranks != list(range(cp)):
                seq = SequenceLayout(j, p0 + j, lengths, seq.holder_start, seq.holder_end,
                                     (p0 + j) * cp + np.array(ranks))
            sequences.append(seq)
        workers = [dp * cp + r for dp in range(p0, p0 + spec["p"]) for r in range(cp)]
        tiles = _standard_tiles(spec, sequences, shape)
    else:
        sequences = [SequenceLayout(s, s, q["lengths"], q["starts"], q["ends"], q["holders"])
                     for s, q in enumerate(spec["sequences"])]
        workers = spec["workers"]
        cols = dict(zip(("seq", "q_start", "q_end", "head_start", "head_end", "q_home"),
                        (np.array(c, dtype=np.int64) for c in zip(*spec["tiles"]))))
        cols["dest"] = np.full(len(spec["tiles"]), -1)
        cols["flops"] = _recount(sequences, cols, shape)
        tiles = TileTable(**cols)
    kwargs = {"tau": spec["tau"], "policy": PlacementPolicy(comm_aware=spec["comm_aware"]),
              "weights": _weights(spec["weights"], tiles.flops)}
    return tiles, sequences, workers, shape, kwargs


def run_case(spec) -> tuple[list[int], int]:
    tiles, sequences, workers, shape, kwargs = build_case(spec)
    placed, fallback = place_tiles(tiles, sequences, workers, shape, placer="python", **kwargs)
    return placed.dest.tolist(), int(fallback)


# --------------------------------------------------------------------------------------------
# fixture
# --------------------------------------------------------------------------------------------


def regenerate(path: Path = FIXTURE) -> list[dict]:
    cases = []
    for spec in build_specs():
        dest, fallback = run_case(spec)
        cases.append({"spec": spec, "dest": dest, "fallback": fallback})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"seed": SEED, "cases": cases}, separators=(",", ":")) + "\n")
    return cases


def _load() -> list[dict]:
    return json.loads(FIXTURE.read_text())["cases"]


CASES = _load() if FIXTURE.exists() else []


@pytest.mark.parametrize("placer", sorted(available_placers()))  # the Python loops, and numba if installed
@pytest.mark.parametrize("case", CASES,
                         ids=[f"{i}-{c['spec']['kind']}-{c['spec']['path']}" for i, c in enumerate(CASES)])
def test_placement_matches_golden(case, placer):
    """Same destinations (every tile) and the same fallback count as when the fixture was made,
    from every placer (:func:`libra.tap.placement.available_placers`)."""
    spec = case["spec"]
    tiles, sequences, workers, shape, kwargs = build_case(spec)
    assert is_block_partition(tiles) == (spec["path"] != "dense")  # the case exercises its path
    placed, fallback = place_tiles(tiles, sequences, workers, shape, placer=placer, **kwargs)
    assert fallback == case["fallback"]
    assert placed.dest.tolist() == case["dest"]


def test_fixture_covers_every_path():
    """The fixture keeps exercising what it is meant to: both placers, the FLOPs-only heap,
    fallbacks on each path, tiles over several KV atoms, weights and tau = 0."""
    assert len(CASES) >= 40, "fixture missing: run this file with --regenerate"
    by_path = {}
    for c in CASES:
        by_path.setdefault(c["spec"]["path"], []).append(c)
    assert set(by_path) == {"grouped", "dense", "flops_only"}
    for path, cases in by_path.items():
        assert any(c["fallback"] > 0 for c in cases), f"no {path} case hits the fallback"
        assert any(c["fallback"] == 0 for c in cases), f"every {path} case hits the fallback"
    multi = 0
    for c in by_path["grouped"]:
        tiles, _, _, shape, _ = build_case(c["spec"])
        _, a0, a1 = kv_atoms(shape, tiles.head_start, tiles.head_end)
        multi += bool((a1 - a0 > 1).any())
    assert multi >= 3
    assert any(c["spec"]["weights"] for c in by_path["grouped"])
    assert any(c["spec"]["tau"] == 0.0 for c in by_path["grouped"])


@pytest.mark.parametrize("i", [0, 12, 42, 48, 56, 66])
def test_pool_tiles_carry_their_index(i):
    """The same tiles as :class:`~libra.tap.tiles.PoolTiles` made for these sequences (their index
    reused, the per-tile checks skipped) give the same placement."""
    case = CASES[i]
    tiles, sequences, workers, shape, kwargs = build_case(case["spec"])
    made = PoolTiles(sequences, pool_index(sequences), **{k: getattr(tiles, k) for k in TileTable.FIELDS})
    placed, fallback = place_tiles(made, sequences, workers, shape, **kwargs)
    assert placed.dest.tolist() == case["dest"] and fallback == case["fallback"]


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit(f"usage: {sys.argv[0]} --regenerate")
    out = regenerate()
    print(f"wrote {len(out)} cases to {FIXTURE} ({FIXTURE.stat().st_size} bytes); fallbacks:",
          [c["fallback"] for c in out])
