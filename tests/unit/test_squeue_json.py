"""`palatine job status` reads Slurm's state from ``squeue --json`` where Slurm has it:
the document's two shapes (plain values up to Slurm 23.02, ``{"set", "number"}`` and a
list of state words since) give the same fields as ``squeue -o``'s words."""

from __future__ import annotations

import pytest

from palatine.job.slurm import _json_info, _slurm_elapsed

NOW = 1_800_000_000.0


def test_a_running_job_of_the_older_document_gives_state_elapsed_and_nodes() -> None:
    job = {
        "job_id": 42,
        "job_state": "RUNNING",
        "start_time": int(NOW) - 3725,
        "node_count": 2,
        "nodes": "node[0-1]",
        "comment": "palatine:/shared/logs/slurm-1",
    }
    info, comment = _json_info(job, NOW)
    assert info == {"state": "RUNNING", "elapsed": "1:02:05", "nodes": "2", "nodelist": "node[0-1]"}
    assert comment == "palatine:/shared/logs/slurm-1"


def test_a_running_job_of_the_newer_document_gives_the_same_fields() -> None:
    job = {
        "job_id": 42,
        "job_state": ["RUNNING"],
        "start_time": {"set": True, "infinite": False, "number": int(NOW) - 65},
        "node_count": {"set": True, "infinite": False, "number": 2},
        "nodes": "node[0-1]",
        "comment": "",
    }
    info, comment = _json_info(job, NOW)
    assert info == {"state": "RUNNING", "elapsed": "1:05", "nodes": "2", "nodelist": "node[0-1]"}
    assert comment == ""


def test_a_pending_job_has_run_for_no_time_and_has_no_nodes_yet() -> None:
    job = {
        "job_id": 7,
        "job_state": ["PENDING"],
        "start_time": {"set": True, "number": int(NOW) + 600},  # Slurm's estimate
        "node_count": {"set": True, "number": 2},
        "nodes": "",
    }
    info, _ = _json_info(job, NOW)
    assert (info["state"], info["elapsed"], info["nodelist"]) == ("PENDING", "0:00", "")


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0:00"), (59.9, "0:59"), (61, "1:01"), (3600, "1:00:00"), (90061, "1-01:01:01")],
)
def test_elapsed_time_is_written_as_slurm_writes_it(seconds: float, text: str) -> None:
    assert _slurm_elapsed(seconds) == text


def test_a_document_without_a_state_is_not_read() -> None:
    with pytest.raises((KeyError, TypeError)):
        _json_info({"job_id": 1, "job_state": 5}, NOW)


def test_an_array_task_is_known_by_squeues_id_for_it() -> None:
    from palatine.job.slurm import _json_id

    task = {"job_id": 130, "array_job_id": {"set": True, "number": 123},
            "array_task_id": {"set": True, "number": 4}}  # fmt: skip
    assert _json_id(task) == "123_4"
    plain = {"job_id": 42, "array_job_id": {"set": True, "number": 0},
             "array_task_id": {"set": False, "number": 0}}  # fmt: skip
    assert _json_id(plain) == "42"
    assert _json_id({"job_id": 7, "array_job_id": 0, "array_task_id": None}) == "7"
