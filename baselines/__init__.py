"""Every attention method as a planner returning :class:`libra.plan.Plan` (DESIGN.md sec. 2).

Look planners up with :func:`baselines.registry.get_planner`; the names are ``ulysses``,
``wlb-llm``, ``distca``, ``libra-tap``, ``libra-tap-vrsp`` and ``libra`` (Libra sec. 6.1).
Planner modules import numpy but never torch.
"""
