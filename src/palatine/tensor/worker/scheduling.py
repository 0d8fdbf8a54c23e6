"""The CPU scheduling of a worker proc's threads: Linux ``SCHED_BATCH`` and the GIL's
switch interval."""

from __future__ import annotations

import logging
import os
import sys

from palatine.hosting.child_env import Handoff

__all__ = ["batch_scheduling", "default_scheduling", "gil_switching"]

log = logging.getLogger(__name__)


def _own_process(proc_id: str) -> bool:
    """Whether this process was started for the proc (``PALATINE_PROC_ID``), not a
    program that hosts it among other things (a test, an in-process mesh)."""
    return Handoff.from_env().proc_id == proc_id


def batch_scheduling(proc_id: str) -> None:
    """Run this worker proc's threads (and the streams they start) as ``SCHED_BATCH``,
    when the process is the proc's own (started for it: ``PALATINE_PROC_ID``), not a
    program that hosts the worker among other things (a test, an in-process mesh).

    A worker woken by the controller's command would otherwise preempt the controller
    on its CPU before the controller has written the command to the other workers,
    and a stream woken by its loop would preempt the loop that still holds the GIL.
    Batch threads still get their fair share of the CPU; they only do not preempt on
    wake-up. Linux only; config ``worker_sched_batch`` (``PALATINE_WORKER_SCHED_BATCH=0``)
    turns it off, and a thread with any other policy than the default keeps it.
    """
    from palatine import config

    batch = getattr(os, "SCHED_BATCH", None)
    if batch is None or not config.get().worker_sched_batch:
        return
    if not _own_process(proc_id):
        return
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return
    for tid in tids:
        try:
            if os.sched_getscheduler(tid) == os.SCHED_OTHER:
                os.sched_setscheduler(tid, batch, os.sched_param(0))
        except OSError as e:  # a thread that just ended, or a kernel that refuses
            log.debug("worker: SCHED_BATCH not set on thread %d: %s", tid, e)
    os.register_at_fork(after_in_child=default_scheduling)


def gil_switching(proc_id: str) -> None:
    """Shorten the GIL's switch interval (config ``worker_switch_interval_us``) in the
    proc's own process (as `batch_scheduling` decides it).

    While a stream runs pure Python, every time the loop thread gives up the GIL for a
    read or a write it waits out a whole interval to get it back: with Python's 5 ms,
    answering a stall report's progress query and stack dump took 50-200 ms; with 1 ms,
    the report reaches the client about 40 ms after the deadline. Threads that do not
    compete for the GIL never notice the setting.
    """
    from palatine import config

    micros = config.get().worker_switch_interval_us
    if micros > 0 and _own_process(proc_id):
        before = sys.getswitchinterval()
        sys.setswitchinterval(micros / 1e6)
        # A process forked from the worker (a data loader, a pool) gets Python's back.
        os.register_at_fork(after_in_child=lambda: sys.setswitchinterval(before))


def default_scheduling() -> None:
    """A process forked from a worker (a data loader, a pool) gets the default policy
    back; a program started with exec from a worker thread keeps SCHED_BATCH."""
    try:
        if os.sched_getscheduler(0) == getattr(os, "SCHED_BATCH", -1):
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except OSError:
        pass
