"""Aggregating identical lines from many ranks (`palatine.output.aggregate`)."""

from __future__ import annotations

from palatine.output.aggregate import OutputAggregator, rank_ranges


def test_rank_ranges_compress_runs() -> None:
    assert rank_ranges([3, 0, 1, 2, 5, 7, 8]) == "0-3,5,7-8"
    assert rank_ranges([4]) == "4"
    assert rank_ranges([]) == ""


def test_four_identical_lines_within_the_window_become_one() -> None:
    agg = OutputAggregator(window_s=0.5)
    for rank in (2, 0, 3, 1):
        assert agg.add("worker", rank, "epoch 1 done", now=10.0 + rank / 100) == []
    assert agg.due(10.4) == []
    assert agg.due(10.55) == ["[worker 0-3] epoch 1 done\n"]
    assert agg.next_due() is None


def test_each_ranks_lines_keep_their_order_and_other_worlds_stay_apart() -> None:
    agg = OutputAggregator(window_s=1.0)
    agg.add("worker", 0, "a", 0.0)
    agg.add("worker", 0, "b", 0.1)
    agg.add("worker", 1, "a", 0.2)
    agg.add("other", 1, "a", 0.3)
    agg.add("worker", 0, "a", 0.4)  # rank 0 repeats: a line of its own, after "b"
    assert agg.flush() == [
        "[worker 0-1] a\n",
        "[worker 0] b\n",
        "[other 1] a\n",
        "[worker 0] a\n",
    ]


def test_a_line_arriving_after_the_window_starts_a_new_group() -> None:
    agg = OutputAggregator(window_s=0.5)
    agg.add("w", 0, "tick", 0.0)
    agg.add("w", 1, "tick", 0.6)
    assert agg.due(0.6) == ["[w 0] tick\n"]
    assert agg.due(1.1) == ["[w 1] tick\n"]


def test_no_window_writes_every_line_at_once() -> None:
    agg = OutputAggregator(window_s=0)
    assert agg.add("w", 3, "x", 0.0) == ["[w 3] x\n"]
    assert agg.flush() == []


def test_held_lines_are_bounded_by_writing_the_oldest_early() -> None:
    agg = OutputAggregator(window_s=60, max_pending=3)
    out: list[str] = []
    for i in range(5):
        out += agg.add("w", 0, f"line {i}", float(i))
    assert out == ["[w 0] line 0\n", "[w 0] line 1\n"]
    assert len(agg.flush()) == 3
