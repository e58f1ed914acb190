"""The loader's saved state: one versioned, typed value; states of other versions refused."""

from __future__ import annotations

import copy

import pytest
from mmproxy.datasets import MultiModalDataset

import mmproxy
from mmproxy.state import LoaderState
from mmproxy.testing import write_tar

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("states")
    for s in range(5):
        write_tar(root / f"m-{s}.tar", [{"__key__": f"m{s}-{k}", "txt": f"m {s} {k}"}
                                        for k in range(7)])
    return root


@pytest.fixture(scope="module")
def server():
    from conftest import add_sub_pipe, cpu

    with mmproxy.DALIServer(cpu(add_sub_pipe), name="addsub") as server:
        yield server


def _single(root):
    return MultiModalDataset(str(root / "m-{0..4}.tar"), {"text": ("txt", bytes.decode)},
                             batch_size=3, shuffle_buffer=5, seed=11)


# A loader state of the first version: per worker an entry of the dataset's old position.
_FIRST = {"version": 1, "epoch": 1, "done": False, "rank": 0, "world": 1, "workers": 1,
          "batches": 2, "next": 0, "report": None,
          "states": {"0": {"worker": 0, "workers": 1, "quota": None,
                           "state": {"made": 2, "batch": [], "urls": []}}}}


def test_a_state_of_the_first_version_is_refused(root, server):
    loader = _single(root).loader(server, num_workers=1)
    with pytest.raises(mmproxy.StateError, match=r"\(version 2\): its version is 1"):
        loader.load_state_dict(copy.deepcopy(_FIRST))


def test_a_worker_position_of_the_first_version_is_refused(root, server):
    loader = _single(root).loader(server, num_workers=1)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    state["positions"][0] = copy.deepcopy(_FIRST["states"]["0"])
    resumed = _single(root).loader(server, num_workers=1)
    with pytest.raises(mmproxy.StateError, match="position state"):
        resumed.load_state_dict(state)
        next(iter(resumed))


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


def test_a_worker_s_position_travels_packed_and_is_read_when_asked(root):
    """From a worker, each batch's position arrives as bytes; the loader keeps them as they came
    and reads them only for a state, which holds the dataset's own values."""
    import pickle
    from multiprocessing.reduction import ForkingPickler

    from mmproxy._context import Packed, Stamped, unpacked

    position = {"held": [(0, 1, 2)] * 3, "rng": {"state": 2**100}}
    arrived = pickle.loads(ForkingPickler.dumps(Stamped({"x": 1}, 2, position)))
    assert isinstance(arrived.state, Packed) and unpacked(arrived.state) == position
    assert pickle.loads(ForkingPickler.dumps(arrived)).state == arrived.state  # not packed twice

    dataset = MultiModalDataset(str(root / "m-{0..4}.tar"), {"txt": ("txt", bytes)}, batch_size=3,
                                seed=1)
    loader = dataset.loader([], num_workers=2, persistent_workers=True)
    it = iter(loader)
    next(it)
    kept = list(loader._progress.positions.values())  # noqa: SLF001 - what the loader holds
    assert kept and all(isinstance(p, Packed) for p in kept)
    state = loader.state_dict()
    positions = list(state["positions"].values())
    assert positions and all(p["batcher"]["made"] >= 1 for p in positions)  # the dataset's own
    del it
