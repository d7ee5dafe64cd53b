"""``libra-adaptive``: TAP for real corpora, beyond the Libra paper (one package, no core module
imports it).

* :mod:`~libra.extensions.adaptive.candidates`: the per-pool plans to choose from (finer tiles,
  heavy-tile cuts, retention, link pricing, relays);
* :mod:`~libra.extensions.adaptive.retention`: Q-home retention placement and speed reserves;
* :mod:`~libra.extensions.adaptive.repair`: moving work off workers Alg. 2 left overloaded;
* :mod:`~libra.extensions.adaptive.rebalance`: re-placing a chosen plan for its exposed communication;
* :mod:`~libra.extensions.adaptive.relay`: KV fan-out sent as a scatter and an all-gather (hops);
* :mod:`~libra.extensions.adaptive.tile_chunks`: the ``tiles`` Pipeliner chunking (registered in
  ``pyproject.toml``'s ``libra.chunkings`` entry points);
* :mod:`~libra.extensions.adaptive.planner`: the planner's config and its per-pool chooser;
* :mod:`~libra.extensions.adaptive.speeds`: measuring each GPU's speed (torch).
"""
