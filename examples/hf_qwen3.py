"""Train a Hugging Face Qwen3 with Libra attention on DP x CP local processes, check it exactly.

    python examples/hf_qwen3.py --nproc 2 --steps 2          # DP1 x CP2
    python examples/hf_qwen3.py --nproc 4 --steps 2          # DP2 x CP2, one Libra pool of 4 workers
    python examples/hf_qwen3.py --nproc 4 --planner libra-adaptive   # the real-corpus planner's plans
    torchrun --nproc-per-node 4 examples/hf_qwen3.py --steps 2

What a trainer writes (Libra sec. 5): the stock ``AutoModelForCausalLM`` with
``attn_implementation=register()``; a :class:`~libra.sampler.LibraSampler` as the DataLoader's
batch sampler (fixed-token packing + VRSP per optimizer step) with :func:`collate_packed`; an
:class:`~libra.runtime.async_planner.AsyncPlanner` that plans step ``s + 1`` and compiles this
rank's programs while step ``s`` trains; per microbatch :func:`shard_packed_batch` (this rank's
contiguous ``S / CP`` tokens, labels shifted first) and ``prepare(program, pool)``, the runner
every layer reuses (``cp_runner=`` keyword of ``model(...)``). ``--runner ulysses`` swaps in the
Ulysses runtime with the same sampler at ``pool_size=1`` (the sorted VRSP schedule for any CP
method).

The check: the stock transformers Qwen3 (``attn_implementation="sdpa"``) in one process, same
initial weights, each document (piece) run as its own sequence, same AdamW steps. Loss on both
sides = sum of token losses / non-ignored labels of the global batch. The last line printed is
``loss_rel_err=<x> grad_rel_err=<y>``: the largest relative loss error over steps and the largest
``||g - g_ref|| / ||g_ref||`` over parameters and steps (gradients summed over DP and CP ranks).

While it runs, every step's loss is printed as the step finishes, and stderr gets a line at least
every 10 s saying what is running (ranks starting, step N of M, the reference), so a log shows it
is alive. A rank that fails or dies ends the run within seconds naming it; Ctrl-C says how many
steps had finished. The example keeps no checkpoint (``libra-bench train`` does, and resumes).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys
import threading
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from libra.config import TapConfig
from libra.integrations.transformers import (
    IGNORE_INDEX,
    PieceFeatures,
    collate_packed,
    register,
    shard_packed_batch,
)
from libra.sampler import LibraSampler

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
# TAP's B and M sized for this toy model on purpose (the paper: B = 4096-8192, M = 4); H is TapConfig's
BLOCK, HEAD_SPLIT, CHUNKS = 32, TapConfig.head_split, 2


def model_config():
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, intermediate_size=128, vocab_size=256)


def build_model(attn_implementation: str, args, checkpointing: bool = False):
    """The tiny random-init Qwen3; the seed makes every process build the same weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(model_config(), attn_implementation=attn_implementation,
                                             dtype=DTYPES[args.dtype])
    if checkpointing:  # layers are recomputed in backward: the runner is called twice per layer
        model.gradient_checkpointing_enable()
    return model.train()


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of the token cross-entropies (bfloat16 logits upcast; float64 kept)."""
    logits = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def make_dataset(args) -> list[dict]:
    """A tokenized dataset (rows with ``input_ids``, as ``datasets`` gives): long-tailed document
    lengths, random tokens, seeded; enough rows for ``--steps`` optimizer steps."""
    rng = np.random.default_rng(args.seed)
    rows, total = [], 0
    while total < (args.steps + 1) * args.gbs * args.seq_len:
        n = int(np.clip(rng.lognormal(3.5, 1.0), 1, 2 * args.seq_len))
        rows.append({"input_ids": rng.integers(0, 256, n).tolist()})
        total += n
    return rows


def make_sampler(rows, args, dp_rank: int) -> LibraSampler:
    """VRSP per optimizer step: Libra's pools of P = DP replicas; for another CP method P = 1 (the
    window's sequences sorted by sum l^2 across GA steps, identical on every rank)."""
    pool = args.dp if args.runner == "libra" else 1
    lengths = [len(r["input_ids"]) for r in rows]
    return LibraSampler(lengths, args.seq_len, args.gbs, args.dp, pool_size=pool, dp_rank=dp_rank, seed=args.seed)


def plan_step(args, shape, metadata: dict):
    """TAP plans of every GA index of one step from its sequence lengths (the sampler made the pools),
    by ``--planner`` (the paper's ``libra``, ``libra-kt`` or ``libra-adaptive``)."""
    from baselines.registry import get_planner
    from libra.config import ParallelConfig

    par = ParallelConfig(dp=args.dp, cp=args.cp, gbs=args.gbs, seq_len=args.seq_len)
    tap = TapConfig(pool_size=args.dp, block_size=BLOCK, head_split=HEAD_SPLIT, pipeline_chunks=CHUNKS)
    planner = get_planner(args.planner, tap=tap)
    return planner.plan_groups(metadata["lengths"], metadata["groups"], par, shape, {"step": metadata["step"]})


def step_metadata(sampler: LibraSampler, step: int) -> dict:
    a = sampler.step(step)
    return {"step": step, "groups": a.groups, "lengths": [a.sample_lengths(i) for i in range(len(a.sequences))]}


class Trainer:
    """One rank of the DP x CP run: its groups, model, optimizer, data and planner."""

    def __init__(self, args, rank: int, rows):
        from libra.runtime.async_planner import AsyncPlanner
        from libra.runtime.groups import RankGrid, build_groups
        from libra.workload import AttentionShape

        self.args, self.rank = args, rank
        self.dp_rank, self.cp_rank = divmod(rank, args.cp)
        pool = args.dp if args.runner == "libra" else 1
        self.groups = build_groups(RankGrid(dp=args.dp, cp=args.cp, pool_size=pool), rank=rank, timeout_s=120.0)
        self.model = build_model(register(), args, args.gradient_checkpointing)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        self.sampler = make_sampler(rows, args, self.dp_rank)
        self.batches = iter(torch.utils.data.DataLoader(PieceFeatures(rows), batch_sampler=self.sampler,
                                                        collate_fn=collate_packed))
        cfg = self.model.config
        self.shape = AttentionShape(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.planner = None
        if args.runner == "libra":  # plans (and this worker's compiled programs) one step ahead
            self.planner = AsyncPlanner(functools.partial(plan_step, args, self.shape), max_pending=2,
                                        compile_for=self.groups.pool.worker, keep_plans=False)
            self.planner.submit(0, step_metadata(self.sampler, 0))

    def runner(self, step: int, ga_index: int, programs, shard):
        from libra.runtime.attention import prepare

        if programs is not None:
            return prepare(programs[ga_index], self.groups.pool, verify_plan=step == 0)
        from baselines.ulysses_runtime import UlyssesAttention

        return UlyssesAttention(shard["sample_lengths"], self.groups.cp, self.shape.num_q_heads, self.shape.num_kv_heads)

    def step(self, step: int) -> tuple[float, dict]:
        """One optimizer step; returns the global loss and the gradients summed over all ranks."""
        args, programs = self.args, None
        if self.planner is not None:
            if step + 1 < args.steps:
                self.planner.submit(step + 1, step_metadata(self.sampler, step + 1))
            programs = self.planner.get(step, timeout=300.0).programs  # one per GA index
        shards = [shard_packed_batch(next(self.batches), self.cp_rank, args.cp) for _ in range(args.gbs // args.dp)]
        n_labels = torch.tensor(float(sum(int((s["shift_labels"] != IGNORE_INDEX).sum()) for s in shards)),
                                dtype=torch.float64)
        dist.all_reduce(n_labels)  # labels of the global batch: every rank divides by the same count
        loss_sum = torch.zeros((), dtype=torch.float64)
        for g, shard in enumerate(shards):
            logits = self.model(input_ids=shard["input_ids"], position_ids=shard["position_ids"], use_cache=False,
                                cp_runner=self.runner(step, g, programs, shard)).logits
            loss = token_loss_sum(logits[0], shard["shift_labels"][0]) / n_labels
            loss.backward()
            loss_sum += loss.detach().double()
        flat = torch.cat([p.grad.reshape(-1) for p in self.model.parameters()])
        dist.all_reduce(flat)  # parameters are replicated over DP and CP: sum every rank's share
        grads, off = {}, 0
        for name, p in self.model.named_parameters():
            p.grad.copy_(flat[off:off + p.numel()].view_as(p))
            grads[name] = p.grad.detach().clone()
            off += p.numel()
        dist.all_reduce(loss_sum)
        self.opt.step()
        self.opt.zero_grad()
        return float(loss_sum), grads

    def close(self) -> None:
        if self.planner is not None:
            self.planner.close()


class Heartbeat:
    """What the example is doing, printed as steps finish (stdout) and at least every ``every_s``
    seconds while nothing finishes (stderr): the ranks start for seconds and a step can take long."""

    def __init__(self, steps: int, every_s: float = 9.0):
        self.steps, self.every_s, self.done, self.phase = steps, every_s, 0, "starting the ranks"
        self.start = self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(1.0):
            if time.monotonic() - self.last >= self.every_s:
                self.last = time.monotonic()
                print(f"hf_qwen3: {self.phase}; {self.done} of {self.steps} steps done, "
                      f"{self.last - self.start:.0f} s elapsed", file=sys.stderr, flush=True)

    def step(self, message: dict) -> None:
        self.done += 1
        self.last = time.monotonic()
        self.phase = f"step {self.done} of {self.steps}" if self.done < self.steps else "finishing"
        print(f"step {message['step']}: loss {message['loss']:.6f} ({self.last - self.start:.0f} s)", flush=True)


def train_rank(rank: int, world: int, args, send=None) -> dict | None:
    """Run ``args.steps`` steps on this rank (process group initialised); results on rank 0, which
    also hands every step's loss to ``send`` as it finishes."""
    trainer = Trainer(args, rank, make_dataset(args))
    records = []
    try:
        for s in range(args.steps):
            records.append(trainer.step(s))
            if rank == 0 and send is not None:
                send({"step": s, "loss": records[-1][0]})
    finally:
        trainer.close()
    return {"losses": [r[0] for r in records], "grads": [r[1] for r in records]} if rank == 0 else None


def reference(args) -> dict:
    """Stock transformers Qwen3 (sdpa) in one process: every document (piece) of the step as its own
    sequence, the same global-batch loss normalisation and optimizer."""
    rows = make_dataset(args)
    features, sampler = PieceFeatures(rows), make_sampler(rows, args, 0)
    model = build_model("sdpa", args)
    model.load_state_dict(build_model(register(), args).state_dict())  # the very weights the ranks start from
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, grads = [], []
    for step in range(args.steps):
        docs = [torch.tensor(features[p]["input_ids"]) for seq in sampler.step(step).sequences for p in seq]
        n_labels = sum(len(d) - 1 for d in docs)
        total = 0.0
        for d in docs:
            if len(d) < 2:
                continue  # one token: nothing to predict
            logits = model(input_ids=d[None], use_cache=False).logits
            loss = token_loss_sum(logits[0, :-1], d[1:]) / n_labels
            loss.backward()
            total += float(loss.detach())
        losses.append(total)
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads}


def compare(got: dict, ref: dict) -> tuple[float, float]:
    """(max relative loss error over steps, max over steps and parameters of ||g - g_ref|| / ||g_ref||)."""
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    grad_err = 0.0
    for g, r in zip(got["grads"], ref["grads"]):
        for name, gr in r.items():
            d = float((g[name].double() - gr.double()).norm())
            grad_err = max(grad_err, d / float(gr.double().norm()) if gr.norm() > 0 else d)
    return loss_err, grad_err


def run_torchrun(args, beat: Heartbeat) -> dict | None:
    """Inside torchrun: join its world (gloo on CPU); rank 0 returns the results."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    try:
        if dist.get_world_size() != args.nproc:
            raise SystemExit(f"--nproc {args.nproc} differs from the torchrun world size {dist.get_world_size()}")
        torch.set_num_threads(1)
        return train_rank(dist.get_rank(), args.nproc, args, beat.step)
    finally:
        dist.destroy_process_group()


def run_spawned(args, beat: Heartbeat) -> dict:
    from libra.runtime.launch import (
        RankDeadlineError,
        RankFailure,
        raise_first_failure,
        relayed_messages,
        run_local_ranks,
    )

    with relayed_messages(beat.step) as (messages, poll):
        try:
            records = run_local_ranks(train_rank, args.nproc, args, messages.send, deadline_s=args.timeout,
                                      pg_timeout_s=120.0, what="hf_qwen3 ranks", poll=poll)
            poll()
            return raise_first_failure(records, "hf_qwen3 ranks")[0]
        except (RankFailure, RankDeadlineError) as exc:
            raise SystemExit(f"error: {exc}") from None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nproc", type=int, default=None,
                    help="local processes = DP x CP (default 2; under torchrun its world size)")
    ap.add_argument("--cp", type=int, default=2, help="context-parallel degree")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per packed sequence S")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float64")
    ap.add_argument("--runner", choices=("libra", "ulysses"), default="libra")
    ap.add_argument("--planner", choices=("libra", "libra-kt", "libra-adaptive"), default="libra",
                    help="TAP planner of the libra runner")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="deadline of the whole spawned run (s)")
    args = ap.parse_args(argv)
    args.torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # started by torchrun
    if args.nproc is None:
        args.nproc = int(os.environ["WORLD_SIZE"]) if args.torchrun else 2
    if args.nproc < 1 or args.cp < 1 or args.nproc % args.cp or args.seq_len % (args.cp * BLOCK):
        ap.error(f"need CP | nproc and CP x {BLOCK} | seq-len; got nproc={args.nproc}, cp={args.cp}, "
                 f"seq-len={args.seq_len}")
    args.dp = args.nproc // args.cp
    args.gbs = 2 * args.dp  # two GA steps per optimizer step: VRSP decides which sequence trains when
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")  # the last line must be the result (the spec of this check)
    with Heartbeat(args.steps) as beat:
        try:
            got = run_torchrun(args, beat) if args.torchrun else run_spawned(args, beat)
        except KeyboardInterrupt:
            print(f"\ninterrupted after {beat.done} of {args.steps} steps (their losses are printed above); this "
                  "example keeps no checkpoint: rerun it to start again", file=sys.stderr, flush=True)
            return 130
        if got is None:  # a torchrun rank other than 0
            return 0
        beat.phase = "the single-process reference (stock transformers, sdpa)"
        ref = reference(args)
    loss_err, grad_err = compare(got, ref)
    sys.stdout.flush()
    print(f"loss_rel_err={loss_err:.3e} grad_rel_err={grad_err:.3e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
