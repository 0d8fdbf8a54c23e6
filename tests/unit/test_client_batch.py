"""How one client flush is cut into `Send`s (palatine.tensor.client.outbox.group_sends) and
the plain-argument fast path of `pickle_args`."""

from __future__ import annotations

import pickle

import pytest

from palatine.protocol.worker import (
    CommandGroup,
    DeleteRefs,
    Pickled,
    RequestStatus,
    SendValue,
    Slice,
)
from palatine.tensor.client.outbox import group_sends
from palatine.tensor.client.values import pickle_args
from palatine.tensor.worker.values import dumps_args

ALL = Slice(0, [4], [1])


def _sends(cmds):  # (ranks, decoded message) per Send
    return [(s.ranks, s.message.decode()) for s in group_sends(cmds)]


def test_one_command_travels_alone() -> None:
    assert _sends([(ALL, DeleteRefs(refs=[1]))]) == [([ALL], DeleteRefs(refs=[1]))]


def test_consecutive_commands_for_one_slice_become_one_group() -> None:
    cmds = [(ALL, DeleteRefs(refs=[1])), (Slice(0, [4], [1]), RequestStatus(seq=3))]
    assert _sends(cmds) == [
        ([ALL], CommandGroup(commands=[DeleteRefs(refs=[1]), RequestStatus(seq=3)]))
    ]


def test_several_slices_are_regrouped_per_rank_keeping_each_ranks_order() -> None:
    one = Slice(0, [1], [1])
    fetch = SendValue(seq=2, function=None, args=Pickled(b"x"), stream=0)
    cmds = [(ALL, DeleteRefs(refs=[1])), (one, fetch), (ALL, RequestStatus(seq=2))]
    got = _sends(cmds)
    assert got == [
        ([one], CommandGroup(commands=[DeleteRefs(refs=[1]), fetch, RequestStatus(seq=2)])),
        ([Slice(1, [3], [1])], CommandGroup(commands=[DeleteRefs(refs=[1]), RequestStatus(seq=2)])),
    ]


def test_disjoint_rank_sets_become_contiguous_slices() -> None:
    evens = Slice(0, [2], [2])  # ranks 0, 2
    cmds = [(evens, DeleteRefs(refs=[1])), (ALL, RequestStatus(seq=1))]
    got = _sends(cmds)
    assert got == [
        (
            [Slice(0, [1], [1]), Slice(2, [1], [1])],
            CommandGroup(commands=[DeleteRefs(refs=[1]), RequestStatus(seq=1)]),
        ),
        ([Slice(1, [1], [1]), Slice(3, [1], [1])], RequestStatus(seq=1)),
    ]


def test_a_malformed_slice_is_left_for_the_controller_to_report() -> None:
    bad = Slice(0, [2], [])
    cmds = [(bad, DeleteRefs(refs=[1])), (ALL, RequestStatus(seq=1))]
    assert _sends(cmds) == [([bad], DeleteRefs(refs=[1])), ([ALL], RequestStatus(seq=1))]


@pytest.mark.parametrize(
    "args,kwargs",
    [((1, 2.5, "x", b"y", None, True), {}), ((), {"lr": 0.1, "name": "a"}), ((), {})],
)
def test_plain_arguments_pickle_like_the_general_path(args, kwargs) -> None:
    def refuse(h):  # pragma: no cover - plain values hold no handle
        raise AssertionError(h)

    fast, refs = pickle_args((args, kwargs), refuse)
    assert refs == [] and fast.buffers == []
    assert pickle.loads(fast.data) == pickle.loads(dumps_args(args, kwargs).data) == (args, kwargs)


def test_containers_take_the_general_path() -> None:
    seen = []
    p, refs = pickle_args((([1, 2],), {}), seen.append)
    assert refs == [] and pickle.loads(p.data) == (([1, 2],), {})


def test_argument_buffers_are_snapshotted_at_call_time() -> None:
    np = pytest.importorskip("numpy")
    a = np.arange(1000, dtype=np.int64)
    p, _ = pickle_args(((a,), {}), lambda h: None)
    a[:] = -1  # the caller changes its array after the call, before any flush
    (args, _kw) = pickle.loads(p.data, buffers=p.buffers)
    assert args[0].tolist() == list(range(1000))
