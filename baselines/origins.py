"""Where each registered planner's algorithm comes from: one table, read by the report.

Every name of :data:`baselines.registry.PLANNERS` has one :class:`Origin` here (a test holds the two
in step). A *competitor* is any planner that is not Libra or one of its own variants; for those the
reproduction report (``libra-bench report``) prints the repository, paths and commit that were read
to write it, or the paper that describes it when no code was read, and -- for the DistCA rows -- how
the row relates to the DistCA number the Libra paper quotes (Libra sec. 6.3). The commits here are
the ones the method's document under ``docs/methods/`` cites; a test checks that they agree.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Origin:
    """The published source of one planner's algorithm.

    Attributes:
        method: the registry name.
        algorithm: what the planner implements, in one line.
        reference: the paper (and section) that describes it.
        repository: ``owner/name`` of the code that was read; None when only a paper was.
        paths: files (and the functions in them) that were read.
        commit: the commit that was read; None when the implementation did not record one.
        doc: the file documenting the re-implementation (a ``docs/methods`` page or the module).
        paper_distca: how this row relates to the Libra paper's DistCA number (DistCA rows only).
        competitor: False for Libra and its own variants.
    """

    method: str
    algorithm: str
    reference: str
    repository: str | None = None
    paths: tuple[str, ...] = ()
    commit: str | None = None
    doc: str = ""
    paper_distca: str = ""
    competitor: bool = True


_LIBRA = "Libra (the paper this project reproduces)"

ORIGINS: dict[str, Origin] = {o.method: o for o in (
    Origin("ulysses", "DeepSpeed-Ulysses: each CP group computes its own packed sequence, head-sharded by one "
           "all-to-all", "Jacobs et al., 2023 (DeepSpeed-Ulysses); run as Libra sec. 6.1 describes it",
           doc="baselines/ulysses.py"),
    Origin("ulysses-sorted", "Ulysses with the window sorted across GA steps (Libra Alg. 1 at P = 1); not in the "
           "paper: separates the gain of cross-step sorting from that of pooling",
           "this project, from Libra sec. 2.3 and Alg. 1", doc="baselines/ulysses.py"),
    Origin("wlb-llm", "WLB-LLM's variable-length repacking and per-document CP sharding",
           "Wang et al., OSDI'25 (WLB-LLM); Libra sec. 6.1 ran the open-source implementation in DistCA's repository",
           repository="hao-ai-lab/DistCA",
           paths=("d2/planner/wlb_planner.py (packing)", "baseline/wlbllm_original/wlbllm/utils.py (sharding)"),
           doc="baselines/wlbllm.py"),
    Origin("distca", "DistCA's own planner: head/tail-pair layout, deficit filling in causal cells with the "
           "fewest-bytes-per-cell priority, tolerance 0.05", "Zhuang et al., 2026 (DistCA)",
           repository="hao-ai-lab/DistCA",
           paths=("distca/planner/planner.py (batch_to_items_general, Planner.plan_items)",
                  "tests/test_e2e_combined.py (tolerance steps, buffer retry; commit d428384)"),
           commit="04ceed770e7db1dc6a3abb4febb235c8446e2762", doc="docs/methods/distca.md",
           paper_distca="not what the paper ran: DistCA's own planning algorithm, priced by our cost model with "
                        "the jitter and the Pipeliner M = 4 credit distca-paper gets; the paper quotes no number "
                        "for it, so no paper mark is checked against this row"),
    Origin("distca-paper", "the Libra paper's emulation of DistCA: one TAP pool of all DP replicas (P = DP), "
           "FLOPs-only placement, Libra's Pipeliner", "Libra sec. 6.1 (comparison methods)",
           doc="baselines/distca_paper.py",
           paper_distca="what the paper ran: Figure 12's DistCA numbers (Libra vs DistCA, sec. 6.3) are checked "
                        "against this row"),
    Origin("dynamic-cp", "Megatron Core's dynamic context parallelism: per sample the smallest power-of-two CP "
           "group at S / CP tokens per rank, groups balanced over DP x CP", "NVIDIA Megatron Core (dynamic CP)",
           repository="NVIDIA/Megatron-LM",
           paths=("megatron/core/datasets/data_schedule.py (DefaultDynamicCPScheduler)",
                  "megatron/core/datasets/data_schedule_utils.py (dcp_gpus_needed, dcp_get_total_workload)"),
           commit="00c51e13247685110aec81e60aa3db91cbdbff7d", doc="docs/methods/dynamic-cp.md"),
    Origin("libra-tap", "Libra's Tiled Attention Pooling alone", f"{_LIBRA}, sec. 4.3",
           doc="baselines/libra_planners.py", competitor=False),
    Origin("libra-tap-vrsp", "Libra's TAP with VRSP pools", f"{_LIBRA}, sec. 4.2-4.3",
           doc="baselines/libra_planners.py", competitor=False),
    Origin("libra", "Libra: VRSP, TAP and the Pipeliner", f"{_LIBRA}, sec. 4",
           doc="baselines/libra_planners.py", competitor=False),
    Origin("libra-kt", "Libra with kernel-time-aware TAP placement (an extension, not in the paper)",
           f"this project, extending {_LIBRA} sec. 4.3", doc="baselines/libra_planners.py", competitor=False),
    Origin("libra-adaptive", "Libra with per-pool adaptive tilings and placements under the cost model (an "
           "extension, not in the paper)", f"this project, extending {_LIBRA} sec. 4",
           doc="baselines/libra_planners.py", competitor=False),
)}


def competitors() -> tuple[Origin, ...]:
    """The origins of every competitor, in the order of :data:`ORIGINS`."""
    return tuple(o for o in ORIGINS.values() if o.competitor)
