"""Errors: one root, ``MmproxyError``, with leaves that also subclass the matching built-in.

Errors raised in a server thread or a worker cross to the caller as values that keep the original
traceback text (:class:`RemoteTraceback` as ``__cause__``) and name the server, the run and, where
known, the shard and sample keys. An error that needs an optional package says what to install
(:func:`install_hint`, the one table of mmproxy's extras).
"""

from __future__ import annotations

import copy
import traceback

__all__ = [
    "BatchSizeError",
    "CollateError",
    "DamagedSampleError",
    "EmptyEpochError",
    "MmproxyError",
    "PipelineError",
    "ProxyArgumentError",
    "RemoteTraceback",
    "RunDroppedError",
    "SampleError",
    "ServerFailedError",
    "ServerStateError",
    "ShardError",
    "SkipLimitError",
    "StateError",
    "TransportError",
    "WaitTimeoutError",
    "WorkerDiedError",
    "install_hint",
]

# optional package (its import name) -> the extra of mmproxy's that installs it, and its name on PyPI
_EXTRAS = {"matplotlib": ("plot", "matplotlib"), "av": ("video", "av"),
           "obstore": ("s3", "obstore"), "moto": ("test", "moto"),
           "PyNvVideoCodec": ("nvdec", "pynvvideocodec"), "torchcodec": ("torchcodec", "torchcodec")}


def install_hint(module: str) -> str:
    """``pip install PACKAGE``, and the extra of mmproxy's that holds it, for ``module`` (an import
    name; mmproxy is installed from its checkout, so ``pip install 'mmproxy[x]'`` would not do)."""
    top = module.split(".")[0]
    extra, package = _EXTRAS.get(top, (None, top))
    return f"pip install {package}" + (f" (mmproxy's [{extra}] extra)" if extra else "")


class MmproxyError(Exception):
    """Root of every error mmproxy raises."""


class ProxyArgumentError(MmproxyError, ValueError):
    """A proxy was called with arguments that do not match the pipeline's inputs."""


class BatchSizeError(MmproxyError, ValueError):
    """A collated batch holds more samples than the pipeline's ``batch_size``."""


class CollateError(MmproxyError, ValueError):
    """A batch's references break its integrity: different servers or outputs collated into one
    field, a proxy output left uncollated, or a reference of a server the batch's collate or
    loader was not given."""


class ServerStateError(MmproxyError, RuntimeError):
    """A server was used in a state that does not allow it (not started, stopped)."""


class ServerFailedError(ServerStateError):
    """A server failed; every later call raises this, pointing at the first error."""


class PipelineError(MmproxyError, RuntimeError):
    """The DALI pipeline raised while running a batch."""


class RunDroppedError(MmproxyError, RuntimeError):
    """A batch reference points at a run the server dropped (abandoned epoch, old server)."""


class TransportError(MmproxyError, RuntimeError):
    """Inputs could not be sent from a worker to a server."""


class WaitTimeoutError(MmproxyError, TimeoutError):
    """Waiting for a server's outputs took longer than the server's ``timeout``."""


class WorkerDiedError(MmproxyError, RuntimeError):
    """A DataLoader worker died (killed, crashed) while handing a batch to the main process."""


class SampleError(MmproxyError, ValueError):
    """A sample is bad (missing, empty or corrupt field); names the shard and the sample key."""


class DamagedSampleError(SampleError):
    """Raised by a :class:`~mmproxy.Prepare` stage for a sample whose data it cannot prepare (a
    clip that does not decode): the sample is dropped in skip mode. Any other error is the stage's own."""


class ShardError(MmproxyError, ValueError):
    """A shard list is empty or cannot be split among ranks and workers."""


class StateError(MmproxyError, ValueError):
    """A saved state that this code cannot load: another version, or keys it does not know or
    lacks; names the part of the state (loader, dataset stage) and what is wrong."""


class EmptyEpochError(MmproxyError, RuntimeError):
    """An epoch delivered no sample: every shard or sample was unreadable or skipped."""


class SkipLimitError(MmproxyError, RuntimeError):
    """More samples were skipped than the dataset's ``max_skipped`` fraction allows.

    Besides its message: ``counted`` (what was skipped, of how many), ``limit`` (the fraction
    allowed) and ``summary`` (the epoch's skip summary), for callers that word it their own way
    (the CLI names its ``--max-skipped`` option).
    """

    def __init__(self, counted: str, limit: float, summary: str) -> None:
        super().__init__(f"{counted}, more than max_skipped={limit:.1%} "
                         f"(raise max_skipped to accept it):\n{summary}")
        self.counted, self.limit, self.summary = counted, limit, summary

    def __reduce__(self) -> tuple[object, ...]:  # picklable with its fields
        return (type(self), (self.counted, self.limit, self.summary))


class RemoteTraceback(Exception):
    """Carries the formatted traceback of an error raised in another thread or process."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text


def with_remote_cause(error: BaseException, original: BaseException) -> BaseException:
    """Attaches ``original``'s traceback text to ``error`` as its cause and returns ``error``."""
    text = "".join(traceback.format_exception(type(original), original, original.__traceback__))
    error.__cause__ = RemoteTraceback(text)
    return error


def fresh_copy(error: BaseException | None) -> BaseException:
    """A copy of a stored ``error`` to raise, with its cause. Raising the stored one again would
    give it a traceback whose frames hold its owner (a server: a reference cycle)."""
    if error is None:
        raise ValueError("no stored error to raise")
    new = copy.copy(error)
    new.__cause__ = error.__cause__
    return new
