"""Values on the worker wire: refs as persistent ids,
tensors out of band, function resolution, user-error formatting, device mesh views."""

from __future__ import annotations

import linecache
import os
import pickle
import threading
from typing import Any

import pytest
import torch

from palatine.protocol.worker import Cloudpickle, FunctionPath, Pickled, Slice, WorkerError
from palatine.tensor.worker.collectives import DeviceMeshView, mesh_rank
from palatine.tensor.worker.user_errors import (
    format_user_traceback,
    pickle_exception,
    user_error_fields,
)
from palatine.tensor.worker.values import (
    FunctionCache,
    SeqError,
    dumps_args,
    dumps_fetched,
    dumps_value,
    function_ref,
    load_args,
    load_value,
    loads_value,
    pickle_function,
    ref_of,
)

pytestmark = pytest.mark.timeout(30)


class Handle:
    """A client handle stand-in."""

    def __init__(self, n: int) -> None:
        self.__palatine_ref__ = n


def module_level(x: int) -> int:
    return x + 1


def with_impl() -> str:
    return "client side"


def _impl() -> str:
    return "worker side"


with_impl._remote_impl = _impl  # type: ignore[attr-defined]

NOT_CALLABLE = 42


# --------------------------------------------------------------------------- refs


def test_handles_become_persistent_ids_and_map_back_in_argument_order() -> None:
    p = dumps_args((Handle(3), [Handle(5), "x"]), {"k": Handle(3), "plain": 1})
    assert b"__palatine_ref__" not in p.data
    seen: list[int] = []

    def lookup(n: int) -> Any:
        seen.append(n)
        return f"value{n}"

    args, kwargs = load_args(p, lookup)
    assert args == ("value3", ["value5", "x"])
    assert kwargs == {"k": "value3", "plain": 1}
    assert seen == [3, 5, 3]


def test_ref_of_needs_an_int_attribute() -> None:
    assert ref_of(Handle(7)) == 7
    assert ref_of(object()) is None
    assert ref_of(3) is None

    class Odd:
        __palatine_ref__ = "no"

    assert ref_of(Odd()) is None


def test_missing_ref_error_propagates_from_lookup() -> None:
    p = dumps_args((Handle(5),), {})

    def lookup(n: int) -> Any:
        raise LookupError(f"ref r{n} not found on stream main of rank 2")

    with pytest.raises(LookupError, match="ref r5 not found on stream main of rank 2"):
        load_args(p, lookup)


def test_seq_error_placeholders_are_returned_as_is() -> None:
    werr = WorkerError(
        seq=5,
        rank=1,
        world="w",
        proc_id="w[1]",
        host="h",
        pid=1,
        stream="main",
        function="f",
        exc_type="builtins.ValueError",
        message="bad",
    )
    err = SeqError(5, werr)
    args, _ = load_args(dumps_args((Handle(1),), {}), lambda n: err)
    assert args[0] is err
    assert err.text() == "s5 failed on rank 1 (f): builtins.ValueError: bad"


def test_load_args_rejects_other_shapes() -> None:
    with pytest.raises(TypeError, match=r"must pickle \(args, kwargs\)"):
        load_args(Pickled(pickle.dumps([1, 2, 3])), lambda n: None)


def test_set_ref_values_may_hold_refs_too() -> None:
    assert load_value(dumps_value({"a": Handle(2)}), lambda n: n * 10) == {"a": 20}


# --------------------------------------------------------------------------- tensors


def test_dense_tensors_travel_as_one_out_of_band_buffer_each() -> None:
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = a.t()  # not contiguous
    c = torch.empty(0, 3)
    d = torch.ones(2, dtype=torch.bfloat16)
    p = dumps_value((a, b, c, d, torch.tensor(7)))
    assert len(p.buffers) == 4  # the empty tensor needs none
    got = loads_value(Pickled(p.data, [bytes(x) for x in p.buffers]))
    for x, y in zip(got, (a, b, c, d, torch.tensor(7)), strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)
    got[0].add_(1)  # received tensors are writable and do not alias the wire bytes
    assert torch.equal(a, torch.arange(12, dtype=torch.float32).reshape(3, 4))


def test_args_keep_requires_grad_but_fetches_detach() -> None:
    leaf = torch.ones(2, requires_grad=True)
    (sent,), _ = load_args(dumps_args((leaf,), {}), lambda n: None)
    assert sent.requires_grad
    nonleaf = leaf * 2
    fetched = loads_value(dumps_fetched({"t": nonleaf}))
    assert not fetched["t"].requires_grad and torch.equal(fetched["t"], torch.full((2,), 2.0))


def test_fetched_parameter_arrives_as_a_plain_tensor() -> None:
    param = torch.nn.Parameter(torch.ones(2))
    got = loads_value(dumps_fetched([param]))[0]
    assert type(got) is torch.Tensor and not got.requires_grad
    assert torch.equal(got, torch.ones(2))


def test_fetched_value_is_a_snapshot() -> None:
    t = torch.zeros(3)
    p = dumps_fetched(t)
    frozen = Pickled(p.data, [bytes(b) for b in p.buffers])
    t.add_(1)
    assert torch.equal(loads_value(frozen), torch.zeros(3))


def test_fetched_buffers_are_private_snapshots_that_go_out_of_band() -> None:
    import numpy as np

    t = torch.zeros(3, 4)[:, 1:]  # a view of a bigger tensor, not contiguous
    c = np.arange(12.0).reshape(3, 4)
    f = np.asfortranarray(c)
    big = torch.arange(2**19, dtype=torch.float32)  # 2 MiB: pooled memory
    p = dumps_fetched((t, c, f, big))
    assert len(p.buffers) == 4 and all(type(b) is pickle.PickleBuffer for b in p.buffers)
    t.add_(1)
    c += 1
    f += 1
    big.mul_(0)
    got = loads_value(p)  # the buffers themselves, not copies made in between
    assert torch.equal(got[0], torch.zeros(3, 3))
    assert np.array_equal(got[1], np.arange(12.0).reshape(3, 4))
    assert np.array_equal(got[2], np.arange(12.0).reshape(3, 4)) and got[2].flags.f_contiguous
    assert torch.equal(got[3], torch.arange(2**19, dtype=torch.float32))


def test_argument_buffers_are_views_that_stay_inline() -> None:
    t = torch.ones(4)
    p = dumps_args((t,), {})
    assert [type(b) for b in p.buffers] == [memoryview]  # never sent out of band


def test_unpicklable_fetch_names_the_type() -> None:
    with pytest.raises(TypeError, match=r"cannot pickle a value of type _thread\.lock for fetch"):
        dumps_fetched(threading.Lock())


def test_lambdas_in_values_fall_back_to_cloudpickle() -> None:
    p = dumps_value({"f": lambda x: x * 3})
    assert loads_value(p)["f"](2) == 6


# --------------------------------------------------------------------------- functions


@pytest.mark.parametrize(
    ("path", "args", "expected"),
    [
        ("torch.add", (torch.tensor(1), torch.tensor(2)), torch.tensor(3)),
        ("torch.nn.functional.relu", (torch.tensor([-1.0, 2.0]),), torch.tensor([0.0, 2.0])),
        ("torch.ops.aten.add.Tensor", (torch.tensor(1), torch.tensor(2)), torch.tensor(3)),
        ("os.path.split", ("/a/b",), ("/a", "b")),
    ],
)
def test_paths_resolve_by_longest_module_prefix(path: str, args: Any, expected: Any) -> None:
    rf = FunctionCache().resolve(FunctionPath(path), 0)
    assert rf.label == path
    got = rf.fn(*args)
    if isinstance(expected, torch.Tensor):
        assert torch.equal(got, expected)
    else:
        assert got == expected


def test_remote_impl_is_called_instead() -> None:
    rf = FunctionCache().resolve(FunctionPath(f"{__name__}.with_impl"), 0)
    assert rf.fn() == "worker side"


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("i.dont.exist", "ModuleNotFoundError"),
        ("os.path.nope", "AttributeError"),
        (f"{__name__}.NOT_CALLABLE", "int object is not callable"),
        ("not a path", "not a dotted import path"),
    ],
)
def test_resolution_failure_text(path: str, why: str) -> None:
    with pytest.raises(ImportError) as ei:
        FunctionCache().resolve(FunctionPath(path), 0)
    assert str(ei.value).startswith(f"failed to resolve function {path}: ")
    assert why in str(ei.value)


def test_resolutions_are_cached_per_path_and_digest() -> None:
    cache = FunctionCache()
    assert cache.resolve(FunctionPath("os.getpid"), 0) is cache.resolve(
        FunctionPath("os.getpid"), 0
    )
    blob = pickle_function(lambda: 1)
    assert cache.resolve(blob, 0) is cache.resolve(Cloudpickle(blob.data, {}), 0)


def test_function_ref_by_path_or_by_value() -> None:
    assert function_ref(module_level) == FunctionPath(f"{__name__}.module_level")
    assert function_ref("torch.add") == FunctionPath("torch.add")
    fn = function_ref(lambda x: x + 2)
    assert isinstance(fn, Cloudpickle)
    assert os.path.abspath(__file__) in {os.path.abspath(k) for k in fn.sources}
    rf = FunctionCache().resolve(fn, 0)
    assert rf.fn(1) == 3 and rf.label.endswith("<lambda>")


def test_cloudpickled_function_gets_its_file_and_source_lines_back(tmp_path: Any) -> None:
    path = tmp_path / "client_file.py"
    src = "import os\n\ndef explode(n):\n    return 1 / n  # boom line\n"
    path.write_text(src)
    ns: dict[str, Any] = {"__name__": "client_file"}
    exec(compile(src, str(path), "exec"), ns)  # noqa: S102 - a function from a file that goes away
    blob = pickle_function(ns["explode"])
    path.unlink()
    linecache.clearcache()
    rf = FunctionCache().resolve(blob, 0)
    assert rf.label == "client_file.explode"
    try:
        rf.fn(0)
    except ZeroDivisionError as e:
        linecache.clearcache()  # shipped sources survive a cleared cache
        tb = format_user_traceback(e)
    assert f'File "{path}", line 4, in explode' in tb
    assert "return 1 / n  # boom line" in tb


def test_torch_path_without_torch_names_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from palatine.tensor.worker import values

    monkeypatch.setattr(values, "import_torch", lambda: None)
    with pytest.raises(ModuleNotFoundError, match="torch is not installed on worker rank 2"):
        FunctionCache().resolve(FunctionPath("torch.ones"), 2)


# --------------------------------------------------------------------------- user errors


def _raise_via_palatine() -> None:
    from palatine.tensor.worker.values import load_args as palatine_frame

    def user_fn(n: int) -> Any:
        raise ValueError("from user code")

    palatine_frame(dumps_args((Handle(1),), {}), user_fn)


def test_user_traceback_drops_palatine_frames() -> None:
    try:
        _raise_via_palatine()
    except ValueError as e:
        tb = format_user_traceback(e)
    assert "_raise_via_palatine" in tb and "user_fn" in tb
    assert "palatine/tensor/worker/values.py" not in tb
    assert tb.rstrip().endswith("ValueError: from user code")


def test_exception_pickled_only_when_small_and_round_trips() -> None:
    assert pickle.loads(pickle_exception(KeyError("k")) or b"").args == ("k",)
    assert pickle_exception(ValueError("x" * (2 << 20))) is None

    class Local(Exception):
        def __init__(self, a: int, b: int) -> None:
            super().__init__(a)

    assert pickle_exception(Local(1, 2)) is None  # pickles but cannot unpickle
    fields = user_error_fields(ZeroDivisionError("division by zero"))
    assert fields["exc_type"] == "builtins.ZeroDivisionError"
    assert fields["message"] == "division by zero"


# --------------------------------------------------------------------------- mesh views


def test_mesh_view_2x3_rank_1() -> None:
    v = DeviceMeshView.create(1, ["a", "b"], Slice(0, [2, 3], [3, 1]), 1)
    assert (v.rank("a"), v.rank("b")) == (0, 1)
    assert v.members("a") == [1, 4]
    assert v.members("b") == [0, 1, 2]
    assert v.members(None) == [0, 1, 2, 3, 4, 5]
    assert v.size("a") == 2 and v.size("b") == 3 and v.size() == 6
    assert v.names == ("a", "b") and v.coordinates == {"a": 0, "b": 1}
    assert mesh_rank(v, "b") == 1 and mesh_rank(v, ["a", "b"]) == (0, 1)


def test_mesh_view_2x2x2_rank_5() -> None:
    v = DeviceMeshView.create(1, ["x", "y", "z"], Slice(0, [2, 2, 2], [4, 2, 1]), 5)
    assert [v.members(d) for d in ("x", "y", "z")] == [[1, 5], [5, 7], [4, 5]]
    assert v.members(["y", "z"]) == [4, 5, 6, 7]


def test_mesh_view_of_an_offset_slice_and_errors() -> None:
    v = DeviceMeshView.create(2, ["host"], Slice(2, [2], [2]), 4)
    assert v.rank("host") == 1 and v.members("host") == [2, 4]
    with pytest.raises(ValueError, match="rank 3 is outside device mesh r2"):
        DeviceMeshView.create(2, ["host"], Slice(2, [2], [2]), 3)
    with pytest.raises(ValueError, match="unknown dimension 'proc'"):
        v.rank("proc")
    with pytest.raises(ValueError, match="1 names, 2 sizes"):
        DeviceMeshView.create(2, ["host"], Slice(0, [2, 2], [2, 1]), 0)
    assert pickle.loads(pickle.dumps(v)).members("host") == [2, 4]


def test_frames_of_every_palatine_package_are_the_runtimes_and_a_users_are_not() -> None:
    import importlib

    from palatine.tensor.worker.user_errors import is_palatine_frame

    for name in ("palatine.core.actor", "palatine.tensor.client.remote", "palatine.wire.codec"):
        assert is_palatine_frame(importlib.import_module(name).__file__ or "")
    assert not is_palatine_frame(__file__)
    assert not is_palatine_frame("/elsewhere/palatine_user_script.py")
