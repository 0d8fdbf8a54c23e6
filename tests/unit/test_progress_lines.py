"""Progress bars (`palatine.output.progress`): a pipe's ``\\r`` states are told apart
from its lines, at most ten a second per rank travel with the newest never lost, and the
client shows one updating line per group of ranks with the same state."""

from __future__ import annotations

from palatine.output.progress import CarriageSplitter, ProgressBoard, RateLimit, last_state


def test_the_newest_state_of_an_unfinished_line_is_told_as_it_comes() -> None:
    split = CarriageSplitter()
    assert split.partial(b"\r 10%|#") == (b" 10%|#", b" 10%|#")  # tqdm: "\r" then the state
    assert split.partial(b"\r 10%|#") == (None, b" 10%|#")  # (the same state: nothing new)
    assert split.partial(b"step 3\r") == (b"step 3", b"")  # a state that ends in "\r"
    assert split.partial(b"no carriage") == (None, b"no carriage")


def test_a_finished_line_keeps_its_last_state_only() -> None:
    split = CarriageSplitter()
    assert split.lines([b"\r 10%\r 50%\r100%", b"plain", b"crlf\r"]) == [b"100%", b"plain", b"crlf"]
    split.partial(b"step 3\r")
    assert split.shown
    assert split.lines([b""]) == [b"step 3"]  # "step 3\r\n": the shown state is the line
    assert split.lines([b""]) == [b""]  # (an empty line stays one)
    assert last_state(b"\r\r") == b""


def test_at_most_ten_states_a_second_go_and_the_newest_held_one_follows() -> None:
    limit = RateLimit(per_s=10)
    assert limit.offer("1", 0.0) == "1"
    assert limit.offer("2", 0.02) is None
    assert limit.offer("3", 0.05) is None
    assert limit.next_at() == 0.1
    assert limit.due(0.09) is None
    assert limit.due(0.1) == "3"  # the newest; "2" never goes
    assert limit.due(0.5) is None
    assert limit.offer("4", 0.15) is None  # (0.05 s after "3")
    limit.drop()  # an ordinary line of the rank came: the bar is over
    assert limit.next_at() is None
    assert limit.offer("5", 0.3) == "5"


def test_ranks_with_the_same_state_share_one_line() -> None:
    board = ProgressBoard(tty=False)
    for rank, state in ((0, "5/10"), (1, "5/10"), (2, "4/10"), (3, "5/10")):
        board.update("worker", rank, state)
    assert board.groups() == ["[worker 0-1,3] 5/10", "[worker 2] 4/10"]
    assert board.done("worker", 2) and not board.done("worker", 2)
    assert board.groups() == ["[worker 0-1,3] 5/10"]


def test_a_pipe_gets_one_line_rewritten_with_carriage_returns() -> None:
    board = ProgressBoard(tty=False)
    board.update("w", 0, "long state text")
    assert board.draw() == "\r[w 0] long state text"
    board.update("w", 0, "short")
    assert board.draw() == "\r[w 0] short" + " " * 10  # (the longer text blanked out)
    assert board.erase() == "\n" and not board.shown
    assert board.erase() == ""


def test_a_terminal_gets_a_block_redrawn_in_place() -> None:
    board = ProgressBoard(tty=True, width=40)
    board.update("w", 0, "a")
    board.update("w", 1, "b" * 100)
    first = board.draw()
    assert first == "[w 0] a\n[w 1] " + "b" * 32 + "…"  # cut to the width
    assert board.draw().startswith("\x1b[1F\x1b[J")  # up one row, clear, redraw
    assert board.erase() == "\x1b[1F\x1b[J"
    board.done("w", 1)
    board.draw()
    assert board.end() == "\n" and not board.shown
