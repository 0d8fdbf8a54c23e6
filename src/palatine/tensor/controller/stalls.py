"""Collecting a stall report's data: the I/O half

`collect_stall_report` runs, for every lagging rank and in parallel, a progress query to
the worker actor and a stack dump from the worker's proc agent — falling back, after
half of the bound or on an error, to the proc's host, which dumps it from outside (works
while the worker's loop is blocked). Everything is bounded together by the request's
``timeout_s``; what did not answer in time is reported as missing, never waited for.
The ProgressMonitor turns the resulting `StallReport` into the warning text.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from palatine.core.mailbox import Mailbox
from palatine.errors import CallTimeout, error_text
from palatine.ids import GangId
from palatine.protocol.agent import StackDump, StackTrace
from palatine.protocol.controller import RankStallData, RequestStacks, StallReport, WorkerProcRecord
from palatine.protocol.worker import ProgressQuery, WorkerProgress

__all__ = ["collect_stall_report"]

log = logging.getLogger(__name__)


async def collect_stall_report(
    mailbox: Mailbox,
    gang: GangId,
    records: Mapping[int, WorkerProcRecord],
    req: RequestStacks,
) -> StallReport:
    """Progress answers and stacks of ``req.ranks``, within ``req.timeout_s`` in total."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + req.timeout_s
    try:
        data = list(
            await asyncio.gather(*(_rank(mailbox, gang, records, r, deadline) for r in req.ranks))
        )
    except Exception as e:  # noqa: BLE001 - the report goes out with what is known
        log.warning("stall report collection failed: %s", error_text(e))
        data = []
    return StallReport(report_id=req.report_id, expected_seq=req.expected_seq, ranks=data)


async def _rank(
    mailbox: Mailbox,
    gang: GangId,
    records: Mapping[int, WorkerProcRecord],
    rank: int,
    deadline: float,
) -> RankStallData:
    (progress, perr), (stack, method, serr) = await asyncio.gather(
        _progress_of(mailbox, gang, rank, deadline),
        _stack_of(mailbox, gang, records.get(rank), rank, deadline),
    )
    return RankStallData(
        rank=rank,
        progress=progress,
        progress_error=perr,
        stack=stack,
        stack_method=method,
        stack_error=serr,
    )


async def _progress_of(
    mailbox: Mailbox, gang: GangId, rank: int, deadline: float
) -> tuple[WorkerProgress | None, str | None]:
    """The worker actor's `WorkerProgress`; ``(None, None)`` when it did not answer in time."""
    left = deadline - asyncio.get_running_loop().time()
    if left <= 0:
        return None, None
    try:
        reply = await mailbox.ask(gang.actor(rank), ProgressQuery(), left)
    except CallTimeout:
        return None, None
    except Exception as e:  # noqa: BLE001 - reported in the stall text
        return None, error_text(e)
    return (reply, None) if isinstance(reply, WorkerProgress) else (None, "unexpected reply")


async def _stack_of(
    mailbox: Mailbox,
    gang: GangId,
    record: WorkerProcRecord | None,
    rank: int,
    deadline: float,
) -> tuple[str | None, str, str | None]:
    """``(text, method, error)``: the proc's own dump first, then its host's."""
    loop = asyncio.get_running_loop()
    proc = gang.world.proc(rank)
    half = max(0.01, (deadline - loop.time()) / 2)
    first: str
    try:
        st: StackTrace = await mailbox.ask(proc.actor("proc"), StackDump(timeout_s=half), half)
        if st.error is None and st.text.strip():
            return st.text, st.method or "in-process", None
        first = st.error or "empty dump"
    except CallTimeout:
        first = f"{proc} did not answer within {half:.1f} s"
    except Exception as e:  # noqa: BLE001 - reported in the stall text
        first = error_text(e)
    host = record.host_proc if record is not None else None
    left = deadline - loop.time() - 0.05
    if host is None or left <= 0.05:
        return None, "", first
    try:
        st = await mailbox.ask(
            host.actor("proc"), StackDump(target=proc, timeout_s=left * 0.9), left
        )
    except Exception as e:  # noqa: BLE001 - reported in the stall text
        return None, "", f"{first}; host {host}: {error_text(e)}"
    if st.error is None and st.text.strip():
        return st.text, st.method, None
    return None, "", f"{first}; host {host}: {st.error or 'empty dump'}"
