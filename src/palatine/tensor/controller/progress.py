"""Progress and stall detection, sans-IO.

Heartbeats prove a worker is alive, not that it makes progress. `ProgressMonitor`
finds ranks that are alive but stuck (a hung collective, a deadlock, an endless loop):

* one **deadline** at a time, armed lazily by `History.arm_deadline`: "every
  rank must pass seq ``expected`` by ``due``";
* controller **probes** (``RequestStatus{expected, controller: true}``), throttled so the
  same seq is never probed twice;
* the periodic **check** (``CheckWorkerProgress``): once the deadline is overdue,
  at most one stall report per deadline;
* the **stall report**: the warning whose first line tools match
  (``ranks 0, 1 have operations that have not completed after 3 seconds``), one line per
  lagging rank naming the op it runs, then each rank's stack; with
  ``fail_on_worker_timeout`` also a ``Failure{kind: "stuck"}``.

Nothing here does I/O or reads a clock: every method takes ``now`` and returns
instructions (`palatine.protocol.controller`) that the ControllerActor executes in
order. The History is shared with the actor, which keeps feeding it every ``Status``
(``update_deadline_tracking`` for probes' answers).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence, Set
from typing import Any

from palatine.config import format_seconds
from palatine.ids import WorldId
from palatine.protocol.controller import (
    CheckWorkerProgress,
    ControllerParams,
    Deadline,
    DeviceFailure,
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
from palatine.protocol.worker import WorkerProgress
from palatine.tensor.controller.history import History
from palatine.tensor.controller.stimuli import Stimuli

__all__ = [
    "MAX_STACK_FRAMES",
    "STREAM_THREAD_PREFIX",
    "ProgressMonitor",
    "select_stack",
    "stall_headline",
]

MAX_STACK_FRAMES = 30
"""Innermost frames kept per thread in a stall report."""

STREAM_THREAD_PREFIX = "palatine-stream-"
"""Worker stream threads are named ``palatine-stream-<name>``."""

# Seconds after the stall-report bound at which the check stops waiting for the shell's
# StallReport and reports with whatever it has (nothing): the report is never lost.
_REPORT_GRACE_S = 1.0
_DUE_SLACK_S = 0.005  # the due-time check fires just after the deadline (``now > due``)


def stall_headline(ranks: Sequence[int], timeout_s: float) -> str:
    """The first line of a stall warning: ``ranks 0, 1 have operations that have not completed after 3
    seconds`` (``ranks`` even for one rank; the timeout printed like ``format(t, "g")``)."""
    listed = ", ".join(str(r) for r in ranks)
    return (
        f"ranks {listed} have operations that have not completed after "
        f"{format_seconds(timeout_s)} seconds"
    )


class ProgressMonitor:
    """The controller's stall detector: deadline, probes, checks and stall reports.

    The actor shell calls:

    * `first_check` right after a successful Attach (schedules the first check);
    * `on_node` after every accepted ``Node`` (after ``history.add_invocation``);
    * `check` on every ``CheckWorkerProgress`` timer (its last instruction reschedules);
    * `finish_stall_report` when the task started by `RequestStacks` posts its
      ``StallReport``.

    ``dead_ranks`` is a live view of the ranks supervision reported dead (typically
    ``SupervisionMonitor.dead_ranks``): they are never probed nor listed as lagging.
    ``stimuli`` gives the ids the instructions carry and keeps the log of recent stimuli
    (shared with the controller's other core; its own if not given).
    """

    def __init__(
        self,
        history: History,
        *,
        worker_world: WorldId | str,
        operations_per_request: int = 100,
        operation_timeout_s: float = 120.0,
        check_interval_s: float = 10.0,
        stall_report_timeout_s: float = 5.0,
        fail_on_worker_timeout: bool = False,
        procs: Iterable[WorkerProcRecord] = (),
        dead_ranks: Set[int] = frozenset(),
        stimuli: Stimuli | None = None,
    ) -> None:
        if operations_per_request < 1:
            raise ValueError(
                f"operations_per_worker_progress_request must be >= 1, got {operations_per_request}"
            )
        self._history = history
        self._world = str(worker_world)
        self._k = operations_per_request
        self._timeout_s = operation_timeout_s
        self._interval_s = check_interval_s
        self._report_timeout_s = stall_report_timeout_s
        self._fail_on_timeout = fail_on_worker_timeout
        self._procs = {p.rank: p for p in procs}
        self._dead = dead_ranks
        self._stim = stimuli if stimuli is not None else Stimuli()
        self._last_probe: tuple[int, float] | None = None
        self._due_check_at: float | None = None  # the pending one-shot deadline check
        # (report_id, expected_seq, lagging ranks, started_at) of the report in flight.
        self._in_flight: tuple[int, int, tuple[int, ...], float] | None = None
        self._next_report_id = 1
        self._failed = False
        self._reports = 0
        #: The ranks the ``stuck`` Failure named, and of those the ones to kill for a
        #: recovery (`culprits`); empty until such a Failure.
        self.stuck: tuple[int, ...] = ()
        self.culprits: tuple[int, ...] = ()

    @classmethod
    def from_params(
        cls,
        params: ControllerParams,
        history: History,
        dead_ranks: Set[int] = frozenset(),
        stimuli: Stimuli | None = None,
    ) -> ProgressMonitor:
        """A monitor configured from the ControllerActor's spawn parameters."""
        return cls(
            history,
            worker_world=params.worker_world,
            operations_per_request=params.operations_per_worker_progress_request,
            operation_timeout_s=params.operation_timeout_s,
            check_interval_s=params.worker_progress_check_interval_s,
            stall_report_timeout_s=params.stall_report_timeout_s,
            fail_on_worker_timeout=params.fail_on_worker_timeout,
            procs=params.worker_procs,
            dead_ranks=dead_ranks,
            stimuli=stimuli,
        )

    # ----------------------------------------------------------------- inspection

    @property
    def stall_report_in_flight(self) -> bool:
        """A stall report is being collected."""
        return self._in_flight is not None

    @property
    def failed(self) -> bool:
        """A ``stuck`` Failure was produced: no more stall reports."""
        return self._failed

    @property
    def reports(self) -> int:
        """Number of stall reports finished so far."""
        return self._reports

    def revive(self, ranks: Iterable[int], records: dict[int, WorkerProcRecord]) -> None:
        """A recovery brought ``ranks`` back (new pids and hosts for reports). Once no
        culprit is left, stalls are watched and reported again, and a later stall may
        fail the mesh again (the ranks that waited for the culprits fail their collective
        when the culprits die); while one is left, the mesh stays failed (`failed`)."""
        back = set(ranks)
        for r in back:
            if r in records:
                self._procs[r] = records[r]
        self.culprits = tuple(r for r in self.culprits if r not in back)
        self.stuck = tuple(r for r in self.stuck if r not in back) if self.culprits else ()
        if not self.culprits:
            self._failed = False
            self._in_flight = None

    # ----------------------------------------------------------------- stimuli

    def first_check(self, now: float) -> Schedule:
        """The first ``CheckWorkerProgress``, one interval after the attach (a stimulus
        of kind ``attach``)."""
        st = self._stim
        st.begin("attach")
        first = Schedule(self._interval_s, CheckWorkerProgress(), stimulus_id=st.sid)
        st.done(None, [first], now)
        return first

    def arm_deadline(self, now: float) -> Deadline | None:
        """Arm the single deadline if none is pending; return the current one."""
        return self._history.arm_deadline(now, self._k, self._timeout_s)

    def maybe_probe(self, now: float) -> SendProbe | None:
        """Probe the current deadline's seq if due; never the same seq twice.

        A probe goes out when none was ever sent, or when the expected seq changed and
        either moved at least ``K`` past the last probe or the last probe is older than
        one check interval. Dead ranks are skipped; with every rank dead nothing is sent.
        """
        d = self._history.deadline
        if d is None:
            return None
        expected = d.expected
        last = self._last_probe
        if last is not None:
            last_seq, last_at = last
            if last_seq == expected:
                return None
            if expected < last_seq + self._k and now - last_at <= self._interval_s:
                return None
        ranks = self._alive_ranks()
        if not ranks:
            return None
        self._last_probe = (expected, now)
        return SendProbe(expected, ranks, stimulus_id=self._stim.sid)

    def _arm(self, now: float, out: list[Instruction]) -> Deadline | None:
        """`arm_deadline`, and keep one one-shot check pending for the deadline's due time.

        At most one such timer is pending: due times only grow, so a pending one fires
        first; when it finds a newer deadline not yet due, it schedules the next one. A
        deadline already past is left to the periodic check.
        """
        d = self.arm_deadline(now)
        if (
            d is not None
            and self._due_check_at is None
            and not d.reported
            and d.due > now
            and d.expected >= self._history.min_progress  # not already met (idle)
        ):
            self._due_check_at = d.due
            delay = max(0.0, d.due - now) + _DUE_SLACK_S
            out.append(
                Schedule(delay, CheckWorkerProgress(at_deadline=True), stimulus_id=self._stim.sid)
            )
        return d

    def probe_cast(self, seq: int, now: float) -> None:
        """A probe of ``seq`` that the actor held back went out only now."""
        last = self._last_probe
        if last is not None and last[0] == seq:
            self._last_probe = (seq, now)

    def _probe_answered_in_time(self, d: Deadline, now: float) -> bool:
        """Whether the ranks had a check interval to answer a probe of ``d``'s seq.

        The due-time check reports only then; a probe still younger than that (one held
        back until the client's Send) is left to the periodic check, as before.
        """
        last = self._last_probe
        return last is not None and last[0] >= d.expected and now - last[1] >= self._interval_s

    def on_node(self, now: float) -> list[Instruction]:
        """After an accepted Node: arm the deadline (and its due-time check), maybe probe.

        The hot path: a stimulus of kind ``node`` that begins nothing, given an id only
        if it decides something."""
        out: list[Instruction] = []
        d = self._arm(now, out)
        probe = self.maybe_probe(now)
        if probe is not None:
            out.append(probe)
        if out:
            self._stim.done(f"s{d.expected}" if d is not None else None, out, now)
        return out

    def check(
        self, now: float, *, client_attached: bool, mesh_failed: bool, one_shot: bool = False
    ) -> list[Instruction]:
        """The periodic check; the last instruction is always the reschedule.

        With no client, a failed mesh, or a report in flight it only reschedules (a
        report in flight for longer than its bound plus a grace second is finished with
        what is known, so a lost task outcome cannot silence later reports). Otherwise,
        once the deadline is overdue and unmet, the live ranks whose progress has not
        passed it are reported (once per deadline) via `RequestStacks`; then a probe.
        A stimulus of kind ``check`` (``deadline-check`` when ``one_shot``).
        """
        st = self._stim
        st.begin("deadline-check" if one_shot else "check")
        out: list[Instruction] = []
        if one_shot:
            self._due_check_at = None
        reschedule = (
            None
            if one_shot
            else Schedule(self._interval_s, CheckWorkerProgress(), stimulus_id=st.sid)
        )
        flight = self._in_flight
        if flight is not None and now >= flight[3] + self._report_timeout_s + _REPORT_GRACE_S:
            lost = StallReport(report_id=flight[0], expected_seq=flight[1])
            out.extend(self._finish_stall_report(lost))
        if not client_attached or mesh_failed or self._failed or self._in_flight is not None:
            if reschedule is not None:
                out.append(reschedule)
            return st.done(None, out, now)
        h = self._history
        d = self._arm(now, out)
        if (
            d is not None
            and not d.reported
            and now > d.due
            and d.expected >= h.min_progress
            and (not one_shot or self._probe_answered_in_time(d, now))
        ):
            dead = self._dead
            lagging = tuple(
                r for r in range(h.world_size) if r not in dead and h.progress(r) <= d.expected
            )
            if lagging:
                d.reported = True
                report_id = self._next_report_id
                self._next_report_id += 1
                self._in_flight = (report_id, d.expected, lagging, now)
                out.append(
                    RequestStacks(
                        report_id=report_id,
                        expected_seq=d.expected,
                        ranks=lagging,
                        timeout_s=self._report_timeout_s,
                        stimulus_id=st.sid,
                    )
                )
        probe = self.maybe_probe(now)
        if probe is not None:
            out.append(probe)
        if reschedule is not None:
            out.append(reschedule)
        return st.done(f"s{d.expected}" if d is not None else None, out, now)

    def finish_stall_report(self, report: StallReport, now: float) -> list[Instruction]:
        """Turn the collected data into the warning (and the ``stuck`` Failure)

        A report that is not the one in flight (late, or already finished by the check's
        backstop) is ignored. Ranks missing from ``report.ranks`` count as not answered.
        A stimulus of kind ``stall-report``.
        """
        st = self._stim
        st.begin("stall-report")
        return st.done(f"report {report.report_id}", self._finish_stall_report(report), now)

    def _finish_stall_report(self, report: StallReport) -> list[Instruction]:
        flight = self._in_flight
        if flight is None or report.report_id != flight[0]:
            return []
        self._in_flight = None
        self._reports += 1
        _, expected, lagging, _ = flight
        data = {d.rank: d for d in report.ranks}
        op_lines: list[str] = []
        stack_sections: list[str] = []
        ops: dict[int, str] = {}
        stacks: dict[int, str] = {}
        for rank in lagging:
            d = data.get(rank) or RankStallData(rank=rank)
            op, stream = self._describe_op(rank, d)
            ops[rank] = op
            op_lines.append(f"rank {rank} ({self._who(rank, d.progress)}): {op}")
            section, stack_text = self._describe_stack(rank, d, stream)
            stacks[rank] = stack_text
            stack_sections.append(section)
        message = "\n".join([stall_headline(lagging, self._timeout_s), *op_lines, *stack_sections])
        details: dict[str, Any] = {
            "ranks": list(lagging),
            "expected_seq": expected,
            "timeout_s": self._timeout_s,
            "ops": ops,
            "stacks": stacks,
        }
        sid = self._stim.sid
        out: list[Instruction] = [Warn(message, details, stimulus_id=sid)]
        if self._fail_on_timeout:
            self._failed = True
            self.stuck = tuple(lagging)
            self.culprits = culprits(stacks)
            out.append(
                Fail(
                    DeviceFailure(
                        kind="stuck",
                        message=f"workers stuck: {message}",
                        world=self._world,
                        ranks=list(lagging),
                        expected_seq=expected,
                        ops=ops,
                        stacks=stacks,
                    ),
                    stimulus_id=sid,
                )
            )
        return out

    # ----------------------------------------------------------------- texts

    def _alive_ranks(self) -> tuple[int, ...]:
        dead = self._dead
        return tuple(r for r in range(self._history.world_size) if r not in dead)

    def _who(self, rank: int, progress: WorkerProgress | None) -> str:
        """``worker[1], pid 4243, host node3`` — whatever is known about the rank's proc."""
        rec = self._procs.get(rank)
        parts = [str(rec.proc_id) if rec is not None else f"{self._world}[{rank}]"]
        pid = rec.pid if rec is not None and rec.pid else None
        if pid is None and progress is not None:
            pid = progress.pid
        if pid:
            parts.append(f"pid {pid}")
        if rec is not None and rec.host:
            parts.append(f"host {rec.host}")
        return ", ".join(parts)

    def _op_name(self, seq: int) -> str:
        """``s17 train_step`` for the first live op at or after ``seq`` (``s17`` if unknown)."""
        op = self._history.op_at_or_after(seq)
        if op is None:
            return f"s{seq}"
        s, label = op
        return f"s{s} {label}" if label else f"s{s}"

    def _describe_op(self, rank: int, d: RankStallData) -> tuple[str, str | None]:
        """The op line's text after ``rank r (...): ``, and the stuck stream's name."""
        not_done = f"not known to have completed {self._op_name(self._history.progress(rank))}"
        progress = d.progress
        if progress is None:
            if d.progress_error:
                return f"{not_done}; no progress answer ({d.progress_error})", None
            within = format_seconds(self._report_timeout_s)
            return f"{not_done}; no progress answer within {within} s", None
        running = [s for s in progress.streams if s.executing is not None]
        if not running:
            queued = sum(s.queued for s in progress.streams)
            return f"{not_done}; no stream is executing an op ({queued} queued)", None
        stream = min(running, key=lambda s: s.executing.seq if s.executing else 0)
        ex = stream.executing
        assert ex is not None
        function = ex.function
        if not function:
            op = self._history.op_at_or_after(ex.seq)
            function = op[1] if op is not None and op[0] == ex.seq else ""
        what = f"s{ex.seq} {function}" if function else f"s{ex.seq}"
        return (
            f"executing {what} on stream {stream.name} for {ex.running_for_s:.1f} s",
            stream.name,
        )

    def _describe_stack(self, rank: int, d: RankStallData, stream: str | None) -> tuple[str, str]:
        """The rank's stack section of the warning, and the stack text for ``details``."""
        if d.stack is None or not d.stack.strip():
            reason = d.stack_error or (
                f"no answer within {format_seconds(self._report_timeout_s)} s"
                if d.stack is None
                else "empty dump"
            )
            text = f"stack unavailable ({reason})"
            return f"rank {rank}: {text}", text
        names = [stream] if stream is not None else None
        text = select_stack(d.stack, names)
        how = f" (via {d.stack_method})" if d.stack_method else ""
        indented = "\n".join(f"  {line}" if line else line for line in text.splitlines())
        return f"rank {rank} stack{how}:\n{indented}", text


# --------------------------------------------------------------------------- stack text

# A thread header of the three dump formats: in-process (``Thread 0x.. "name" (most recent
# call last):``), py-spy (``Thread 0x.. (idle): "name"``) and faulthandler (``Thread 0x..
# (most recent call first):`` / ``Current thread 0x.. ...``).
_THREAD_HEADER = re.compile(r"^(?:Current thread|Thread) ")
_QUOTED = re.compile(r'"([^"]*)"')


def _split_threads(text: str) -> list[tuple[str, list[str]]]:
    """``[(header, body lines)]`` per thread block; text before the first header is dropped."""
    blocks: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if _THREAD_HEADER.match(line):
            blocks.append((line, []))
        elif blocks:
            blocks[-1][1].append(line)
    return blocks


def _thread_name(header: str) -> str | None:
    m = _QUOTED.search(header)
    return m.group(1) if m else None


def _trim_block(header: str, lines: list[str], max_frames: int) -> str:
    """The block with at most ``max_frames`` innermost frames.

    A frame starts at a line with the block's smallest indentation; deeper lines (the
    source line of a traceback, py-spy's locals) belong to the frame above them. The
    header says which end is innermost (``most recent call last``: the end).
    """
    body = [ln for ln in lines if ln.strip()]
    if not body:
        return header
    indent = min(len(ln) - len(ln.lstrip()) for ln in body)
    frames: list[list[str]] = []
    for ln in body:
        if len(ln) - len(ln.lstrip()) == indent or not frames:
            frames.append([ln])
        else:
            frames[-1].append(ln)
    pad = " " * indent
    if len(frames) > max_frames:
        dropped = len(frames) - max_frames
        note = [f"{pad}... {dropped} outer frame{'s' if dropped > 1 else ''} omitted"]
        if "most recent call last" in header:
            frames = [note, *frames[-max_frames:]]
        else:
            frames = [*frames[:max_frames], note]
    return "\n".join([header, *(ln for frame in frames for ln in frame)])


def culprits(stacks: dict[int, str]) -> tuple[int, ...]:
    """Of stuck ranks (rank -> the stack of its stuck op), the ones a recovery kills.

    A rank whose stuck stack is inside ``torch.distributed`` waits for a peer in a
    collective: it is a victim, and its collective fails once the culprit is killed. The
    culprits are the others; when every rank waits in a collective (a mismatch between
    them, or no stack), all of them.
    """
    waiting = {r for r, text in stacks.items() if _waits_in_collective(text)}
    found = tuple(sorted(r for r in stacks if r not in waiting))
    return found or tuple(sorted(stacks))


_IN_COLLECTIVE = re.compile(r"torch[/\\]distributed[/\\]")
_FRAME_LINE = re.compile(r'^\s*File "')


def _waits_in_collective(stack: str, innermost: int = 3) -> bool:
    """Whether one of the ``innermost`` frames of a stuck stack (innermost last, as in
    the stall report) is torch.distributed's: a user frame under a distributed wrapper
    (FSDP, DTensor) is still the rank's own work."""
    frames = [line for line in stack.splitlines() if _FRAME_LINE.match(line)]
    return any(_IN_COLLECTIVE.search(line) for line in frames[-innermost:])


def select_stack(
    text: str, stream_names: Sequence[str] | None = None, max_frames: int = MAX_STACK_FRAMES
) -> str:
    """The part of a stack dump that shows the stuck op.

    With thread names in the dump: the threads of ``stream_names``
    (``palatine-stream-<name>``), or every stream thread when ``stream_names`` is
    ``None``; if none of them is in the dump, the whole dump. Without thread names
    (faulthandler): the whole dump. Each thread keeps its ``max_frames`` innermost
    frames. Text in no known format is returned unchanged.
    """
    blocks = _split_threads(text)
    if not blocks:
        return text.strip("\n")
    chosen = blocks
    if any(_thread_name(h) is not None for h, _ in blocks):
        if stream_names is not None:
            wanted = {STREAM_THREAD_PREFIX + n for n in stream_names}
            picked = [b for b in blocks if _thread_name(b[0]) in wanted]
        else:
            picked = [
                b for b in blocks if (_thread_name(b[0]) or "").startswith(STREAM_THREAD_PREFIX)
            ]
        if picked:
            chosen = picked
    return "\n".join(_trim_block(h, lines, max_frames) for h, lines in chosen)
