"""Every attention method as a planner returning :class:`libra.plan.Plan` (DESIGN.md sec. 2).

Look planners up with :func:`baselines.registry.get_planner`; the paper's methods are ``ulysses``,
``wlb-llm``, ``distca-paper`` (its DistCA emulation), ``libra-tap``, ``libra-tap-vrsp`` and ``libra``
(Libra sec. 6.1); ``distca`` (DistCA's own planner) and ``dynamic-cp`` (Megatron Core's dynamic
context parallelism) are re-implemented from their authors' code.
Planner modules import numpy but never torch.
"""
