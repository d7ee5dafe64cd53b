"""Packed batches for Hugging Face models: collator parity, the CP sharder, the sorted VRSP scheduler.

* :func:`collate_packed` gives exactly what ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``
  gives (keys, dtypes, values), from the sampler's pieces through :class:`PieceFeatures`;
* :func:`shard_packed_batch` cuts contiguous slices whose concatenation is the sequence, with the
  labels shifted before the cut (a slice's last token keeps its target on the next rank) and
  -100 at every document end;
* the scheduler for any CP method is :func:`libra.vrsp.vrsp_schedule` / ``LibraSampler`` at
  ``pool_size=1`` (one implementation): each step keeps its multiset, GA index ``g`` trains the
  ``g``-th heaviest DP sequences, every rank takes the same decisions, and it resumes exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from libra.data.collate import (
    IGNORE_INDEX,
    PieceFeatures,
    collate_packed,
    document_lengths,
    shard_packed_batch,
)
from libra.sampler import LibraSampler
from libra.vrsp import vrsp_schedule
from libra.workload import packed_workload


def _rows(n=40, seed=0, labels=False):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        toks = rng.integers(0, 1000, int(rng.integers(1, 90))).tolist()
        row = {"input_ids": toks}
        if labels:  # e.g. a prompt whose first tokens are not trained on
            row["labels"] = [IGNORE_INDEX] * min(3, len(toks)) + toks[3:]
        rows.append(row)
    return rows


@pytest.mark.parametrize("labels", [False, True])
@pytest.mark.parametrize("as_tensors", [False, True])
def test_collate_packed_matches_data_collator_with_flattening(labels, as_tensors):
    transformers = pytest.importorskip("transformers", reason="parity is checked against transformers' collator "
                                       "(the [hf] extra)")
    rows = _rows(6, labels=labels)
    if as_tensors:
        rows = [{k: torch.tensor(v) for k, v in r.items()} for r in rows]
    want = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(rows)
    got = collate_packed(rows)
    assert list(got) == list(want)
    for key, w in want.items():
        g = got[key]
        assert type(g) is type(w), key
        if isinstance(w, torch.Tensor):
            assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), key
        else:
            assert g == w, key


def test_sampler_pieces_through_a_dataloader():
    rows = _rows(60)
    features = PieceFeatures(rows)
    sampler = LibraSampler(features.lengths(), 128, 4, 2, pool_size=1, dp_rank=1, seed=3)
    loader = torch.utils.data.DataLoader(features, batch_sampler=sampler, collate_fn=collate_packed)
    for batch, pieces in zip(loader, iter(LibraSampler(features.lengths(), 128, 4, 2, pool_size=1, dp_rank=1, seed=3))):
        assert batch["input_ids"].shape == (1, 128)
        assert document_lengths(batch) == tuple(p.length for p in pieces)
        want = [t for p in pieces for t in rows[p.index]["input_ids"][p.start:p.stop]]
        assert batch["input_ids"][0].tolist() == want
    with pytest.raises(ValueError, match="outside row"):
        features[(0, 0, len(rows[0]["input_ids"]) + 1)]


def test_shard_packed_batch_slices_shift_first_and_mask_document_ends():
    lengths = (5, 40, 3, 16)  # 64 tokens; CP 4 puts slice edges at 16, 32, 48 (the 40-token document crosses two)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 100, (n,), generator=g).tolist()} for n in lengths]
    batch = collate_packed(rows)
    ids = batch["input_ids"][0]
    shards = [shard_packed_batch(batch, r, 4) for r in range(4)]
    for key in ("input_ids", "position_ids"):
        assert torch.equal(torch.cat([s[key] for s in shards], 1), batch[key])
    targets = torch.cat([s["shift_labels"] for s in shards], 1)[0]
    ends = np.cumsum(lengths) - 1
    for i in range(64):
        assert int(targets[i]) == (IGNORE_INDEX if i in ends else int(ids[i + 1])), i
    assert int(shards[0]["shift_labels"][0, -1]) == int(ids[16])  # crosses to rank 1's first token
    assert all(s["sample_lengths"] == lengths for s in shards)
    assert int((targets != IGNORE_INDEX).sum()) == 64 - len(lengths)
    # the same from position_ids alone (DataCollatorWithFlattening without flash kwargs) and with no labels
    plain = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    again = shard_packed_batch(plain, 2, 4)
    assert again["sample_lengths"] == lengths and torch.equal(again["shift_labels"], shards[2]["shift_labels"])


@pytest.mark.parametrize("kwargs, match", [
    ({"cp_rank": 0, "cp_size": 3}, "must be a positive integer dividing S=64"),
    ({"cp_rank": 4, "cp_size": 4}, r"cp_rank=4 must be in \[0, 4\)"),
    ({"cp_rank": 0, "cp_size": 0}, "positive integer"),
])
def test_shard_packed_batch_rejects_bad_layouts(kwargs, match):
    batch = collate_packed([{"input_ids": list(range(64))}])
    with pytest.raises(ValueError, match=match):
        shard_packed_batch(batch, **kwargs)
    with pytest.raises(ValueError, match=r"a packed batch is \(1, S\)"):
        shard_packed_batch({"input_ids": torch.zeros(2, 8, dtype=torch.long)}, 0, 1)
    with pytest.raises(ValueError, match="do not split"):
        shard_packed_batch({"input_ids": torch.zeros(1, 8, dtype=torch.long),
                            "position_ids": torch.arange(1, 9)[None]}, 0, 1)


def _step_sets(sampler, step):
    a = sampler.step(step)
    return sorted(tuple(s) for s in a.sequences), a


def test_sorted_scheduler_keeps_each_step_and_orders_ga_by_workload():
    lengths = np.random.default_rng(5).integers(1, 400, 300)
    sorted_s = LibraSampler(lengths, 256, 8, 2, pool_size=1, seed=1)
    arrival = LibraSampler(lengths, 256, 8, 2, pool_size=1, seed=1, use_vrsp=False)
    for step in range(sorted_s.steps_per_epoch):
        got, a = _step_sets(sorted_s, step)
        assert got == _step_sets(arrival, step)[0]  # the step's sequences (and samples) unchanged
        assert sorted(a.groups.ravel().tolist()) == list(range(8))
        w = np.array([packed_workload([p.length for p in s]) for s in a.sequences])
        per_slot = w[a.groups]  # (GA, DP): sorted by decreasing sum l^2 across GA steps
        assert np.all(np.diff(per_slot.ravel()) <= 0)
        pools, groups = vrsp_schedule(w, 1, 2)  # the one implementation the sampler uses
        assert np.array_equal(groups, a.groups) and pools.shape == (8, 1)


def test_sorted_scheduler_is_identical_on_every_rank_and_resumes():
    lengths = np.random.default_rng(6).integers(1, 300, 400)
    ranks = [LibraSampler(lengths, 128, 8, 4, pool_size=1, dp_rank=r, seed=2) for r in range(4)]
    for step in range(3):
        first = ranks[0].step(step)
        for s in ranks[1:]:
            other = s.step(step)
            assert np.array_equal(other.groups, first.groups) and other.sequences == first.sequences
    full = [tuple(b) for b in ranks[2]]
    resumed = LibraSampler(lengths, 128, 8, 4, pool_size=1, dp_rank=2, seed=2)
    it = iter(resumed)
    head = [tuple(next(it)) for _ in range(5)]
    state = resumed.state_dict()
    fresh = LibraSampler(lengths, 128, 8, 4, pool_size=1, dp_rank=2, seed=2)
    fresh.load_state_dict(state)
    assert head + [tuple(b) for b in fresh] == full
