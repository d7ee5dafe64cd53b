"""Cluster cost-model simulator (Libra sec. 5 "offline simulator", DESIGN.md sec. 5).

* :mod:`libra.sim.profiles` -- named, versioned hardware profiles (``load_profile``).
* :mod:`libra.sim.kernel` -- attention kernel timing vs segment length and heads per call.
* :mod:`libra.sim.topology` -- worker ids -> GPUs/nodes/supernodes, link classes.
* :mod:`libra.sim.cost` -- ``CostModel.price(plan) -> PlanCost`` per worker.
* :mod:`libra.sim.variability` -- seeded per-GPU, per-step speed jitter.
* :mod:`libra.sim.simulator` -- ``simulate_window`` replays one GBS window for one method.
"""
