"""Bench: the same data through mmproxy, plain PyTorch, DALI's proxy and a pure DALI reader.
docs/internals.md, ``mmproxy.apps.bench``, has the rest.
"""

from mmproxy.apps.bench.session import run

__all__ = ["run"]
