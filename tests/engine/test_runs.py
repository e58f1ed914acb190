"""The run table alone: states, checked transitions, scheduling and waiting, without DALI or torch."""

from __future__ import annotations

import sys
import threading
import time

import pytest

import mmproxy
from mmproxy._server.runs import RunState, RunTable, ServerState
from mmproxy._wire.transport import Request

pytestmark = pytest.mark.timeout(30)


def _table(**kw):
    table = RunTable("t", 4, deterministic=kw.pop("deterministic", False), timeout=kw.pop("timeout", 5))
    table.set_state(ServerState.RUNNING)
    return table


def _request(run_id, tag=None, n=2):
    return Request(run_id, tag, [None] * n, [[b"x"] * n])


def test_the_table_imports_neither_dali_nor_torch():
    import subprocess

    code = ("import sys, mmproxy._server.runs; "
            "print(any(m.split('.')[0] in ('torch', 'nvidia') for m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


def test_server_and_run_transitions_are_checked():
    table = RunTable("t", 4, deterministic=False, timeout=1)
    with pytest.raises(mmproxy.ServerStateError, match="illegal transition created -> stopped"):
        table.set_state(ServerState.STOPPED)
    table.set_state(ServerState.RUNNING)
    table.accept(_request("a"))
    run = table.next(block=False, stop=threading.Event())
    assert run is not None and run.state is RunState.SCHEDULED
    table.finish(run, ("out",), None)
    with pytest.raises(mmproxy.ServerStateError, match="run a: illegal transition ready -> failed"):
        table.fail_run(run, RuntimeError("late"))


def test_arrival_order_and_the_current_epoch_first():
    table = _table()
    table.begin_epoch("L", 1)
    table.accept(_request("next-epoch", ("L", 2)))
    table.accept(_request("a", ("L", 1)))
    table.accept(_request("b", ("L", 1)))
    stop = threading.Event()
    assert [table.next(False, stop).id for _ in range(3)] == ["a", "b", "next-epoch"]
    assert table.next(False, stop) is None


def test_deterministic_mode_follows_the_claims():
    table = _table(deterministic=True)
    table.accept(_request("a"))
    table.accept(_request("b"))
    stop = threading.Event()
    assert table.next(False, stop) is None  # nothing claimed yet
    table.claim(["b", "a"])
    assert [table.next(False, stop).id for _ in range(2)] == ["b", "a"]


def test_wait_returns_ready_runs_and_raises_failed_ones():
    table = _table()
    table.accept(_request("a"))
    table.accept(_request("b"))
    stop = threading.Event()
    a, b = table.next(False, stop), table.next(False, stop)
    threading.Timer(0.1, table.finish, (a, ("x",), None)).start()
    assert table.wait("a").outputs == ("x",)
    table.fail_run(b, mmproxy.PipelineError("bad sample"))
    with pytest.raises(mmproxy.PipelineError, match="bad sample"):
        table.wait("b")
    assert "b" not in table.runs  # a failed run does not stay in the table


def test_a_stale_or_stopped_run_raises_at_once_naming_why():
    table = _table()
    table.begin_epoch("L", 1)
    table.accept(_request("old", ("L", 1)))
    table.begin_epoch("L", 2)
    start = time.perf_counter()
    with pytest.raises(mmproxy.RunDroppedError, match="old was dropped: .*epoch 1 of loader L.*epoch 2"):
        table.wait("old")
    table.accept(_request("late", ("L", 1)))  # arrives after its epoch ended
    with pytest.raises(mmproxy.RunDroppedError, match="late was dropped"):
        table.wait("late")
    table.accept(_request("c", ("L", 2)))
    table.set_state(ServerState.STOPPING)
    table.clear()
    table.set_state(ServerState.RUNNING)
    with pytest.raises(mmproxy.RunDroppedError, match="c was dropped: the server was stopped"):
        table.wait("c")
    assert time.perf_counter() - start < 1


def test_a_run_released_long_ago_raises_at_once_instead_of_waiting():
    from mmproxy._server.runs import _DONE_KEPT

    table = _table(timeout=None)  # a wait for a run that will never come would hang
    stop = threading.Event()
    ids = [f"r{i}" for i in range(_DONE_KEPT + 2)]
    for run_id in ids:
        table.accept(_request(run_id))
        run = table.next(False, stop)
        table.finish(run, ("out",), None)
        table.release(table.wait(run_id))
    assert table.wait(ids[-1]).outputs == ("out",)  # a recent one is kept for its other outputs
    start = time.perf_counter()
    with pytest.raises(mmproxy.RunDroppedError, match="r0 was dropped: its outputs were taken"):
        table.wait("r0")
    assert time.perf_counter() - start < 1


def test_a_wait_that_times_out_leaves_no_placeholder():
    table = _table(timeout=0.2)
    with pytest.raises(mmproxy.WaitTimeoutError, match="run ghost not ready after 0.2 s"):
        table.wait("ghost")
    assert table.runs == {}


def test_a_failed_server_fails_its_runs_and_stays_failed():
    table = _table()
    table.accept(_request("a"))
    table.fail(RuntimeError("listener died"))
    with pytest.raises(RuntimeError, match="listener died"):  # the run fails with the server's error
        table.wait("a")
    with pytest.raises(mmproxy.ServerFailedError, match="stays failed: listener died"):
        table.wait("another")
    with pytest.raises(mmproxy.ServerFailedError):
        table.check_startable()
    with pytest.raises(mmproxy.ServerFailedError):
        table.accept(_request("b"))


def test_a_batch_larger_than_the_pipeline_fails_its_run_alone():
    """The one place the batch-size rule is checked: the run fails (its resolver raises), the
    caller of accept (the listener thread) and the server carry on."""
    table = _table()
    table.accept(_request("big", n=5))
    with pytest.raises(mmproxy.BatchSizeError, match=r"'t': a batch of 5 samples \(run big\) is "
                                                     "larger than the pipeline's batch_size=4"):
        table.wait("big")
    assert table.state is ServerState.RUNNING and table.next(block=False, stop=threading.Event()) is None
    table.accept(_request("fits", n=4))
    assert table.next(block=False, stop=threading.Event()).id == "fits"


def test_a_claimed_run_that_fails_on_arrival_does_not_hold_up_the_runs_behind_it():
    """Deterministic mode takes runs in claimed order: a claimed run refused when it arrives
    (too large) must leave the order, or every later run waits behind it until the timeout."""
    table = _table(deterministic=True)
    table.claim(["big", "next"])
    table.accept(_request("big", n=5))
    with pytest.raises(mmproxy.BatchSizeError):
        table.wait("big")
    table.accept(_request("next", n=4))
    assert table.next(block=False, stop=threading.Event()).id == "next"


def _lanes(n, deterministic=True):
    table = RunTable("t", 4, deterministic=deterministic, timeout=5, lanes=n)
    table.set_state(ServerState.RUNNING)
    return table, [table.lane(k) for k in range(n)]


def test_deterministic_lanes_take_the_claimed_runs_in_turn():
    """Three pipelines: the claimed runs go to lanes 0, 1, 2, 0, ...; a lane never takes
    another's turn, and a run dropped before it is taken (too large) shifts no one's turn."""
    table, lanes = _lanes(3)
    stop = threading.Event()
    table.claim(["a", "big", "b", "c", "d"])
    for run_id in ("a", "b", "c", "d"):
        table.accept(_request(run_id))
    table.accept(_request("big", n=5))  # refused on arrival: leaves the order
    assert lanes[1].next(False, stop) is None  # lane 0's turn
    assert lanes[0].next(False, stop).id == "a"
    assert lanes[0].next(False, stop) is None and lanes[2].next(False, stop) is None
    assert lanes[1].next(False, stop).id == "b"
    assert lanes[2].next(False, stop).id == "c"
    assert lanes[0].next(False, stop).id == "d"


def test_more_lanes_than_runs_and_a_stop_while_waiting_for_a_turn():
    table, lanes = _lanes(4)
    stop = threading.Event()
    table.claim(["only"])
    table.accept(_request("only"))
    assert lanes[0].next(False, stop).id == "only"
    assert all(lane.next(False, stop) is None for lane in lanes)
    waiting = threading.Thread(target=lanes[2].next, args=(True, stop))
    waiting.start()
    stop.set()
    waiting.join(1)
    assert not waiting.is_alive()


def test_free_lanes_take_any_arrived_run_and_the_turn_restarts_with_the_server():
    table, lanes = _lanes(2, deterministic=False)
    stop = threading.Event()
    for run_id in ("a", "b", "c"):
        table.accept(_request(run_id))
    assert [lanes[1].next(False, stop).id, lanes[1].next(False, stop).id,
            lanes[0].next(False, stop).id] == ["a", "b", "c"]
    table, lanes = _lanes(2)
    table.claim(["x"])
    table.accept(_request("x"))
    assert lanes[0].next(False, stop).id == "x"
    table.set_state(ServerState.STOPPING)
    table.clear()
    table.set_state(ServerState.RUNNING)
    table.claim(["y"])
    table.accept(_request("y"))
    assert lanes[1].next(False, stop) is None and lanes[0].next(False, stop).id == "y"


class _RecordingPipe:
    """A pipeline adapter that records what the runner asks of it, in order."""

    def __init__(self, keeps_outputs, refuse=(), fail_convert=()):
        self.keeps_outputs, self.refuse, self.fail_convert = keeps_outputs, set(refuse), set(fail_convert)
        self.queue_depth, self.survives_errors, self.num_outputs = 2, True, 1
        self.calls, self.fed = [], []

    def feed(self, inputs, rows=None):
        run = inputs[0][0]
        self.calls.append(("feed", run))
        if run in self.refuse:
            raise ValueError(f"refused {run}")
        self.fed.append(run)

    def take(self, stream=None):
        run = self.fed.pop(0)
        self.calls.append(("take", run))
        return run

    def convert(self, taken, pad, stream=None):
        self.calls.append(("convert", taken))
        if taken in self.fail_convert:
            self.fail_convert.discard(taken)
            raise MemoryError(f"no memory for {taken}")
        return (taken,), None

    def outputs(self, pad, stream=None):
        return self.convert(self.take(stream), pad, stream)

    def rebuild(self):
        self.calls.append(("rebuild", None))
        self.fed.clear()


def _served(pipe, runs, n=1):
    from mmproxy._server.runner import Runner

    table = _table()
    for run_id in runs:
        table.accept(Request(run_id, None, [None] * n, [[run_id] * n]))
    stop = threading.Event()
    thread = threading.Thread(target=Runner(pipe, table, set(), None, stop))
    thread.start()
    try:
        return table, [table.wait(r) if r not in pipe.refuse else r for r in runs]
    finally:
        stop.set()
        thread.join(10)


def test_the_runner_feeds_the_next_run_before_it_converts_a_runs_outputs():
    pipe = _RecordingPipe(keeps_outputs=True)
    _, done = _served(pipe, ["a", "b", "c"])
    assert [run.outputs for run in done] == [("a",), ("b",), ("c",)]
    assert pipe.calls[:6] == [("feed", "a"), ("feed", "b"), ("take", "a"), ("feed", "c"),
                              ("convert", "a"), ("take", "b")]


def test_the_runner_converts_first_where_the_executor_reuses_its_outputs():
    pipe = _RecordingPipe(keeps_outputs=False)
    _served(pipe, ["a", "b", "c"])
    assert pipe.calls[:5] == [("feed", "a"), ("feed", "b"), ("take", "a"), ("convert", "a"),
                              ("feed", "c")]


def test_inputs_refused_while_feeding_ahead_fail_their_run_after_the_one_converting():
    pipe = _RecordingPipe(keeps_outputs=True, refuse={"c"})
    table, done = _served(pipe, ["a", "b", "c", "d"])
    assert [run.outputs for run in done[:2]] == [("a",), ("b",)] and done[3].outputs == ("d",)
    with pytest.raises(mmproxy.PipelineError, match="refused the inputs of run c"):
        table.wait("c")
    assert pipe.calls.index(("convert", "a")) < pipe.calls.index(("rebuild", None))


def test_a_conversion_that_fails_after_a_refusal_rebuilds_before_the_run_is_searched():
    # the refused inputs may be partly in the pipeline: the search of "a" feeds it again only
    # after the rebuild, so that its inputs are not paired with what is left of "c"'s
    pipe = _RecordingPipe(keeps_outputs=True, refuse={"c"}, fail_convert={"a"})
    table, done = _served(pipe, ["a", "b", "c", "d"], n=2)  # two samples: the search feeds "a"
    assert [done[i].outputs for i in (0, 1, 3)] == [("a",), ("b",), ("d",)]
    with pytest.raises(mmproxy.PipelineError, match="refused the inputs of run c"):
        table.wait("c")
    fed_a = [i for i, call in enumerate(pipe.calls) if call == ("feed", "a")]
    assert len(fed_a) > 1 and pipe.calls.index(("rebuild", None)) < fed_a[1], pipe.calls


class _NextFails:
    """The run table, whose ``next`` raises from its ``at``-th call on (a Prepare stage that
    cannot take a run)."""

    def __init__(self, table, at):
        self.table, self.at, self.calls, self.name = table, at, 0, table.name

    def next(self, block, stop):
        self.calls += 1
        if self.calls >= self.at:
            raise RuntimeError("the stage cannot take this run")
        return self.table.next(block, stop)

    def __getattr__(self, name):
        return getattr(self.table, name)


def test_a_run_table_error_while_feeding_ahead_fails_the_server_at_once():
    from mmproxy._server.runner import Runner

    table = _table()
    for run_id in "abcd":
        table.accept(Request(run_id, None, [None], [[run_id]]))
    stop = threading.Event()
    pipe = _RecordingPipe(keeps_outputs=True)
    thread = threading.Thread(target=Runner(pipe, _NextFails(table, at=3), set(), None, stop))
    thread.start()
    try:
        start = time.monotonic()
        for run_id in "abcd":
            with pytest.raises(mmproxy.PipelineError, match="the stage cannot take this run"):
                table.wait(run_id)
        assert time.monotonic() - start < 2 and table.state is ServerState.FAILED
    finally:
        stop.set()
        thread.join(10)
