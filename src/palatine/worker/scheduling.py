"""The CPU scheduling policy of a worker proc's threads (Linux ``SCHED_BATCH``)."""

from __future__ import annotations

import logging
import os

__all__ = ["batch_scheduling", "default_scheduling"]

log = logging.getLogger(__name__)


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
    if os.environ.get("PALATINE_PROC_ID") != proc_id:
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


def default_scheduling() -> None:
    """A process forked from a worker (a data loader, a pool) gets the default policy
    back; a program started with exec from a worker thread keeps SCHED_BATCH."""
    try:
        if os.sched_getscheduler(0) == getattr(os, "SCHED_BATCH", -1):
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except OSError:
        pass
