"""The transport and the shard reader under it: payloads by reference, tar headers parsed by hand."""

from __future__ import annotations

import io
import mmap
import os
import tarfile

import numpy as np
import pytest
from datasets_for_tests import grid, read_only
from mmproxy.datasets._tar import members
from mmproxy.datasets.shards import read_local_tar

from mmproxy._wire import mappings as _mappings
from mmproxy._wire import transport as _transport


def _tar(path, files, fmt):
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


FILES = [("a/0001.jpg", b"\xff\xd8jpeg"), ("a/0001.txt", b"a caption"), ("a/0002.cls", b""),
         ("deep/" + "x" * 120 + "/0003.wav", os.urandom(1000)),  # longer than ustar's 100 bytes
         ("caf\u00e9/0004.txt", b"unicode name")]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_members_match_tarfile(tmp_path, fmt):
    files = FILES if fmt != tarfile.USTAR_FORMAT else [f for f in FILES if len(f[0]) < 100 and f[0].isascii()]
    path = _tar(tmp_path / "s.tar", files, fmt)
    data = path.read_bytes()
    got = [(name, bytes(data[o:o + n])) for name, o, n in members(memoryview(data))]
    assert got == files
    with tarfile.open(path) as tar:
        assert [(m.name, m.offset_data, m.size) for m in tar] == list(members(memoryview(data)))


def test_header_byte_sums_are_exact_where_adler32_alone_would_wrap():
    """The checksum's byte sum comes from zlib's Adler-32, modulo 65521: a 512-byte header can
    sum to 130,560, so each 256-byte half is summed on its own, where it cannot wrap."""
    from mmproxy.datasets._tar import _byte_sum

    rng = np.random.default_rng(0)
    headers = [bytes(512), b"\xff" * 512, b"\xff" * 256 + bytes(256), bytes(256) + b"\xff" * 256,
               b"\x80" * 512, *(rng.integers(0, 256, 512, dtype=np.uint8).tobytes() for _ in range(200))]
    assert [_byte_sum(h) for h in headers] == [sum(h) for h in headers]


def test_damaged_and_truncated_tars_raise(tmp_path):
    data = bytearray(_tar(tmp_path / "s.tar", FILES[:3], tarfile.GNU_FORMAT).read_bytes())
    flipped = bytearray(data)
    flipped[10] ^= 0x55  # inside the first header's name: checksum no longer matches
    with pytest.raises(tarfile.ReadError, match="bad checksum in the header at byte 0"):
        list(members(memoryview(bytes(flipped))))
    with pytest.raises(tarfile.ReadError, match="truncated"):
        list(members(memoryview(bytes(data[:512 + 3]))))
    # Cut inside the second header, or inside the first member's padding: its member is whole,
    # so it comes out first, then the error (a cut there used to end the shard quietly).
    for cut, where in ((1024 + 100, "the header at byte 1024"), (512 + 200, "its last member's padding")):
        got = []
        with pytest.raises(tarfile.ReadError, match=f"the shard ends at byte {cut}, inside {where}"):
            got.extend(members(memoryview(bytes(data[:cut]))))
        assert got == [(FILES[0][0], 512, len(FILES[0][1]))]
    # Cut exactly after a member (no end-of-archive marker): every member whole, no error.
    assert [n for n, _, _ in members(memoryview(bytes(data[:1024])))] == [FILES[0][0]]


def _registered_view(path):
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        _transport.register_file_mapping(mapping, f.fileno())
    return mapping


def test_shard_bytes_travel_by_reference_and_arrive_intact(tmp_path):
    path = _tar(tmp_path / "s.tar", FILES, tarfile.GNU_FORMAT)
    samples = list(read_local_tar(str(path)))
    payloads = [np.frombuffer(s[k], np.uint8) for s in samples for k in s if not k.startswith("__")]
    own = np.arange(5000, dtype=np.uint8)  # not in a mapped file: copied
    fd, files = _transport.pack("run", None, [None] * (len(payloads) + 1), [payloads + [own]])
    try:
        assert len(files) == 1 and os.path.samefile(f"/proc/self/fd/{files[0]}", path)
        assert os.fstat(fd).st_size < 5000 + 4096  # the header and the copied array only
        request = _transport.unpack([fd, *files])
    finally:
        os.close(fd)
    got = [bytes(a) for a in request.inputs[0]]
    assert got == [bytes(p) for p in payloads] + [own.tobytes()]


def test_a_shard_mapped_already_costs_the_server_no_system_call(tmp_path, monkeypatch):
    """The header names each shard's version: a shard the server has mapped is found without a
    ``fstat``; one it has not is mapped as the file is, whatever the header says."""
    paths = [_tar(tmp_path / f"s{i}.tar", FILES, tarfile.GNU_FORMAT) for i in range(3)]
    views = [np.frombuffer(_registered_view(p), np.uint8)[512:516] for p in paths]
    fd, files = _transport.pack("run", None, [None] * 3, [views])
    try:
        assert bytes(_transport.unpack([fd, *files]).inputs[0][2]) == FILES[0][1][:4]
        calls = []
        fstat = os.fstat
        monkeypatch.setattr(os, "fstat", lambda f: calls.append(f) or fstat(f))
        assert [bytes(a) for a in _transport.unpack([fd, *files]).inputs[0]] == [FILES[0][1][:4]] * 3
        assert calls == [fd]  # the run's own memfd only
        _mappings._mapped_files.clear()  # not mapped any more: found from the file itself
        assert len(_transport.unpack([fd, *files]).inputs[0]) == 3 and len(calls) == 1 + 1 + 3
        with pytest.raises(_transport.TransportError, match="names 3 files, 2 were sent"):
            _transport.unpack([fd, *files[:2]])
    finally:
        os.close(fd)


def test_a_batch_s_descriptors_are_closed_range_by_range():
    fds = sorted(os.dup(0) for _ in range(6))
    stay = fds.pop(2)  # a descriptor between two of the batch's: not the batch's, left open
    _transport.close_all(fds)
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    os.fstat(stay)
    os.close(stay)
    _transport.close_all([])


def test_a_worker_keeps_a_bounded_number_of_shards_registered(tmp_path):
    path = _tar(tmp_path / "s.tar", FILES[:2], tarfile.GNU_FORMAT)
    before = len(os.listdir("/proc/self/fd"))
    views = [_registered_view(path) for _ in range(3 * _mappings.MAX_FILES)]
    first = np.frombuffer(views[0], np.uint8)[512:516]
    del views
    # A registered shard holds two descriptors (its mapping's and the one it is sent by).
    assert len(os.listdir("/proc/self/fd")) - before <= 2 * _mappings.MAX_FILES + 1
    # An evicted mapping's bytes are still correct: they are copied instead.
    fd, files = _transport.pack("run", None, [None], [[first]])
    try:
        assert files == []
        assert bytes(_transport.unpack([fd]).inputs[0][0]) == FILES[0][1][:4]
    finally:
        os.close(fd)


def _across(arrays):
    """The arrays as the server receives them (one input, one array per sample)."""
    fd, files = _transport.pack("run", None, [None] * len(arrays), [arrays])
    try:
        return _transport.unpack([fd, *files]).inputs[0]
    finally:
        os.close(fd)


@pytest.mark.parametrize("dtype", ["u1", "i2", "f2", "f4", "f8", "i8", "?", ">f4", ">i8", ">f2"])
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (2, 3, 4)], ids=["0-d", "(0,)", "(3,0)", "(2,3,4)"])
def test_arrays_cross_with_their_shape_dtype_and_byte_order(shape, dtype):
    sent = [grid(i, shape, dtype) for i in range(2)]
    got = _across(sent)
    for a, b in zip(sent, got):
        assert (b.shape, b.dtype.str) == (a.shape, a.dtype.str)
        np.testing.assert_array_equal(b, a)


@pytest.mark.parametrize("view", [
    lambda a: a[::2], lambda a: a.T, np.asfortranarray, lambda a: a[::-1, ::-3],
    lambda a: a[1:2, ::4], lambda a: a[2, 3, ...], lambda a: a[:, :0], read_only],
    ids=["strided", "transposed", "Fortran", "negative strides", "strided unit dim", "0-d view",
         "empty view", "read-only"])
def test_views_cross_as_their_values_in_c_order(view):
    base = np.arange(60, dtype=">f4").reshape(6, 10)
    sent = view(base)
    (got,) = _across([sent])
    assert (got.shape, got.dtype.str) == (sent.shape, ">f4") and got.flags.c_contiguous
    np.testing.assert_array_equal(got, sent)


def test_a_tar_cut_inside_its_end_of_archive_zeros_is_read_whole(tmp_path):
    data = _tar(tmp_path / "s.tar", FILES[:3], tarfile.GNU_FORMAT).read_bytes()
    whole = list(members(memoryview(data)))
    end = whole[-1][1] + 512  # the last member's data padded, then the zero blocks
    assert list(members(memoryview(data[:end + 100]))) == whole


def test_the_server_keeps_the_mappings_of_every_shard_in_flight(tmp_path):
    # A loader's workers have many shards in flight (each worker's shuffle buffer spans several):
    # a mapping dropped while its shard is still read is mapped again for the next batch, and
    # unmapped again, batch after batch.
    count = 200
    assert _mappings.KEPT_FILES >= count
    fds = []
    for i in range(count):
        path = tmp_path / f"shard-{i:04d}.tar"
        path.write_bytes(bytes([i % 256]) * 4096)
        fds.append(os.open(path, os.O_RDONLY))
    try:
        first = [_mappings.server_mapping(fd) for fd in fds]
        again = [_mappings.server_mapping(fd) for fd in fds]
        assert all(a is b for a, b in zip(first, again))
        assert again[7][:1] == bytes([7])
    finally:
        for fd in fds:
            os.close(fd)


def test_memfds_and_files_are_kept_apart_and_a_rewritten_file_is_mapped_again(tmp_path):
    # a streamed remote shard (a memfd) is kept among the last few only; a file rewritten in
    # place (another size or time) is another version: never the old mapping
    files_before = len(_mappings._mapped_files)
    memfds = []
    for i in range(_mappings.KEPT_MEMFDS + 2):
        fd = os.memfd_create(f"shard-{i}")
        os.write(fd, bytes([i]) * 4096)
        memfds.append(fd)
    path = tmp_path / "shard.tar"
    path.write_bytes(b"a" * 4096)
    fd = os.open(path, os.O_RDONLY)
    try:
        mapped = [_mappings.server_mapping(m) for m in memfds]
        assert _mappings.server_mapping(memfds[-1]) is mapped[-1]
        assert len(_mappings._mapped_memfds) == _mappings.KEPT_MEMFDS
        assert len(_mappings._mapped_files) == files_before
        old = _mappings.server_mapping(fd)
        assert _mappings.server_mapping(fd) is old and len(_mappings._mapped_files) == files_before + 1
        path.write_bytes(b"b" * 8192)
        os.close(fd)
        fd = os.open(path, os.O_RDONLY)
        new = _mappings.server_mapping(fd)
        assert new is not old and new[:1] == b"b" and len(new) == 8192
    finally:
        os.close(fd)
        for m in memfds:
            os.close(m)


@pytest.mark.timeout(120)
def test_samples_a_shuffle_buffer_keeps_long_still_travel_by_reference(tmp_path, monkeypatch):
    """A shuffle buffer keeps some samples for many shards after their own was read (each draw
    replaces one of its samples at random): those samples' shards stay registered, so their
    bytes are sent by reference like the others' and none is copied."""
    from conftest import cpu, double_pipe
    from mmproxy.datasets import MultiModalDataset

    import mmproxy
    from mmproxy import _process
    from mmproxy._wire import layout as _layout
    from mmproxy.testing import write_tar

    shards, per_shard = 40, 64
    for s in range(shards):
        write_tar(tmp_path / f"s-{s:02d}.tar", [
            {"__key__": f"{s:02d}-{k:02d}", "bin": bytes([k]) * (300 + k)} for k in range(per_shard)])
    placed: list[tuple[int, int]] = []  # (samples, samples copied) of each packed run
    place = _layout.place

    def counting(inputs, registry):
        result = place(inputs, registry)
        placed.extend((len(p.files), int((p.files == -1).sum())) for p in result[0])
        return result

    monkeypatch.setattr(_layout, "place", counting)
    monkeypatch.setattr(_process, "local", lambda uid: None)  # packed and sent, as from a worker
    monkeypatch.setattr(_transport, "send", lambda path, fds, name: None)
    with mmproxy.DALIServer(cpu(double_pipe, batch_size=16), name="double") as server:
        dataset = MultiModalDataset(str(tmp_path / f"s-{{00..{shards - 1}}}.tar"),
                                    {"x": ("bin", server.proxy)}, batch_size=16,
                                    shuffle_buffer=256, seed=3)
        batches = sum(1 for _ in dataset)
    assert batches == shards * per_shard // 16
    assert sum(n for n, _ in placed) == shards * per_shard
    assert sum(copied for _, copied in placed) == 0


@pytest.mark.parametrize("copied", [False, True])
def test_a_long_header_arrives_whole(tmp_path, copied):
    """Keys that make a batch's header long (300 keys of 125 characters) arrive whole, with the
    arrays behind them, whether the arrays lie in a shard or one of them was copied."""
    from mmproxy._context import SampleId

    path = _tar(tmp_path / "s.tar", FILES, tarfile.GNU_FORMAT)
    shard = _registered_view(path)
    n = 300
    keys = [SampleId(f"{i:04d}-" + "k" * 120, f"shard-{i % 7}.tar", i % 2 == 0, i) for i in range(n)]
    arrays = [np.frombuffer(shard, np.uint8)[512 + i % 9:512 + i % 9 + 3] for i in range(n)]
    if copied:
        arrays[-1] = np.arange(1000, dtype=np.uint8)
    fd, files = _transport.pack("run", ("loader", 1), keys, [arrays])
    try:
        assert int.from_bytes(os.pread(fd, 12, 0)[4:], "little") > 16384  # the header's length
        request = _transport.unpack([fd, *files])
    finally:
        os.close(fd)
    assert request.keys == keys and request.tag == ("loader", 1)
    assert [bytes(a) for a in request.inputs[0]] == [bytes(a) for a in arrays]
