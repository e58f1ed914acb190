"""The stages of a worker's chain: shard plan, reader, shuffle buffer, source mixer,
fields, batcher and position stamp, each with its state, and the elastic reshard over them."""

from __future__ import annotations

__all__: list[str] = []  # its modules are the public names
