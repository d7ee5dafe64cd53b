"""Hooks that put Libra into other training frameworks through their public extension points.

* :mod:`~libra.integrations.transformers`: a Hugging Face ``transformers`` attention function
  (``attn_implementation=register()``) that runs a prepared Libra (or Ulysses) runner, and the
  packed-batch sharder.

Submodules are imported on demand; importing this package imports neither torch nor the
framework, and nothing else in ``libra`` imports them.
"""
