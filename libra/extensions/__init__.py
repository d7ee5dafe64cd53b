"""Extensions beyond the Libra paper, each one package plugged into the core through its seams.

The core (everything in ``libra/`` outside this package) never imports an extension
(``tests/test_architecture.py``). An extension reaches the core through:

* the Plan contract: a pool's ``chunking`` (:mod:`libra.plan.chunkings`, whose registry an
  extension joins through the ``libra.chunkings`` entry points in ``pyproject.toml``) and KV rows
  of ``hop > 0`` (:meth:`libra.tap.pipeline.ChunkSchedule.check_hops`), which the runtime executes
  and the cost model prices without knowing who planned them;
* :class:`libra.tap.placement.PlacementPolicy`: the order, byte cost and reserved load Alg. 2
  places with;
* the planner registry (``baselines/registry.py``), which names the extension's planners.
"""
