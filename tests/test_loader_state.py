"""The loader's saved state: one versioned, typed value; states of the first version still load."""

from __future__ import annotations

import collections
import copy

import pytest
from main_states import CASES
from mmproxy.datasets import MultiModalDataset, Source

import mmproxy
from mmproxy.state import LoaderState
from mmproxy.testing import write_tar

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The shards the states of ``main_states`` were saved over."""
    root = tmp_path_factory.mktemp("main-states")
    for s in range(5):
        write_tar(root / f"m-{s}.tar", [{"__key__": f"m{s}-{k}", "txt": f"m {s} {k}"}
                                        for k in range(7)])
        write_tar(root / f"n-{s}.tar", [{"__key__": f"n{s}-{k}", "txt": f"n {s} {k}"}
                                        for k in range(4)])
    return root


@pytest.fixture(scope="module")
def server():
    from conftest import add_sub_pipe, cpu

    with mmproxy.DALIServer(cpu(add_sub_pipe), name="addsub") as server:
        yield server


def _single(root):
    return MultiModalDataset(str(root / "m-{0..4}.tar"), {"text": ("txt", bytes.decode)},
                             batch_size=3, shuffle_buffer=5, seed=11)


def _mixed(root):
    text = {"text": ("txt", bytes.decode)}
    return MultiModalDataset(sources=[Source(str(root / "m-{0..4}.tar"), text, 2, "M"),
                                      Source(str(root / "n-{0..4}.tar"), text, 1, "N")],
                             batch_size=3, shuffle_buffer=4, seed=5, epoch_length=7)


def _state(name, root):
    """The saved state of ``main_states``, its shard paths pointing at ``root``."""
    def placed(value):
        if isinstance(value, str):
            return value.replace("{root}", str(root))
        if isinstance(value, dict):
            return {k: placed(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(placed(v) for v in value)
        return value
    return placed(copy.deepcopy(CASES[name]["state"]))


def _keys(loader, epochs):
    return [list(b["__key__"]) for _ in range(epochs) for b in loader]


@pytest.mark.parametrize("name,build", [("single", _single), ("mixed", _mixed)])
def test_a_state_saved_before_the_stages_resumes_exactly(root, server, name, build):
    """The rest of that epoch and the next one are the batches the old code delivered."""
    loader = build(root).loader(server, num_workers=CASES[name]["workers"])
    loader.load_state_dict(_state(name, root))
    assert _keys(loader, 2) == CASES[name]["rest"]


def test_an_elastic_state_saved_before_the_stages_delivers_the_rest_once(root, server):
    rest = collections.Counter(k for batch in CASES["single"]["rest"][:8] for k in batch)
    loader = _single(root).loader(server, num_workers=3)
    loader.load_state_dict(_state("elastic", root))
    assert collections.Counter(k for batch in _keys(loader, 1) for k in batch) == rest
    again = _single(root).loader(server, num_workers=2)  # elastic once more: 3 -> 2 workers
    again.load_state_dict(_state("elastic", root))
    assert collections.Counter(k for batch in _keys(again, 1) for k in batch) == rest


def test_a_finished_state_saved_before_the_stages_starts_the_next_epoch(root, server):
    loader = _single(root).loader(server, num_workers=2)
    loader.load_state_dict(_state("done", root))
    assert _keys(loader, 1) == CASES["single"]["rest"][8:]  # epoch 2 of the old run
    assert loader.state_dict()["epoch"] == 2


def test_a_saved_state_is_typed_and_round_trips(root, server):
    loader = _single(root).loader(server, num_workers=2)
    it = iter(loader)
    for _ in range(3):
        next(it)
    saved = loader.state_dict()
    state = LoaderState.from_dict(saved)
    assert (state.epoch, state.done, state.batches, state.workers) == (1, False, 3, 2)
    assert state.to_dict() == saved and saved["version"] == 2
    del it


@pytest.mark.parametrize("change,message", [
    (lambda s: s.update(version=7), "its version is 7"),
    (lambda s: s.update(extra=1), r"unknown keys \['extra'\]"),
    (lambda s: s["positions"][0]["batcher"].update(made2=1), r"batcher state .*unknown keys"),
    (lambda s: s["positions"][0]["batcher"]["fields"].update(version=3),
     "fields state is of version 3"),
    (lambda s: s["positions"][0]["batcher"]["fields"]["mixer"]["sources"].update(
        other=s["positions"][0]["batcher"]["fields"]["mixer"]["sources"]["source0"]),
     r"sources \['other', 'source0'\]"),
])
def test_a_state_that_does_not_fit_is_refused_naming_the_part(root, server, change, message):
    loader = _single(root).loader(server, num_workers=1)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    change(state)
    resumed = _single(root).loader(server, num_workers=1)
    with pytest.raises(mmproxy.StateError, match=message):
        resumed.load_state_dict(state)
        next(iter(resumed))


def test_the_contracts_between_loader_dataset_and_proxies_are_protocols(root, server):
    from mmproxy.protocols import ChecksLoader, LimitsSkips, Proxy, Reshardable

    dataset = _single(root)
    assert isinstance(dataset, ChecksLoader | LimitsSkips | Reshardable)
    assert all(isinstance(dataset, p) for p in (ChecksLoader, LimitsSkips, Reshardable))
    assert isinstance(server.proxy, Proxy) and not isinstance(bytes.decode, Proxy)
    plain = MultiModalDataset(str(root / "m-0.tar"), {"text": bytes.decode, "n": server.proxy},
                              batch_size=2)
    assert [f.server for f in plain.fields.values()] == [False, True]


def test_a_dataset_of_its_own_is_judged_by_the_members_it_has(server):
    """No base class to inherit: a dataset with ``max_skipped`` gets the loader's skip limits."""
    import torch

    class Lossy(torch.utils.data.IterableDataset):
        max_skipped = 0.2

        def __iter__(self):
            for i in range(4):
                yield {"x": torch.zeros(2), "__skipped__": [mmproxy.SkippedSample("s", f"{i}", "bad")]}

    with pytest.raises(mmproxy.SkipLimitError, match="max_skipped=20.0%"):
        for _ in mmproxy.DataLoader(server, Lossy(), batch_size=None):
            pass
