"""The failure summary ``palatine torchrun`` prints, in the layout of torchrun's own
(``ChildFailedError``): the program, the other failures, then the root cause, each with
time, host, rank and local rank, exit code (negative: the signal) and pid, and the
error's text where torchrun prints a pointer to its error-file docs."""

from __future__ import annotations

from datetime import datetime

from palatine.spmd.launcher import ElasticResult, RankFailure

__all__ = ["failure_summary"]

_WIDTH = 60


def failure_summary(result: ElasticResult) -> str:
    """The summary of ``result``'s failures ("" when it succeeded)."""
    if not result.failures:
        return ""
    root, *others = result.failures
    blocks = [_block(i + 1, f) for i, f in enumerate(others)] or ["  <NO_OTHER_FAILURES>"]
    border, section = "=" * _WIDTH, "-" * _WIDTH
    return "\n".join(
        [
            border,
            f"{result.program} FAILED",
            section,
            "Failures:",
            *blocks,
            section,
            "Root Cause (first observed failure):",
            _block(0, root),
            border,
        ]
    )


def _block(idx: int, f: RankFailure) -> str:
    name = f" ({f.signal_name})" if f.signal_name else ""
    when = datetime.fromtimestamp(f.at).isoformat(sep="_", timespec="seconds")
    text = f.traceback.rstrip() if f.traceback else f.error
    return "\n".join(
        [
            f"[{idx}]:",
            f"  time      : {when}",
            f"  host      : {f.host}",
            f"  rank      : {f.rank} (local_rank: {f.local_rank})",
            f"  exitcode  : {f.exit_code} (pid: {f.pid}){name}",
            f"  proc      : {f.proc}",
            "  error_file: <N/A>",
            "  traceback : " + text.replace("\n", "\n  "),
        ]
    )
