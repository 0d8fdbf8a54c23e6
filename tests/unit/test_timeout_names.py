"""Seconds end in ``_s`` in the Python API: ``connect``, ``DeviceMesh.recover`` and
``DeviceMesh.shutdown`` take ``timeout_s``, and ``timeout``, their older name, still."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from palatine.tensor.client import local
from palatine.tensor.client import mesh as mesh_mod
from palatine.tensor.client.mesh import DeviceMesh


def fake_mesh(seen: list[Any]) -> DeviceMesh:
    mesh = DeviceMesh.__new__(DeviceMesh)
    mesh.session = SimpleNamespace(recover=lambda ranks, t: seen.append(t) or [1])  # type: ignore[assignment]
    mesh._local = None
    return mesh


@pytest.mark.parametrize(("method", "default"), [("recover", 120.0), ("shutdown", 30.0)])
def test_a_mesh_method_takes_timeout_s_and_its_older_name(
    method: str, default: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(mesh_mod, "shutdown_session", lambda s, loc, t, e=None: seen.append(t))
    call = getattr(fake_mesh(seen), method)
    call()
    call(timeout_s=5)
    call(*([[1], 6] if method == "recover" else [6]))  # (positional)
    call(timeout=7)  # the older name
    assert seen == [default, 5, 6, 7]
    with pytest.raises(TypeError, match="'timeout_s' and 'timeout'"):
        call(timeout_s=1, timeout=2)


def test_connect_takes_timeout_s_and_its_older_name(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []

    class Attached(Exception):
        pass

    def attach(addr: object, world: object, t: float) -> None:
        seen.append(t)
        raise Attached

    monkeypatch.setattr(local, "_connect", attach)
    monkeypatch.setattr(local, "runtime", SimpleNamespace(submit=lambda fn: fn()))
    for kwargs in ({}, {"timeout_s": 5}, {"timeout": 7}):  # (timeout: the older name)
        with pytest.raises(Attached):
            local.connect("tcp:127.0.0.1:1", "worker", **kwargs)  # type: ignore[arg-type]
    assert seen == [60.0, 5, 7]
    with pytest.raises(TypeError, match="'timeout_s' and 'timeout'"):
        local.connect("tcp:127.0.0.1:1", "worker", timeout_s=1, timeout=2)
