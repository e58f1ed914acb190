"""mmproxy: DALI pipelines in the training process, fed by ordinary PyTorch DataLoader workers.

``import mmproxy as dali_proxy`` is a drop-in for ``nvidia.dali.plugin.pytorch.experimental.proxy``.
Heavy modules (torch, DALI) load on first use, so ``import mmproxy`` and ``mmproxy --help`` are quick.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "BatchSizeError",
    "Collate",
    "CollateError",
    "DALIOutputBatchRef",
    "DALIOutputSampleRef",
    "DALIProxy",
    "DALIServer",
    "DamagedSampleError",
    "DataLoader",
    "EmptyEpochError",
    "MmproxyError",
    "PaddedBatch",
    "PipelineError",
    "Prepare",
    "ProxyArgumentError",
    "RunDroppedError",
    "SampleError",
    "SampleSeeded",
    "ServerFailedError",
    "ServerState",
    "ServerStateError",
    "ShardError",
    "SkipKind",
    "SkipLimitError",
    "SkipReport",
    "SkippedSample",
    "StateError",
    "TransportError",
    "WaitTimeoutError",
    "WorkerDiedError",
    "sample_key",
]

_WHERE = {
    "BatchSizeError": "mmproxy.errors",
    "Collate": "mmproxy.collate",
    "CollateError": "mmproxy.errors",
    "DALIOutputBatchRef": "mmproxy.refs",
    "DALIOutputSampleRef": "mmproxy.refs",
    "DALIProxy": "mmproxy.proxy",
    "DALIServer": "mmproxy.server",
    "DamagedSampleError": "mmproxy.errors",
    "DataLoader": "mmproxy.loader",
    "EmptyEpochError": "mmproxy.errors",
    "MmproxyError": "mmproxy.errors",
    "PaddedBatch": "mmproxy.refs",
    "PipelineError": "mmproxy.errors",
    "Prepare": "mmproxy.protocols",
    "ProxyArgumentError": "mmproxy.errors",
    "RunDroppedError": "mmproxy.errors",
    "SampleError": "mmproxy.errors",
    "SampleSeeded": "mmproxy.proxy",
    "ServerFailedError": "mmproxy.errors",
    "ServerState": "mmproxy.server",
    "ServerStateError": "mmproxy.errors",
    "ShardError": "mmproxy.errors",
    "SkipKind": "mmproxy.skips",
    "SkipLimitError": "mmproxy.errors",
    "SkipReport": "mmproxy.skips",
    "SkippedSample": "mmproxy.skips",
    "StateError": "mmproxy.errors",
    "TransportError": "mmproxy.errors",
    "WaitTimeoutError": "mmproxy.errors",
    "WorkerDiedError": "mmproxy.errors",
    "sample_key": "mmproxy._context",
}

if TYPE_CHECKING:
    from mmproxy._context import sample_key
    from mmproxy.collate import Collate
    from mmproxy.errors import (
        BatchSizeError,
        CollateError,
        DamagedSampleError,
        EmptyEpochError,
        MmproxyError,
        PipelineError,
        ProxyArgumentError,
        RunDroppedError,
        SampleError,
        ServerFailedError,
        ServerStateError,
        ShardError,
        SkipLimitError,
        StateError,
        TransportError,
        WaitTimeoutError,
        WorkerDiedError,
    )
    from mmproxy.loader import DataLoader
    from mmproxy.protocols import Prepare
    from mmproxy.proxy import DALIProxy, SampleSeeded
    from mmproxy.refs import DALIOutputBatchRef, DALIOutputSampleRef, PaddedBatch
    from mmproxy.server import DALIServer, ServerState
    from mmproxy.skips import SkipKind, SkippedSample, SkipReport


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'mmproxy' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
