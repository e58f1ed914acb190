"""Synthetic media and shard sets behind :mod:`mmproxy.testing`."""
