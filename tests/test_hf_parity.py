"""A Hugging Face Qwen3 with ``attn_implementation=register()`` trains exactly like the stock model.

On 2 (DP1 x CP2) and 4 (DP2 x CP2, one Libra pool of 4 workers) gloo ranks, float64: every rank
runs its contiguous slice of its DP rank's packed sequence (documents crossing the slice edges)
through the stock transformers model with a Libra or Ulysses runner, with and without gradient
checkpointing (the runner is then called again in backward); the loss and every parameter
gradient, summed over CP and DP as training does, equal the stock ``sdpa`` model run on every
document as its own sequence in this process, within 1e-9 relative. One spawn per world size
groups all cases (spawning costs seconds); the ranks also report their sorted-scheduler decisions,
which must equal this process's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks

pytest.importorskip("transformers", reason="the Hugging Face integration needs the [hf] extra (pip install -e '.[hf]')")

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

QWEN3 = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=128, vocab_size=256)
S, CP = 128, 2
# documents of each DP rank's packed sequence; the CP slice edge at 64 cuts [50, 80) and [3, 103)
SEQUENCES = ((50, 30, 47, 1), (3, 100, 25))
CASES = (("libra", False), ("libra", True), ("ulysses", False), ("ulysses", True))
TOL = 1e-9


def _docs(dp: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [[torch.randint(0, QWEN3["vocab_size"], (n,), generator=g) for n in SEQUENCES[d]] for d in range(dp)]


def _labels(dp: int) -> int:
    return sum(len(t) - 1 for seq in _docs(dp) for t in seq)


def _model(attn: str, checkpointing: bool = False):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**QWEN3), attn_implementation=attn, dtype=torch.float64)
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model.train()


def _scheduler_decisions(dp: int, dp_rank: int) -> dict:
    from libra.sampler import LibraSampler

    lengths = np.random.default_rng(4).integers(1, 200, 300)
    sampler = LibraSampler(lengths, S, 4 * dp, dp, pool_size=1, dp_rank=dp_rank, seed=4)
    return {"groups": [sampler.step(s).groups.tolist() for s in range(2)],
            "batches": [tuple(b) for _, b in zip(range(4), sampler)]}


def _runner(kind, plan, groups, shard):
    if kind == "libra":
        from libra.runtime.attention import prepare

        return prepare(plan, groups.pool)
    from baselines.ulysses_runtime import UlyssesAttention

    return UlyssesAttention(shard["sample_lengths"], groups.cp, QWEN3["num_attention_heads"],
                            QWEN3["num_key_value_heads"])


def _rank(rank: int, world: int, plan) -> dict:
    import torch.distributed as dist

    from libra.integrations.transformers import collate_packed, register, shard_packed_batch
    from libra.runtime.groups import RankGrid, build_groups

    dp = world // CP
    dp_rank, cp_rank = divmod(rank, CP)
    groups = build_groups(RankGrid(dp=dp, cp=CP, pool_size=dp), rank=rank, timeout_s=60.0)
    batch = collate_packed([{"input_ids": t} for t in _docs(dp)[dp_rank]])
    shard = shard_packed_batch(batch, cp_rank, CP)
    out = {"scheduler": _scheduler_decisions(dp, dp_rank)}
    for kind, checkpointing in CASES:
        model = _model(register(), checkpointing)
        logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"], use_cache=False,
                       cp_runner=_runner(kind, plan, groups, shard)).logits
        loss = F.cross_entropy(logits[0], shard["shift_labels"][0], ignore_index=-100, reduction="sum") / _labels(dp)
        loss.backward()
        names = [n for n, _ in model.named_parameters()]
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()] + [loss.detach().reshape(1)])
        dist.all_reduce(flat)  # replicated parameters: the training gradient is the sum over DP and CP
        grads, off = {}, 0
        for name, p in zip(names, model.parameters()):
            grads[name] = flat[off:off + p.numel()].view_as(p).clone()
            off += p.numel()
        out[(kind, checkpointing)] = (float(flat[-1]), grads)
    return out


def _reference(dp: int):
    from libra.integrations.transformers import register

    model = _model("sdpa")
    model.load_state_dict(_model(register()).state_dict())
    n, total = _labels(dp), 0.0
    for seq in _docs(dp):
        for t in seq:
            loss = F.cross_entropy(model(input_ids=t[None], use_cache=False).logits[0, :-1], t[1:], reduction="sum") / n
            loss.backward()
            total += float(loss.detach())
    return total, {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _python_plan(dp: int, monkeypatch):
    """This GA index's Libra Plan (P = DP), built on the Python/numpy TAP paths: they make the same
    choices as the numba kernels (tested in the TAP tests) without their seconds of JIT compilation."""
    import libra.jit
    from baselines.libra_planners import plan_grouped_window
    from libra.config import ParallelConfig, TapConfig, check_layout
    from libra.workload import AttentionShape

    monkeypatch.setattr(libra.jit, "compiled", lambda name: None)  # every auto choice takes Python/numpy
    par = ParallelConfig(dp=dp, cp=CP, gbs=dp, seq_len=S)
    tap = TapConfig(pool_size=dp, block_size=16, head_split=2, pipeline_chunks=2)
    shape = AttentionShape(QWEN3["num_attention_heads"], QWEN3["num_key_value_heads"], QWEN3["head_dim"])
    check_layout(par, tap, shape)
    lengths = [np.asarray(SEQUENCES[d], dtype=np.int64) for d in range(dp)]
    return plan_grouped_window("libra", lengths, np.arange(dp)[None, :], par, tap, shape, {})[0]


@pytest.mark.parametrize("world", [2, 4])
def test_hf_qwen3_with_libra_and_ulysses_runners_equals_the_stock_model(world, tmp_path, monkeypatch):
    dp = world // CP
    plan = _python_plan(dp, monkeypatch)
    if dp > 1:  # the pool really exchanges work between the two CP groups
        assert sum(int(np.sum(p.tiles.dest // CP != p.tiles.q_home // CP)) for p in plan.pools) > 0
    results = run_ranks(_rank, world, tmp_path, plan, deadline_s=240.0)
    ref_loss, ref_grads = _reference(dp)
    for case in CASES:
        loss, grads = results[0][case]
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss), case
        assert set(grads) == set(ref_grads)
        for name, g in grads.items():
            err = float((g - ref_grads[name]).norm()) / float(ref_grads[name].norm())
            assert err <= TOL, (case, name, err)
    for r, res in enumerate(results):  # the sorted scheduler decided the same on every process
        mine = _scheduler_decisions(dp, r // CP)
        assert res["scheduler"]["groups"] == mine["groups"] and res["scheduler"]["batches"] == mine["batches"]
