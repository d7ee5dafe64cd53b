"""Pluggable data sampler: fixed-token packing + VRSP per optimizer step (Libra sec. 1, 4.2, 5).

Each optimizer step consumes the next ``GBS * S`` tokens of a seeded, per-epoch permutation of the
dataset's samples. Those tokens are packed in arrival order into ``GBS`` packed sequences of exactly
``S`` tokens (a sample crossing a sequence or step boundary is split into *pieces*; the remainder
starts the next sequence), VRSP (Alg. 1) groups the packed sequences into ``K = GBS / P`` pools of
``P`` with balanced aggregate workload ``sum l^2``, and :func:`libra.vrsp.microbatch_groups` maps pool ``k`` to
GA index ``k // (DP / P)`` and DP ranks ``(k % (DP / P)) * P + j``. VRSP only permutes the step's
packed sequences, so every step's sample multiset is unchanged (Libra sec. 6.7).

DataLoader design (duck typing; this module never imports torch):

* :class:`LibraSampler` is a *batch sampler* for one DP rank: ``iter`` yields, for every step and
  every GA index in order, one batch = one packed sequence = a list of :class:`SamplePiece`
  ``(index, start, stop)``. Use ``DataLoader(dataset, batch_sampler=sampler, collate_fn=...)``
  with a dataset whose ``__getitem__`` accepts a :class:`SamplePiece` (tokens ``[start, stop)`` of
  sample ``index``).
* :meth:`LibraSampler.step` returns the whole step (:class:`StepAssignment`): the packed sequences,
  VRSP's pools and the ``(GA, DP)`` microbatch groups, i.e. the sequence-length metadata the
  asynchronous planner needs to build every rank's Plan ahead of time (:meth:`group_lengths`).
* Deterministic given ``(seed, epoch)``; :meth:`state_dict` / :meth:`load_state_dict` resume at
  the next unconsumed microbatch.

The tail of an epoch shorter than one step (``< GBS * S`` tokens) is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from libra.data.packing import DEFAULT_POLICY, POLICIES, pack_fixed_tokens
from libra.vrsp import microbatch_groups, vrsp_schedule
from libra.workload import packed_workload


class SamplePiece(NamedTuple):
    """Tokens ``[start, stop)`` of dataset sample ``index`` (a whole sample or a split piece)."""

    index: int
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class StepAssignment:
    """One optimizer step's data after packing and VRSP.

    Attributes:
        epoch, step: position of the step.
        sequences: ``GBS`` packed sequences (arrival order), each a tuple of :class:`SamplePiece`
            summing to exactly ``S`` tokens.
        pools: int ``(K, P)`` indices into ``sequences`` (VRSP's pools; arrival order without VRSP).
        groups: int ``(GA, DP)``: ``groups[g, r]`` is the sequence DP rank ``r`` trains at GA index
            ``g``; each GA index's pools are rows of ``pools``.
    """

    epoch: int
    step: int
    sequences: tuple[tuple[SamplePiece, ...], ...]
    pools: np.ndarray
    groups: np.ndarray

    def sample_lengths(self, seq: int) -> np.ndarray:
        """int64 ``(n_pieces,)`` piece lengths of packed sequence ``seq`` (the planner's input)."""
        return np.array([p.length for p in self.sequences[seq]], dtype=np.int64)

    def group_lengths(self, ga_index: int) -> list[np.ndarray]:
        """Sample lengths of the DP packed sequences of one microbatch group, in DP-rank order."""
        return [self.sample_lengths(int(s)) for s in self.groups[ga_index]]

    def rank_sequences(self, dp_rank: int) -> list[tuple[SamplePiece, ...]]:
        """The packed sequences DP rank ``dp_rank`` trains, in GA order."""
        return [self.sequences[int(s)] for s in self.groups[:, dp_rank]]


def pack_stream(pieces: list[SamplePiece], seq_len: int, policy: str = "split") -> list[tuple[SamplePiece, ...]]:
    """Fixed-token packing of one step's pieces with :func:`libra.data.packing.pack_fixed_tokens`.

    ``policy`` is ``"split"`` (strict arrival order; a piece that does not fit the remaining room
    is cut at the sequence boundary and continues in the next sequence) or ``"defer"`` (first-fit
    with lookahead: a piece that does not fit waits while a later one fills the room). Either way
    every token of ``pieces`` lands in exactly one packed sequence; the pieces must total a
    multiple of ``seq_len`` so nothing is dropped.

    Raises:
        ValueError: the total is not a multiple of ``seq_len``, or another policy is asked for.
    """
    if policy not in ("split", "defer"):
        raise ValueError(f"step packing policy must be 'split' or 'defer', got {policy!r}")
    total = sum(p.length for p in pieces)
    if total % seq_len:
        raise ValueError(f"pieces total {total} tokens, not a multiple of S={seq_len}")
    packed = pack_fixed_tokens([p.length for p in pieces], seq_len, policy=policy)
    consumed = [0] * len(pieces)  # tokens of each input piece already placed (its parts come in order)
    out: list[tuple[SamplePiece, ...]] = []
    for seq in packed:
        row = []
        for n, i in zip(seq.sample_lengths.tolist(), seq.sample_ids.tolist()):
            src = pieces[i]
            start = src.start + consumed[i]
            consumed[i] += n
            row.append(SamplePiece(src.index, start, start + n))
        out.append(tuple(row))
    if consumed != [p.length for p in pieces] or len(out) != total // seq_len:
        raise RuntimeError("packing lost or duplicated tokens of the step")  # invariant of pack_fixed_tokens
    return out


@dataclass(frozen=True)
class SamplerConfig:
    """The layout and options of a :class:`LibraSampler` (everything but the sample lengths);
    checked once, here.

    Attributes:
        seq_len: ``S`` tokens per packed sequence.
        gbs: packed sequences per optimizer step.
        dp: data-parallel degree; must divide ``gbs``.
        pool_size: ``P``; must divide ``dp``. ``P = 1`` keeps pools trivial.
        dp_rank: the rank whose batches ``iter`` yields (``0 <= dp_rank < dp``).
        seed: permutation seed.
        shuffle: permute samples per epoch (``False``: dataset order every epoch).
        use_vrsp: ``False`` keeps arrival (production) order: pool ``k`` = sequences ``kP..kP+P-1``.
        policy: a ``libra.data.packing`` policy (default: that module's default). ``"defer"``:
            first-fit packing of the step's samples (a sample that does not fit the room waits for
            the next sequence while a later one fills it); ``"split"``: strict arrival order, cut
            at sequence boundaries; ``"truncate"``: like split, but only the first ``S`` tokens of
            a longer sample are used; ``"error"``: a sample longer than ``S`` is rejected. In every
            case a step consumes exactly the next ``GBS * S`` tokens of the epoch's stream (the
            sample straddling a step boundary is cut there).

    Raises:
        ValueError: non-positive sizes, ``dp`` not dividing ``gbs``, ``P`` not dividing ``dp``,
            ``dp_rank`` out of range, or an unknown policy.
    """

    seq_len: int
    gbs: int
    dp: int
    pool_size: int = 1
    dp_rank: int = 0
    seed: int = 0
    shuffle: bool = True
    use_vrsp: bool = True
    policy: str = DEFAULT_POLICY

    def __post_init__(self):
        seq_len, gbs, dp, pool_size, dp_rank = self.seq_len, self.gbs, self.dp, self.pool_size, self.dp_rank
        for name, value in (("seq_len", seq_len), ("gbs", gbs), ("dp", dp), ("pool_size", pool_size)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"LibraSampler.{name} must be a positive integer, got {value!r}")
        if gbs % dp:
            raise ValueError(f"DP={dp} must divide GBS={gbs} (mbs = 1)")
        if dp % pool_size:
            raise ValueError(f"pool size P={pool_size} must divide DP={dp}")
        if not isinstance(dp_rank, (int, np.integer)) or not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank={dp_rank!r} must be in [0, DP={dp})")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown packing policy {self.policy!r}; choose one of {POLICIES}")
        for name in ("seq_len", "gbs", "dp", "pool_size", "dp_rank", "seed"):  # numpy integers -> int
            object.__setattr__(self, name, int(getattr(self, name)))


class LibraSampler:
    """Batch sampler of one DP rank: packed sequences per microbatch, VRSP-grouped per step.

    ``LibraSampler(lengths, seq_len, gbs, dp, pool_size=1, dp_rank=0, seed=0, shuffle=True,
    use_vrsp=True, policy=...)``: every argument after ``lengths`` is a :class:`SamplerConfig`
    field (positional in that order, or by keyword); or pass ``config=SamplerConfig(...)``.

    Args:
        lengths: int ``(N,)`` token length of every dataset sample (all >= 1).
        config: the layout and options (see :class:`SamplerConfig` for each field).

    Raises:
        ValueError: empty or non-positive lengths, a bad :class:`SamplerConfig` value, a sample
            longer than ``S`` under ``policy="error"``, or a dataset shorter than one step.
        TypeError: ``config`` together with layout arguments.
    """

    def __init__(self, lengths, *layout, config: SamplerConfig | None = None, **options):
        if config is not None and (layout or options):
            raise TypeError("LibraSampler takes config= or the layout arguments, not both")
        self.config = cfg = SamplerConfig(*layout, **options) if config is None else config
        seq_len, policy = cfg.seq_len, cfg.policy
        arr = np.asarray(lengths)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError(f"lengths must be a non-empty 1-D array, got shape {arr.shape}")
        if not np.issubdtype(arr.dtype, np.integer):
            if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
                bad = arr[~np.isfinite(arr) | (arr != np.round(arr))][0]
                raise ValueError(f"sample lengths must be integers, got {float(bad)!r}")
        arr = arr.astype(np.int64)
        if np.any(arr < 1):
            i = int(np.argmax(arr < 1))
            raise ValueError(f"sample {i} has length {int(arr[i])}; lengths must be >= 1")
        if policy == "error" and arr.max() > seq_len:
            i = int(np.argmax(arr > seq_len))
            raise ValueError(f"sample {i} has {int(arr[i])} tokens, longer than S={seq_len} (policy 'error')")
        self.policy = policy
        self.lengths = arr
        # tokens each sample contributes to the stream ('truncate' keeps only the first S)
        self._used = np.minimum(arr, seq_len) if policy == "truncate" else arr
        self.seq_len, self.gbs, self.dp, self.pool_size = cfg.seq_len, cfg.gbs, cfg.dp, cfg.pool_size
        self.dp_rank, self.seed, self.shuffle, self.use_vrsp = cfg.dp_rank, cfg.seed, cfg.shuffle, cfg.use_vrsp
        self.tokens_per_step = self.gbs * self.seq_len
        if int(self._used.sum()) < self.tokens_per_step:
            raise ValueError(f"dataset has {int(self._used.sum())} tokens, fewer than one step "
                             f"(GBS * S = {self.tokens_per_step})")
        self.epoch = 0
        self._next_micro = 0  # microbatches of this epoch already yielded (resume point)
        self._cache: tuple[int, np.ndarray, np.ndarray] | None = None

    # -- sizes ---------------------------------------------------------------------------
    @property
    def ga(self) -> int:
        return self.gbs // self.dp

    @property
    def steps_per_epoch(self) -> int:
        return int(self._used.sum()) // self.tokens_per_step

    def __len__(self) -> int:
        """Microbatches this rank yields per epoch (``steps_per_epoch * GA``)."""
        return self.steps_per_epoch * self.ga

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (its permutation); restarts the epoch from its first step."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        if int(epoch) != self.epoch:
            self._next_micro = 0
        self.epoch = int(epoch)

    # -- the data of one step ------------------------------------------------------------
    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if self._cache is None or self._cache[0] != epoch:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(len(self.lengths))
            else:
                order = np.arange(len(self.lengths))
            cum = np.concatenate(([0], np.cumsum(self._used[order])))
            self._cache = (epoch, order, cum)
        return self._cache[1], self._cache[2]

    def step_pieces(self, step: int, epoch: int | None = None) -> list[SamplePiece]:
        """The pieces of the token stream step ``step`` consumes, in arrival order."""
        epoch = self.epoch if epoch is None else epoch
        if not 0 <= step < self.steps_per_epoch:
            raise ValueError(f"step={step} outside [0, {self.steps_per_epoch}) of this epoch")
        order, cum = self._order(epoch)
        lo, hi = step * self.tokens_per_step, (step + 1) * self.tokens_per_step
        first = int(np.searchsorted(cum, lo, side="right")) - 1
        last = int(np.searchsorted(cum, hi, side="left"))
        pieces = []
        for pos in range(first, last):
            s0 = int(cum[pos])
            a, b = max(lo, s0) - s0, min(hi, int(cum[pos + 1])) - s0
            if b > a:
                pieces.append(SamplePiece(int(order[pos]), a, b))
        return pieces

    def step(self, step: int, epoch: int | None = None) -> StepAssignment:
        """Pack step ``step`` of ``epoch`` (default: current), run VRSP, map pools to GA x DP."""
        epoch = self.epoch if epoch is None else epoch
        seqs = pack_stream(self.step_pieces(step, epoch), self.seq_len,
                           policy="defer" if self.policy == "defer" else "split")
        workloads = [packed_workload([p.length for p in s]) for s in seqs]
        if self.use_vrsp:
            pools, groups = vrsp_schedule(workloads, self.pool_size, self.dp)
        else:
            pools = np.arange(self.gbs, dtype=np.int64).reshape(-1, self.pool_size)
            groups = microbatch_groups(pools, self.dp)
        return StepAssignment(epoch, step, tuple(seqs), pools, groups)

    # -- iteration and resume ------------------------------------------------------------
    def __iter__(self):
        """Yield this rank's packed sequences (lists of :class:`SamplePiece`) in (step, GA) order."""
        while self._next_micro < len(self):
            step, ga_index = divmod(self._next_micro, self.ga)
            assignment = self.step(step)
            for g in range(ga_index, self.ga):
                self._next_micro = step * self.ga + g + 1
                yield list(assignment.sequences[int(assignment.groups[g, self.dp_rank])])
        self._next_micro = 0
        self.epoch += 1

    def state_dict(self) -> dict:
        """Resume point: epoch and microbatches already yielded, plus the config it is valid for."""
        return {"epoch": self.epoch, "next_micro": self._next_micro, "seed": self.seed,
                "seq_len": self.seq_len, "gbs": self.gbs, "dp": self.dp, "pool_size": self.pool_size,
                "policy": self.policy, "num_samples": len(self.lengths)}

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict`.

        Raises:
            ValueError: the state was saved for a different seed/layout/dataset, or is out of range.
        """
        for key in ("seed", "seq_len", "gbs", "dp", "pool_size", "policy", "num_samples"):
            mine = len(self.lengths) if key == "num_samples" else getattr(self, key)
            if key in state and state[key] != mine:
                raise ValueError(f"sampler state has {key}={state[key]!r}, this sampler has {mine!r}")
        nxt = int(state.get("next_micro", 0))
        if not 0 <= nxt <= len(self):
            raise ValueError(f"sampler state next_micro={nxt} outside [0, {len(self)}]")
        self.set_epoch(int(state["epoch"]))
        self._next_micro = nxt
