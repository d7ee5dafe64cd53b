"""The Libra runtime: executes Plans over torch.distributed (Libra sec. 4.3.3, 4.4, 5).

* :mod:`~libra.runtime.kernels`: causal varlen attention backends with forward/backward and lse.
* :mod:`~libra.runtime.program`: compiles one worker's share of a PoolPlan into index arrays.
* :mod:`~libra.runtime.executor`: moves the packed per-(src, dst) buffers (p2p or all-to-all).
* :mod:`~libra.runtime.calls`: a chunk's kernel work as backend calls on views of the buffers it reads.
* :mod:`~libra.runtime.attention`: ``libra_attention`` / ``prepare`` (autograd op with Pipeliner).
* :mod:`~libra.runtime.groups`: DP x CP rank grid, pool/CP/DP process groups, bounded waits.
* :mod:`~libra.runtime.agreement`: plan-digest and execution-option agreement, non-finite input checks.
* :mod:`~libra.runtime.async_planner`: background planning of upcoming steps.

Submodules are imported on demand (``from libra.runtime.attention import libra_attention``), so
importing this package does not import torch.
"""
