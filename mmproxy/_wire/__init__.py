"""The wire: how a run travels from a worker to a server (memfd header layout, shard
mappings by reference, the Unix socket and its folder)."""
