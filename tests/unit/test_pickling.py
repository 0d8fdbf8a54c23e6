"""User values on the wire: by reference (the stdlib pickler) unless they name code that
another process cannot import, which cloudpickle ships by value (`palatine.wire.codec`,
`palatine.tensor.worker.values`).

The choice is made while pickling (`refers_by_value`, asked by the picklers'
``reducer_override``), never by scanning the pickle's bytes: a payload whose bytes happen
to spell ``__main__`` stays a plain pickle, and a 64 MiB payload costs no scan.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest

from palatine.wire import codec
from palatine.wire.codec import dumps, refers_by_value

pytestmark = pytest.mark.timeout(60)

# Run as __main__ in one interpreter: every value pickled both ways, saved to a file.
MAKE = textwrap.dedent(
    """
    import functools, pickle, sys
    from palatine.wire.codec import dumps
    from palatine.tensor.worker.values import dumps_value

    def f(x):
        return x + 1

    class C:
        def __init__(self):
            self.v = 5

    def make_local():
        def g(x):
            return x * 2
        return g

    bare = {}  # a namespace without __name__: its function has no module
    exec("def h(x): return x + 10", bare)
    h = bare["h"]  # (also reachable as __main__.h here, but not in another __main__)

    cases = {
        "main_function": f,
        "moduleless_function": h,
        "main_class": C,
        "main_instance": C(),
        "lambda": lambda x: x - 1,
        "local_function": make_local(),
        "partial_of_main": functools.partial(f, 1),
        "nested": [1, "a", (f,)],
        "bytes_naming_main": b"__main__ <lambda> <locals>" * 1000,
        "plain": {"a": [1, 2.5, "s"], "b": pickle.PickleBuffer(bytearray(b"xyz"))},
    }
    out = {}
    for name, value in cases.items():
        data, bufs = dumps(value)
        out["codec", name] = (data, [bytes(b.raw()) for b in bufs])
        p = dumps_value(value)
        out["worker", name] = (p.data, [bytes(b) for b in p.buffers])
    with open(sys.argv[1], "wb") as fh:
        pickle.dump(out, fh)
    """
)

# Run in another interpreter (another __main__): load each and use it.
USE = textwrap.dedent(
    """
    import pickle, sys
    with open(sys.argv[1], "rb") as fh:
        out = pickle.load(fh)
    for (how, name), (data, bufs) in sorted(out.items()):
        v = pickle.loads(data, buffers=bufs)
        if name == "main_function": got = v(1)
        elif name == "main_class": got = v().v
        elif name == "main_instance": got = v.v
        elif name == "moduleless_function": got = v(1)
        elif name == "lambda": got = v(3)
        elif name == "local_function": got = v(2)
        elif name == "partial_of_main": got = v()
        elif name == "nested": got = v[2][0](1)
        elif name == "bytes_naming_main": got = len(v)
        else: got = (v["a"], bytes(v["b"]))
        print(how, name, repr(got), b"cloudpickle" in data)
    """
)


def test_values_naming_main_lambdas_or_locals_arrive_by_value_in_another_process(
    tmp_path: Path,
) -> None:
    saved = tmp_path / "pickles"
    for script in (MAKE, USE):
        proc = subprocess.run(
            [sys.executable, "-c", script, str(saved)], capture_output=True, text=True, timeout=50
        )
        assert proc.returncode == 0, proc.stderr
    got = {
        tuple(line.split(" ", 2)[:2]): line.split(" ", 2)[2] for line in proc.stdout.splitlines()
    }
    expect = {
        "main_function": "2 True",
        "moduleless_function": "11 True",
        "main_class": "5 True",
        "main_instance": "5 True",
        "lambda": "2 True",
        "local_function": "4 True",
        "partial_of_main": "2 True",
        "nested": "2 True",
        # Plain data stays a stdlib pickle, whatever its bytes spell.
        "bytes_naming_main": "26000 False",
        "plain": "([1, 2.5, 's'], b'xyz') False",
    }
    for how in ("codec", "worker"):
        for name, want in expect.items():
            assert got[how, name] == want, (how, name)


class _Inner:
    """Pickles itself by pickling something else through `dumps` (re-entrant use)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> Any:
        data, _ = dumps(self.value)
        return (pickle.loads, (data,))


def test_dumps_is_reentrant_and_recovers_after_a_failure() -> None:
    data, _ = dumps([_Inner({"k": 1}), _Inner([2, 3]), "after"])
    assert pickle.loads(data) == [{"k": 1}, [2, 3], "after"]
    with pytest.raises(TypeError):
        dumps({"lock": threading.Lock()})  # neither pickler can: the caller hears why
    data, bufs = dumps(("ping", (1,), {}))
    assert pickle.loads(data, buffers=bufs) == ("ping", (1,), {}) and bufs == []


class _Payload:
    def __init__(self, n: int) -> None:
        self.blob = bytearray(n)

    def __reduce__(self) -> Any:
        return (bytearray, (pickle.PickleBuffer(self.blob),))


def test_the_reused_pickler_keeps_nothing_of_a_value_once_it_is_pickled() -> None:
    value = _Payload(1 << 20)
    gone = weakref.ref(value)
    data, bufs = dumps([value, {"k": value}])
    del value, bufs
    assert gone() is None  # neither the memo nor the output buffer holds it
    assert len(pickle.loads(data, buffers=[bytearray(1 << 20)])[0]) == 1 << 20


class _Temp:
    """Held only by the pickler's memo; its finalizer pickles something else (as a
    handle's finalizer that sends a release message would)."""

    def __reduce__(self) -> Any:
        return (_Temp, ())

    def __del__(self) -> None:
        dumps(("inner", 1))


def _rebuild(_temp: Any, blob: Any) -> bytes:
    return bytes(blob)


class _WithTemp:
    def __init__(self, n: int) -> None:
        self.blob = bytearray(b"z" * n)

    def __reduce__(self) -> Any:
        return (_rebuild, (_Temp(), pickle.PickleBuffer(self.blob)))


def test_a_finalizer_that_pickles_while_the_memo_is_cleared_gets_its_own_pickler() -> None:
    data, bufs = dumps(_WithTemp(100))
    assert len(bufs) == 1  # the outer pickle keeps its out-of-band buffer
    assert pickle.loads(data, buffers=bufs) == b"z" * 100
    data, bufs = dumps(("after", [1, 2]))
    assert pickle.loads(data, buffers=bufs) == ("after", [1, 2])


def test_threads_pickle_independently() -> None:
    results: dict[int, bool] = {}

    def work(i: int) -> None:
        ok = True
        for j in range(300):
            value = {"thread": i, "j": j, "blob": bytes([i]) * (j % 7)}
            data, _ = dumps(value)
            ok = ok and pickle.loads(data) == value
        results[i] = ok

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {0: True, 1: True, 2: True, 3: True}


def test_the_choice_is_made_from_the_objects_not_from_the_bytes() -> None:
    p = codec._Pickler()
    p.pickle({"payload": b"__main__ <lambda> <locals>" * 1000, "name": "__main__"})
    assert not p.by_value  # data that spells the names is still plain data
    with pytest.raises((AttributeError, pickle.PicklingError)):
        p.pickle([1, (refers_by_value, lambda: None)])  # (`dumps` then uses cloudpickle)
    assert p.by_value


def test_refers_by_value() -> None:
    def local() -> None:
        pass

    class Odd:
        def __getattr__(self, name: str) -> Any:
            raise RuntimeError("no attributes here")

    assert refers_by_value(local)
    assert refers_by_value(lambda: None)
    assert refers_by_value(Odd)  # a local class
    assert not refers_by_value(Odd())  # its odd __getattr__ is not a by-value reason
    assert not refers_by_value(pickle.loads)
    assert not refers_by_value(Path)
    assert not refers_by_value(Path("."))


def test_a_cpu_tensor_goes_out_of_band_over_a_snapshot_and_arrives_without_torch_save() -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(1 << 16, dtype=torch.float32)
    leaf = torch.ones(3, requires_grad=True)
    data, buffers = dumps({"t": t, "leaf": leaf})
    assert len(buffers) == 2  # every tensor out of band: the pickle itself stays small
    assert len(data) < 1024
    t.add_(1)  # a snapshot was sent: what the owner does afterwards is not seen
    got = codec.loads(data, buffers)
    assert torch.equal(got["t"], torch.arange(1 << 16, dtype=torch.float32))
    assert got["leaf"].requires_grad and torch.equal(got["leaf"].detach(), torch.ones(3))
    got["t"].add_(1)  # a received tensor is writable, over memory of its own
    assert torch.equal(got["t"], t)


def test_tensors_the_snapshot_would_change_still_pickle_as_torch_pickles_them() -> None:
    torch = pytest.importorskip("torch")
    param = torch.nn.Parameter(torch.ones(2))
    sparse = torch.eye(3).to_sparse()
    base = torch.arange(12, dtype=torch.int64)
    row = base[4:8]  # a view: it keeps sharing its base's storage
    wide = torch.ones(4).expand(1000, 4)  # 16 bytes of storage, not 16 KB
    tagged = torch.zeros(2)
    tagged.note = "mine"  # type: ignore[attr-defined]
    data, buffers = dumps([param, sparse, base, row, wide, tagged])
    got = codec.loads(data, buffers)
    assert type(got[0]) is torch.nn.Parameter and torch.equal(got[0].detach(), torch.ones(2))
    assert got[1].is_sparse and torch.equal(got[1].to_dense(), torch.eye(3))
    # the view went as torch sends it: its whole base's storage, and its offset in it
    assert torch.equal(got[3], torch.arange(4, 8)) and got[3].storage_offset() == 4
    assert got[4].shape == (1000, 4) and got[4].untyped_storage().nbytes() == 16
    assert got[5].note == "mine"


def test_a_big_bytes_value_goes_out_of_band_as_it_is_and_arrives_as_bytes() -> None:
    big = bytes(range(256)) * 4096  # 1 MiB
    data, buffers = dumps(big)
    assert len(buffers) == 1 and len(data) < 256
    assert memoryview(buffers[0]).obj is big  # no copy: a bytes cannot change
    got = codec.loads(data, buffers)
    assert type(got) is bytes and got == big
    small = b"x" * 100
    data, buffers = dumps(small)
    assert buffers == [] and codec.loads(data) == small
