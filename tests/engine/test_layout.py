"""A run's header as columns: the server rebuilds the Request a server in the worker's own
process is handed (the same keys, the same arrays), and refuses a header that does not fit."""

from __future__ import annotations

import mmap
import os
import pickle
import struct

import numpy as np
import pytest
from datasets_for_tests import grid

from mmproxy._context import SampleId
from mmproxy._wire import layout as _layout
from mmproxy._wire import mappings as _mappings
from mmproxy._wire import transport as _transport
from mmproxy.errors import TransportError


def _registered(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data)
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        _transport.register_file_mapping(mapping, f.fileno())
    return mapping


def _across(keys, inputs):
    """The Request the server unpacks, and the header's keys as packed."""
    fd, files = _transport.pack("run-1", ("loader", 3), keys, inputs)
    try:
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mm:
            (size,) = struct.unpack_from("<Q", mm, 4)
            header = pickle.loads(mm[12:12 + size])
        return _transport.unpack([fd, *files]), header, files
    finally:
        os.close(fd)


def _same_request(got, run_id, tag, keys, inputs):
    """What a server in this process would be handed: Request(run_id, tag, keys, inputs)."""
    assert (got.run_id, got.tag) == (run_id, tag)
    assert got.keys == keys
    assert [[type(v) for v in k] for k in got.keys] == [[type(v) for v in k] for k in keys]
    assert len(got.inputs) == len(inputs)
    for received, sent in zip(got.inputs, inputs):
        assert len(received) == len(sent)
        for b, a in zip(received, sent):
            assert (b.shape, b.dtype.str) == (a.shape, a.dtype.str)
            np.testing.assert_array_equal(b, a)


def test_a_run_crosses_as_the_request_a_local_server_gets(tmp_path):
    first = _registered(tmp_path, "a.tar", os.urandom(5000))
    second = _registered(tmp_path, "b.tar", os.urandom(3000))
    views = [np.frombuffer(first, np.uint8)[100:900], np.frombuffer(second, np.uint8)[7:2000],
             np.frombuffer(first, np.uint8)[4000:4999], np.arange(300, dtype=np.uint8),
             np.frombuffer(second, np.uint8)[:0]]
    keys = [SampleId("k0", "a.tar", True, 0), SampleId("k1", "b.tar", True, 2**64 - 1),
            SampleId("k2", "a.tar", True, None), SampleId("k3", None, True, 12345),
            SampleId("", "a.tar", True, 7)]
    drawn = [grid(i, (2,), "f4") for i in range(5)]
    flips = [np.array(i % 2, np.int32) for i in range(5)]
    inputs = [views, drawn, flips]
    got, header, files = _across(keys, inputs)
    _same_request(got, "run-1", ("loader", 3), keys, inputs)
    assert len(files) == 2  # each file once, however its views are spread
    assert header[2] is True and got.skip is True  # the run's policy, once
    assert isinstance(header[3], _layout.KeyColumns)  # no SampleId object per sample
    assert header[3].shards == ["a.tar", "b.tar", None]
    placed = header[4][0]
    where = placed.files.tolist()
    assert where[0] == where[2] != where[1] and where[3] == -1 and placed.shapes is None
    assert placed.offsets.tolist()[:3] == [100, 7, 4000]


@pytest.mark.parametrize("keys", [
    [None, None],
    [SampleId("a", "s", True, None), None],
    [SampleId("a", "s", True, np.uint64(5)), SampleId("b", "s", True, 1)],
    [SampleId("a", "s", True, -1), SampleId("b", "s", True, 1)],
    [SampleId("a", "s", True, 2**70), SampleId("b", "s", True, 1)],
    [SampleId("a", b"s", True, 1), SampleId("b", "s", True, 1)],
    [SampleId("a", "s", 1, 1), SampleId("b", "s", True, 1)],
], ids=["none", "some none", "numpy seed", "negative seed", "seed past 64 bits", "bytes shard",
        "int flag"])
def test_keys_the_columns_cannot_keep_exactly_cross_as_they_are(keys):
    inputs = [[np.arange(3, dtype=np.uint8), np.arange(4, dtype=np.uint8)]]
    got, header, _ = _across(keys, inputs)
    assert header[3] == keys and got.keys == keys
    assert [[type(v) for v in k] if k else None for k in got.keys] == [
        [type(v) for v in k] if k else None for k in keys]


def test_an_input_of_arrays_of_several_ndims_crosses_whole():
    arrays = [np.array(3.0, np.float64), grid(1, (2, 3), "f8"), grid(2, (4,), "f8")]
    got, header, _ = _across([None] * 3, [arrays])
    assert header[4][0].shapes == [(), (2, 3), (4,)]
    for b, a in zip(got.inputs[0], arrays):
        assert b.shape == a.shape
        np.testing.assert_array_equal(b, a)


def test_an_input_whose_samples_differ_in_dtype_is_refused():
    with pytest.raises(TransportError, match="must share a dtype: <f4 vs <i4"):
        _transport.pack("r", None, [None, None], [[np.zeros(2, np.float32), np.zeros(2, np.int32)]])


def _memfd(size):
    fd = os.memfd_create("test")
    os.ftruncate(fd, size)
    try:
        return mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def _placed(files, offsets, nbytes, shapes=None, dtype="|u1"):
    return _layout.Placed(dtype, np.array(files, np.int64), np.array(offsets, np.int64),
                          np.array(nbytes, np.int64), shapes)


@pytest.mark.parametrize("placed,message", [
    (_placed([-1], [60], [10]), "outside the buffers"),
    (_placed([0], [0], [10]), "names file 0 of 0 sent"),
    (_placed([-1], [-4], [2]), "outside the buffers"),
    (_placed([-1, -1], [0], [2, 2]), "columns of different lengths"),
    (_placed([-1], [0], [3], dtype="<f4"), "outside the buffers"),
], ids=["past the end", "no such file", "negative offset", "short column", "part of an item"])
def test_a_layout_that_does_not_fit_its_buffers_is_refused(placed, message):
    memfd = _memfd(128)
    with pytest.raises(TransportError, match=message):
        _layout.arrays(placed, memfd, 64, [])


def test_a_header_column_cut_short_is_refused():
    placed = _placed([-1, -1], [0, 64], [2, 2], shapes=np.array([[2], [2]]))
    function, (dtype, files, offsets, nbytes, shapes) = placed.__reduce__()
    rebuilt = function(dtype, files, offsets, nbytes, shapes)
    assert rebuilt.shapes.tolist() == [[2], [2]] and rebuilt.offsets.tolist() == [0, 64]
    with pytest.raises(TransportError, match="cut short"):
        function(dtype, files[:-1], offsets, nbytes, shapes)
    with pytest.raises(TransportError, match="cut short"):
        function(dtype, files, offsets, nbytes, (1, shapes[1][:8]))


def test_key_columns_that_do_not_match_are_refused():
    columns = _layout.key_columns([SampleId("a", "s", True, 1), SampleId("b", "t", True, 2)])
    assert isinstance(columns, _layout.KeyColumns)
    broken = _layout.KeyColumns(columns.names, columns.shards, np.array([0, 5]), columns.seeds,
                                columns.seeded)
    with pytest.raises(TransportError, match="key columns"):
        broken.keys(True)
    short = _layout.KeyColumns(columns.names[:1], columns.shards, columns.shard, columns.seeds,
                               columns.seeded)
    with pytest.raises(TransportError, match="key columns"):
        short.keys(True)


def test_a_runs_skip_policy_travels_once_beside_its_keys():
    """The error policy is the run's: one flag in the header, not a column; keys of mixed flags
    (a caller's own, through sample_key) go as they are, and the run skips only if all may."""
    from mmproxy._context import run_skips

    both = [SampleId("a", "s", True, 1), SampleId("b", "t", True, None)]
    columns = _layout.key_columns(both)
    assert isinstance(columns, _layout.KeyColumns) and not hasattr(columns, "skip")
    assert columns.keys(True) == both and run_skips(both)
    mixed = [SampleId("a", "s", True, 1), SampleId("b", "t", False, 2)]
    assert _layout.key_columns(mixed) == mixed and not run_skips(mixed)
    assert not run_skips([]) and not run_skips([None, None])


def test_the_registry_table_follows_its_mappings(tmp_path):
    before = len(_mappings.files.table()[0])
    mapping = _registered(tmp_path, "c.tar", b"x" * 100)
    starts, ends, fds, identities = _mappings.files.table()
    address = np.frombuffer(mapping, np.uint8).__array_interface__["data"][0]
    assert address in starts.tolist() and address + 100 in ends.tolist()
    row = starts.tolist().index(address)  # the file's version: what the server maps once
    with open(tmp_path / "c.tar", "rb") as f:
        assert tuple(identities[row]) == _mappings.identity(int(fds[row])) == _mappings.identity(
            f.fileno())
    assert list(starts) == sorted(starts) and len(fds) == min(before + 1, _mappings.MAX_FILES)
    _transport.release_file_mapping(mapping)
    assert address not in _mappings.files.table()[0].tolist()


def test_a_run_reaches_a_server_the_same_in_its_process_and_from_a_worker(tmp_path, monkeypatch):
    """DALIProxy.run hands a server in its own process the Request the listener unpacks when the
    run comes from a worker: same keys, same arrays."""
    from conftest import cpu, double_pipe

    import mmproxy
    from mmproxy import _process

    shard = _registered(tmp_path, "d.tar", os.urandom(4000))
    samples = [(np.frombuffer(shard, np.uint8)[i * 100:i * 100 + 40 + i],) for i in range(6)]
    samples[2] = (np.arange(7, dtype=np.uint8),)
    keys = [SampleId(f"k{i}", "d.tar", i % 2 == 0, 3 * i) for i in range(6)]
    with mmproxy.DALIServer(cpu(double_pipe), name="double") as server:
        accepted = []
        monkeypatch.setattr(server.table, "accept", accepted.append)
        server.proxy.run(keys, samples)  # in this process: no transport
        sent = []
        monkeypatch.setattr(_process, "local", lambda uid: None)
        monkeypatch.setattr(_transport, "send", lambda path, fds, name: sent.append(
            [os.dup(fd) for fd in fds]))
        server.proxy.run(keys, samples)  # as from a worker
    try:
        received = _transport.unpack(sent[0])
    finally:
        for fd in sent[0]:
            os.close(fd)
    local = accepted[0]
    assert received.tag == local.tag and received.run_id != local.run_id
    _same_request(received, received.run_id, local.tag, local.keys, local.inputs)
    assert local.keys == keys and [bytes(a) for a in local.inputs[0]] == [bytes(s[0]) for s in samples]


def test_the_fast_address_reader_agrees_with_numpys_interface(monkeypatch):
    # pack() finds each array's address to look it up among the registered mappings; the fast
    # reader (numpy's C structure through ctypes) must give what __array_interface__ gives
    base = np.arange(4096, dtype=np.uint8)
    mapped = mmap.mmap(-1, 8192)
    arrays = [base[5:900], base[4000:], base[10:10], np.zeros(3, np.float32),
              np.frombuffer(mapped, np.uint8)[4096:5000], base.view(np.uint16)[7:70],
              np.frombuffer(memoryview(mapped)[100:200], np.uint8)]
    expected = [0 if a.base is None else a.__array_interface__["data"][0] for a in arrays]
    assert _layout._POINTER is not None  # found on CPython and numpy 2
    assert _layout._addresses(arrays).tolist() == expected
    monkeypatch.setattr(_layout, "_POINTER", None)  # where the field is not found: the interface
    assert _layout._addresses(arrays).tolist() == expected
    del arrays
