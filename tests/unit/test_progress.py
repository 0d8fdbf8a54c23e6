"""Tests of stall detection.

A small simulated controller drives `ProgressMonitor` with a fake clock: Nodes go to
the History, probes go to fake workers that answer when the test says so, checks run
every interval, and stall reports are completed with canned worker data. Settings are
those: interval 1 s, timeout 3 s, K = 100.
"""

from __future__ import annotations

from unittest.mock import ANY

import pytest

from palatine.ids import ProcId, WorldId
from palatine.protocol.controller import (
    CheckWorkerProgress,
    Fail,
    Instruction,
    RankStallData,
    RequestStacks,
    Schedule,
    SendProbe,
    StallReport,
    Warn,
    WorkerProcRecord,
)
from palatine.protocol.worker import ExecutingOp, StreamProgress, WorkerProgress
from palatine.tensor.controller.history import History
from palatine.tensor.controller.progress import (
    ProgressMonitor,
    culprits,
    select_stack,
    stall_headline,
)

W = WorldId("worker")

IN_PROCESS_DUMP = """Thread 0x7f01 "MainThread" (most recent call last):
  File "/palatine/core/proc.py", line 10, in run
    loop.run_forever()
  File "/asyncio/base_events.py", line 600, in run_forever
    self._run_once()

Thread 0x7f02 "palatine-stream-main" (daemon) (most recent call last):
  File "/threading.py", line 1002, in _bootstrap
    self._bootstrap_inner()
  File "/palatine/tensor/worker/stream.py", line 80, in _loop
    self._execute(cmd)
  File "/home/me/train.py", line 12, in slow_step
    time.sleep(10)

Thread 0x7f03 "palatine-heartbeat" (daemon) (most recent call last):
  File "/palatine/hosting/heartbeat.py", line 40, in _beat
    time.sleep(0.5)
"""

PYSPY_DUMP = """Process 4243: python -m palatine worker
Python v3.11.7 (/usr/bin/python3.11)

Thread 4243 (idle): "MainThread"
    select (selectors.py:468)
    run_forever (asyncio/base_events.py:608)
Thread 4250 (idle): "palatine-stream-side"
    wait (threading.py:320)
Thread 4251 (idle): "palatine-stream-main"
    slow_step (train.py:12)
        Arguments:
            x: 1
    _execute (palatine/tensor/worker/stream.py:91)
    _loop (palatine/tensor/worker/stream.py:80)
"""

FAULTHANDLER_DUMP = """Thread 0x00007f02 (most recent call first):
  File "/home/me/train.py", line 12 in slow_step
  File "/palatine/tensor/worker/stream.py", line 80 in _loop

Current thread 0x00007f01 (most recent call first):
  File "/palatine/core/proc.py", line 10 in run
"""


class Sim:
    """The parts of a ControllerActor that progress checks need, on a fake clock."""

    def __init__(
        self,
        n: int = 1,
        *,
        timeout: float = 3.0,
        interval: float = 1.0,
        k: int = 100,
        fail: bool = False,
        report_timeout: float = 5.0,
        procs: list[WorkerProcRecord] | None = None,
    ) -> None:
        self.now = 0.0
        self.h = History(n)
        self.dead: set[int] = set()
        self.mon = ProgressMonitor(
            self.h,
            worker_world=W,
            operations_per_request=k,
            operation_timeout_s=timeout,
            check_interval_s=interval,
            stall_report_timeout_s=report_timeout,
            fail_on_worker_timeout=fail,
            procs=procs or [],
            dead_ranks=self.dead,
        )
        self.interval = interval
        self.attached = True
        self.mesh_failed = False
        self.probes: list[SendProbe] = []  # what the workers received
        self.client: list[Instruction] = []  # Warn / Fail sent to the client
        self.requests: list[RequestStacks] = []
        self.request_times: list[float] = []
        self.next_check = interval
        self.one_shots: list[float] = []  # due times of the one-shot deadline checks
        # What each rank answers to a stall report: (progress, stack) or None.
        self.answers: dict[int, RankStallData] = {}
        self.auto_report = True

    def run(self, instrs: list[Instruction]) -> None:
        for i in instrs:
            if isinstance(i, SendProbe):
                self.probes.append(i)
            elif isinstance(i, (Warn, Fail)):
                self.client.append(i)
                if isinstance(i, Fail):
                    self.mesh_failed = True
            elif isinstance(i, RequestStacks):
                self.requests.append(i)
                self.request_times.append(self.now)
                if self.auto_report:
                    data = [self.answers[r] for r in i.ranks if r in self.answers]
                    report = StallReport(
                        report_id=i.report_id, expected_seq=i.expected_seq, ranks=data
                    )
                    self.run(self.mon.finish_stall_report(report, self.now))
            elif isinstance(i, Schedule):
                assert isinstance(i.timer, CheckWorkerProgress)
                if i.timer.at_deadline:  # one-shot, just after a new deadline's due time
                    self.one_shots.append(self.now + i.delay_s)
                else:
                    assert i.delay_s == self.interval
            else:  # pragma: no cover - nothing else is expected from the monitor
                raise AssertionError(f"unexpected instruction {i!r}")

    def node(self, seq: int, label: str = "") -> None:
        self.h.add_invocation(seq, [], [], label)
        self.run(self.mon.on_node(self.now))

    def answer(self, rank: int, seq: int) -> None:
        """Worker ``rank`` answers the probe for ``seq`` (``Status{seq + 1, controller}``)."""
        self.h.update_deadline_tracking(rank, seq + 1)

    def advance(self, to: float) -> None:
        """Move the clock to ``to``, running every check that falls due on the way."""
        while True:
            one_shot = min(self.one_shots, default=float("inf"))
            at = min(self.next_check, one_shot)
            if at > to:
                break
            self.now = at
            is_one_shot = one_shot < self.next_check
            if is_one_shot:
                self.one_shots.remove(one_shot)
            else:
                self.next_check += self.interval
            checked = self.mon.check(
                self.now,
                client_attached=self.attached,
                mesh_failed=self.mesh_failed,
                one_shot=is_one_shot,
            )
            self.run(checked)
        self.now = to

    def warnings(self) -> list[Warn]:
        return [i for i in self.client if isinstance(i, Warn)]


# --------------------------------------------------------------------------- stall reports


def test_probe_after_first_node_answered_in_time_is_silent() -> None:
    sim = Sim()
    sim.node(0, "init")
    assert sim.probes == [SendProbe(0, (0,), stimulus_id=ANY)]
    sim.advance(1.5)
    sim.answer(0, 0)
    sim.advance(20.0)
    assert sim.client == []


def test_late_answer_gives_exactly_one_warning_with_the_seed_line() -> None:
    sim = Sim()
    sim.node(0, "init")
    sim.answer(0, 0)
    sim.advance(2.0)
    sim.node(1, "train_step")
    sim.advance(2.5)
    assert SendProbe(1, (0,), stimulus_id=ANY) in sim.probes
    sim.advance(8.0)  # answered after 6 s
    sim.answer(0, 1)
    sim.advance(30.0)
    assert len(sim.client) == 1
    (warn,) = sim.warnings()
    assert warn.message.splitlines()[0] == (
        "ranks 0 have operations that have not completed after 3 seconds"
    )
    assert warn.details is not None
    assert warn.details["ranks"] == [0] and warn.details["expected_seq"] == 1


def test_stall_is_reported_between_timeout_and_timeout_plus_interval() -> None:
    sim = Sim()
    sim.advance(0.3)
    sim.node(0, "f")  # deadline armed at 0.3, due 3.3
    sim.advance(3.0)
    assert sim.client == []
    sim.advance(4.3)
    assert len(sim.warnings()) == 1
    assert 3.3 < sim.request_times[0] <= 3.3 + 1.0  # reported at the 4.0 check


def stuck_at_s1() -> Sim:
    """A monitor with ``fail_on_worker_timeout`` whose rank 0 never finished s1."""
    sim = Sim(fail=True)
    sim.node(0, "init")
    sim.answer(0, 0)
    sim.advance(2.0)
    sim.node(1, "train_step")
    sim.advance(30.0)
    return sim


def test_fail_on_worker_timeout_sends_log_then_stuck_failure() -> None:
    sim = stuck_at_s1()
    assert [type(i) for i in sim.client] == [Warn, Fail]
    warn, fail = sim.client
    assert isinstance(warn, Warn) and isinstance(fail, Fail)
    f = fail.failure
    assert f.kind == "stuck" and f.ranks == [0] and f.expected_seq == 1 and f.world == "worker"
    assert f.message.startswith("workers stuck: ")
    assert "ranks 0 have operations that have not completed after 3 seconds" in f.message
    assert f.message == "workers stuck: " + warn.message
    assert "crashed" not in f.message
    # No Result for s1 because of it: the History still holds it, unreported.
    inv = sim.h.invocation(1)
    assert inv is not None and inv.result is None and not inv.reported
    # After the Failure: no more stall reports, even for a new deadline.
    sim.answer(0, 1)
    sim.mesh_failed = False  # even if the shell forgot to set it
    sim.node(2, "g")
    sim.advance(60.0)
    assert len(sim.client) == 2


def test_rank_list_and_timeout_formatting() -> None:
    assert stall_headline([0, 1], 3.0) == (
        "ranks 0, 1 have operations that have not completed after 3 seconds"
    )
    assert stall_headline([0], 0.5).endswith("after 0.5 seconds")
    assert stall_headline([2], 120).endswith("after 120 seconds")
    sim = Sim(2, timeout=0.5)
    sim.node(0, "f")
    sim.advance(5.0)
    (warn,) = sim.warnings()
    assert warn.message.splitlines()[0] == (
        "ranks 0, 1 have operations that have not completed after 0.5 seconds"
    )


# --------------------------------------------------------------------------- the report's text


def _busy(rank: int, seq: int, fn: str, *, pid: int = 4243) -> WorkerProgress:
    return WorkerProgress(
        rank=rank,
        pid=pid,
        streams=[
            StreamProgress(id=1, name="side", queued=0, last_completed_seq=seq - 1),
            StreamProgress(
                id=0,
                name="main",
                executing=ExecutingOp(seq=seq, function=fn, running_for_s=4.06),
                queued=3,
                last_completed_seq=seq - 1,
            ),
        ],
    )


def test_report_names_op_function_and_stack_of_the_stuck_stream() -> None:
    procs = [
        WorkerProcRecord(rank=0, proc_id=ProcId(W, 0), pid=4242, host="node3"),
        WorkerProcRecord(rank=1, proc_id=ProcId(W, 1), pid=4243, host="node3"),
    ]
    sim = Sim(2, procs=procs)
    sim.node(17, "train.slow_step")
    sim.answers[0] = RankStallData(
        rank=0,
        progress=_busy(0, 17, "train.slow_step"),
        stack=IN_PROCESS_DUMP,
        stack_method="in-process",
    )
    sim.answers[1] = RankStallData(rank=1, stack=PYSPY_DUMP, stack_method="py-spy")
    sim.advance(5.0)
    (warn,) = sim.warnings()
    lines = warn.message.splitlines()
    assert lines[0] == "ranks 0, 1 have operations that have not completed after 3 seconds"
    assert lines[1] == (
        "rank 0 (worker[0], pid 4242, host node3): executing s17 train.slow_step on stream "
        "main for 4.1 s"
    )
    assert lines[2] == (
        "rank 1 (worker[1], pid 4243, host node3): not known to have completed s17 "
        "train.slow_step; no progress answer within 5 s"
    )
    text = warn.message
    # rank 0: only the stream thread of the stuck op, with the sleeping frame.
    assert "rank 0 stack (via in-process):" in text
    assert "in slow_step\n      time.sleep(10)" in text
    assert "palatine-heartbeat" not in text and "MainThread" not in text
    # rank 1 (no progress answer): every stream thread of its py-spy dump.
    assert "rank 1 stack (via py-spy):" in text
    assert "slow_step (train.py:12)" in text and "palatine-stream-side" in text
    assert warn.details is not None
    assert set(warn.details["ops"]) == {0, 1} and set(warn.details["stacks"]) == {0, 1}
    assert "time.sleep(10)" in warn.details["stacks"][0]


def test_unanswered_stack_dump_says_stack_unavailable() -> None:
    sim = Sim()
    sim.node(0, "f")
    sim.answers[0] = RankStallData(
        rank=0, progress=_busy(0, 0, "f"), stack_error="StackDump to worker[0] timed out"
    )
    sim.advance(5.0)
    (warn,) = sim.warnings()
    assert "rank 0: stack unavailable (StackDump to worker[0] timed out)" in warn.message
    # Nothing at all collected: the default reason names the bound.
    sim2 = Sim(report_timeout=2.5)
    sim2.node(0, "f")
    sim2.advance(5.0)
    (warn2,) = sim2.warnings()
    assert "rank 0: stack unavailable (no answer within 2.5 s)" in warn2.message
    assert "no progress answer within 2.5 s" in warn2.message


def test_lost_report_is_finished_by_the_check_within_the_bound_plus_one_second() -> None:
    sim = Sim(report_timeout=2.0)
    sim.auto_report = False
    sim.node(0, "f")
    sim.advance(4.0)  # check at 4.0 starts the report
    assert len(sim.requests) == 1 and sim.mon.stall_report_in_flight
    sim.advance(6.5)
    assert sim.warnings() == []
    sim.advance(7.0)  # started 4.0 + bound 2.0 + grace 1.0
    (warn,) = sim.warnings()
    assert "stack unavailable" in warn.message
    # The real outcome arriving later is stale and ignored.
    req = sim.requests[0]
    late = StallReport(report_id=req.report_id, expected_seq=req.expected_seq)
    assert sim.mon.finish_stall_report(late, sim.now) == []


def test_one_warning_per_deadline_and_again_after_recovery() -> None:
    sim = Sim()
    sim.node(0, "a")
    sim.advance(20.0)
    assert len(sim.warnings()) == 1
    sim.answer(0, 0)  # recovers
    sim.node(1, "b")
    sim.advance(21.0)
    assert len(sim.warnings()) == 1
    sim.advance(40.0)  # stuck again on s1
    assert len(sim.warnings()) == 2
    assert sim.warnings()[1].details["expected_seq"] == 1  # type: ignore[index]


def test_no_second_report_while_one_is_in_flight() -> None:
    sim = Sim()
    sim.auto_report = False
    sim.node(0, "a")
    sim.advance(4.0)
    sim.answer(0, 0)
    sim.node(1, "b")
    sim.advance(8.5)  # the s1 deadline is overdue, but the s0 report is still in flight
    assert len(sim.requests) == 1


# --------------------------------------------------------------------------- probes


def test_no_probe_twice_for_a_seq_and_none_when_idle() -> None:
    sim = Sim(2)
    sim.advance(30.0)
    assert sim.probes == [] and sim.client == []
    for seq in range(0, 400):
        sim.node(seq, "op")
        sim.now += 0.05
        if seq % 7 == 0:
            sim.answer(seq % 2, seq)
        sim.advance(sim.now)
    seqs = [p.seq for p in sim.probes]
    assert len(seqs) == len(set(seqs))
    assert seqs == sorted(seqs)


def test_probe_throttling_rules() -> None:
    sim = Sim(1, k=10)
    sim.node(0)
    assert [p.seq for p in sim.probes] == [0]
    sim.answer(0, 0)
    sim.now = 0.1
    sim.node(1)  # new expected 1, but within the interval and < last + K
    assert [p.seq for p in sim.probes] == [0]
    sim.now = 1.2
    sim.node(2)  # interval passed: probe the current expected seq
    assert [p.seq for p in sim.probes] == [0, 1]
    sim.answer(0, 1)
    for s in range(3, 30):
        sim.node(s)  # no time passes: the deadline (expected 3) stays, not probed yet
    assert [p.seq for p in sim.probes] == [0, 1]
    sim.answer(0, 20)
    sim.node(30)  # expected = min(21 + K, 30) = 30 >= 1 + K: probed at once
    assert [p.seq for p in sim.probes] == [0, 1, 30]


def test_probe_answers_never_complete_anything() -> None:
    sim = Sim(2)
    sim.node(0)
    sim.node(1)
    for r in range(2):
        sim.answer(r, 5)
    assert sim.h.live_count == 2 and sim.h.min_frontier == 0
    assert sim.h.min_progress == 6


def test_dead_rank_is_neither_probed_nor_listed() -> None:
    sim = Sim(3)
    sim.dead.add(1)
    sim.node(0, "f")
    assert sim.probes == [SendProbe(0, (0, 2), stimulus_id=ANY)]
    sim.advance(5.0)
    (warn,) = sim.warnings()
    assert warn.message.splitlines()[0].startswith("ranks 0, 2 have")
    assert "rank 1 " not in warn.message
    # Every rank dead: no probe at all.
    sim2 = Sim(1)
    sim2.dead.add(0)
    sim2.node(0)
    assert sim2.probes == []


def test_check_only_reschedules_without_client_or_after_failure() -> None:
    sim = Sim()
    sim.attached = False
    sim.node(0)
    sim.advance(10.0)
    assert sim.client == [] and sim.requests == []
    sim.attached = True
    sim.mesh_failed = True
    sim.advance(20.0)
    assert sim.client == [] and sim.requests == []
    out = sim.mon.check(21.0, client_attached=False, mesh_failed=False)
    assert out == [Schedule(1.0, CheckWorkerProgress(), stimulus_id=ANY)]
    assert sim.mon.first_check(0.0) == Schedule(1.0, CheckWorkerProgress(), stimulus_id=ANY)


def test_report_lines_when_worker_idle_or_query_failed() -> None:
    sim = Sim(2)
    sim.node(3, "load")
    sim.answers[0] = RankStallData(
        rank=0,
        progress=WorkerProgress(
            rank=0, pid=9, streams=[StreamProgress(id=0, name="main", queued=2)]
        ),
    )
    sim.answers[1] = RankStallData(rank=1, progress_error="peer gone: worker[1] exited")
    sim.advance(5.0)
    (warn,) = sim.warnings()
    lines = warn.message.splitlines()
    assert lines[1] == (
        "rank 0 (worker[0], pid 9): not known to have completed s3 load; no stream is "
        "executing an op (2 queued)"
    )
    assert lines[2] == (
        "rank 1 (worker[1]): not known to have completed s3 load; no progress answer "
        "(peer gone: worker[1] exited)"
    )


def test_stale_or_unknown_report_is_ignored() -> None:
    sim = Sim()
    assert sim.mon.finish_stall_report(StallReport(report_id=99, expected_seq=0), 0.0) == []


def test_invalid_k_is_refused() -> None:
    with pytest.raises(ValueError):
        ProgressMonitor(History(1), worker_world=W, operations_per_request=0)


# --------------------------------------------------------------------------- stack selection


def test_select_stack_in_process_picks_the_named_stream_thread() -> None:
    out = select_stack(IN_PROCESS_DUMP, ["main"])
    assert out.startswith('Thread 0x7f02 "palatine-stream-main"')
    assert "time.sleep(10)" in out and "MainThread" not in out


def test_select_stack_pyspy_and_unknown_stream_fall_back() -> None:
    out = select_stack(PYSPY_DUMP, ["main"])
    assert out.splitlines()[0] == 'Thread 4251 (idle): "palatine-stream-main"'
    assert "Arguments:" in out and "Process 4243" not in out
    # A stream not in the dump: the whole dump (minus the preamble).
    whole = select_stack(PYSPY_DUMP, ["nope"])
    assert "MainThread" in whole and "palatine-stream-side" in whole


def test_select_stack_faulthandler_has_no_names_so_whole_dump() -> None:
    out = select_stack(FAULTHANDLER_DUMP, ["main"])
    assert "slow_step" in out and "Current thread" in out


def test_select_stack_keeps_innermost_frames() -> None:
    frames = "".join(f'  File "f.py", line {i}, in f{i}\n    call{i}()\n' for i in range(50))
    last = select_stack(f'Thread 0x1 "palatine-stream-main" (most recent call last):\n{frames}')
    assert "in f49" in last and "in f20" in last and "in f19" not in last
    assert "... 20 outer frames omitted" in last.splitlines()[1]
    first_frames = "".join(f'  File "f.py", line {i} in f{i}\n' for i in range(40))
    first = select_stack(f"Thread 0x1 (most recent call first):\n{first_frames}", None, 5)
    assert "in f0" in first and "in f4" in first and "in f5" not in first
    assert first.splitlines()[-1].strip() == "... 35 outer frames omitted"
    assert select_stack("no recognisable format") == "no recognisable format"


def test_stall_is_reported_just_after_the_deadline_whatever_the_check_phase() -> None:
    # the periodic check runs at 1.0, 2.0, ...; a Node at 0.3 with a 3 s timeout is due
    # at 3.3: the one-shot check reports it then, not at the 4.0 tick
    sim = Sim(timeout=3.0, interval=1.0)
    sim.advance(0.3)
    sim.node(0, "slow_step")
    sim.advance(3.29)
    assert sim.requests == []
    sim.advance(3.4)
    assert len(sim.requests) == 1 and 3.3 < sim.request_times[0] < 3.32
    assert len(sim.warnings()) == 1


def test_at_most_one_deadline_check_is_pending() -> None:
    # thousands of quickly completed Nodes arm thousands of deadlines, but only one
    # one-shot timer is pending at a time; it re-arms for the newest deadline
    sim = Sim(n=1, timeout=3.0, interval=1.0, k=1)
    for seq in range(200):
        sim.now = seq * 0.001
        sim.node(seq)
        sim.answer(0, seq)
    assert len(sim.one_shots) == 1
    sim.advance(3.1)  # the first fires; everything is met: nothing more is scheduled
    assert sim.one_shots == [] and sim.requests == []
    sim.node(200)  # a new deadline gets its own due-time check
    assert len(sim.one_shots) == 1


def test_due_time_check_waits_for_a_probe_held_back_until_late() -> None:
    # the probe of s0 was held back by the actor (a Node without its Send) and
    # only cast at 0.9: the due-time check at 1.0 leaves the verdict to the periodic
    # check, which reports at 1.5 if the rank still has not answered
    sim = Sim(n=1, timeout=1.0, interval=0.5)
    sim.node(0, "slow_step")
    sim.mon.probe_cast(0, 0.9)
    sim.advance(1.2)
    assert sim.requests == []
    sim.advance(1.6)
    assert len(sim.requests) == 1 and sim.request_times[0] == 1.5


def test_culprits_are_the_stuck_ranks_not_waiting_in_a_collective() -> None:
    in_collective = (
        '  File "/site-packages/torch/distributed/distributed_c10d.py", line 3252, in all_reduce\n'
        "    work.wait()\n"
    )
    sleeping = '  File "/job/train.py", line 12, in step\n    time.sleep(600)\n'
    stacks = {0: in_collective, 1: in_collective, 2: sleeping, 3: in_collective}
    assert culprits(stacks) == (2,)
    assert culprits({0: sleeping, 1: "", 2: in_collective}) == (0, 1)  # no stack: a culprit
    # Every rank waiting in a collective (a mismatch): all of them.
    assert culprits({0: in_collective, 3: in_collective}) == (0, 3)


def test_a_recovery_revives_stall_reports_after_a_stuck_failure() -> None:
    sim = stuck_at_s1()
    assert sim.mon.stuck == (0,) and sim.mon.culprits == (0,) and sim.mon.failed
    sim.mon.revive([0], {})
    assert sim.mon.stuck == () and sim.mon.culprits == () and not sim.mon.failed


def test_a_rank_stuck_in_its_own_code_under_a_distributed_wrapper_is_a_culprit() -> None:
    wrapped = (
        '  File "/site-packages/torch/distributed/fsdp/fully_sharded_data_parallel.py", '
        "line 850, in forward\n    output = self._fsdp_wrapped_module(*args)\n"
        '  File "/site-packages/torch/nn/modules/module.py", line 1750, in _call_impl\n'
        "    return forward_call(*args)\n"
        '  File "/job/model.py", line 40, in forward\n    while not ready(): pass\n'
        '  File "/job/model.py", line 12, in ready\n    return flag\n'
    )
    waiting = (
        '  File "/job/train.py", line 9, in step\n    dist.all_reduce(x)\n'
        '  File "/site-packages/torch/distributed/distributed_c10d.py", line 3252, '
        "in all_reduce\n    work.wait()\n"
    )
    assert culprits({0: waiting, 1: wrapped}) == (1,)


def test_a_partial_recovery_keeps_the_mesh_failed_while_a_stuck_rank_is_left() -> None:
    sim = stuck_at_s1()
    sim.mon.stuck, sim.mon.culprits = (0, 1, 2), (0, 1)  # rank 2 waited for 0 and 1
    sim.mon.revive([0], {})
    assert sim.mon.stuck == (1, 2) and sim.mon.culprits == (1,) and sim.mon.failed
    sim.mon.revive([1], {})
    assert sim.mon.stuck == () and sim.mon.culprits == () and not sim.mon.failed
