"""Indexed samples: a map-style dataset whose samples are named for the proxy calls they make.

A dataset with its own ``__getitems__`` (torch's batched fetching) is left as it is.
docs/internals.md, ``mmproxy._loader.indexed``, has the rest.
"""

from __future__ import annotations

import sys
from typing import Any

import torch.utils.data

from mmproxy import _context

__all__ = ["IndexedSamples", "indexed", "unwrapped"]


def _file_of(dataset: Any, index: Any) -> str | None:
    """The file that sample ``index`` of ``dataset`` comes from, when the dataset says so."""
    if isinstance(dataset, torch.utils.data.Subset):
        return _file_of(dataset.dataset, dataset.indices[index])
    folders = sys.modules.get("torchvision.datasets")  # loaded if the dataset is one of its
    if folders is not None and isinstance(dataset, folders.DatasetFolder):
        return str(dataset.samples[index][0])
    return None


class IndexedSamples(torch.utils.data.Dataset):
    """``dataset`` (map-style), each sample fetched under its name (see the module docstring).

    Its other attributes are the dataset's own, to read, set and delete (``loader.dataset.classes``
    still works; ``loader.dataset.transform = t`` changes the dataset's transform).

    Args:
        dataset: The dataset; also the attribute ``dataset``.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (while unpickling)
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "dataset":
            object.__setattr__(self, name, value)
        else:
            setattr(self.dataset, name, value)

    def __delattr__(self, name: str) -> None:
        if name == "dataset":
            object.__delattr__(self, name)
        else:
            delattr(self.dataset, name)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        try:
            file = _file_of(self.dataset, index)
        except (IndexError, KeyError, TypeError):  # the dataset's own indexing says why
            file = None
        name = f"index {index}" + (f", file {file}" if file is not None else "")
        with _context.sample_key(name):
            return self.dataset[index]

    def __repr__(self) -> str:
        return f"IndexedSamples({self.dataset!r})"


def unwrapped(dataset: Any) -> Any:
    """The user's dataset: ``dataset`` itself, or the one an :class:`IndexedSamples` wraps."""
    return dataset.dataset if isinstance(dataset, IndexedSamples) else dataset


def indexed(dataset: Any) -> Any:
    """``dataset`` as :class:`IndexedSamples` when it is map-style and fetched one sample at a
    time; any other dataset as it is."""
    if isinstance(dataset, (torch.utils.data.IterableDataset, IndexedSamples)):
        return dataset
    if getattr(type(dataset), "__getitems__", None) is not None:
        return dataset
    return IndexedSamples(dataset)
