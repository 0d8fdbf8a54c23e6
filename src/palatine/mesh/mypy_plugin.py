"""A mypy plugin that checks endpoint calls against the endpoints' own signatures.

``mesh.incr.call(1)`` reaches ``incr`` through `ActorMesh.__getattr__`, which a type
checker cannot see through: to it, every ``mesh.<name>`` is an ``Endpoint[..., Any]``
that takes anything. With this plugin (``plugins = ["palatine.mesh.mypy_plugin"]``
under ``[tool.mypy]``), ``mesh.<name>`` on an ``ActorMesh[A]`` or ``ActorRef[A]`` (what
``procs.spawn(name, A)`` returns) is ``Endpoint[P, R]`` for A's endpoint ``name``
taking ``P`` and returning ``R`` (an ``async def``'s awaited result), so that

* ``mesh.incr.call("x")`` is an error when ``incr`` takes an int;
* ``mesh.icnr`` is an error when A has no endpoint of that name (or ``icnr`` is a plain
  method, not an endpoint);
* ``mesh.incr.call(1).get()`` is a ``ValueMesh[int]``, ``call_one`` a ``Future[int]``.

Only type checking uses this module; nothing at run time imports it.
"""

from __future__ import annotations

from collections.abc import Callable

from mypy import errorcodes
from mypy.nodes import ARG_POS, CallExpr, Decorator, Expression, MemberExpr, RefExpr
from mypy.plugin import AttributeContext, Plugin
from mypy.subtypes import find_member
from mypy.types import (
    AnyType,
    CallableType,
    Instance,
    Parameters,
    Type,
    TypeOfAny,
    get_proper_type,
)

__all__ = ["plugin", "EndpointPlugin"]

_MESHES = ("palatine.mesh.actor_mesh.ActorMesh", "palatine.mesh.actor_mesh.ActorRef")
_ENDPOINT = "palatine.mesh.actor_mesh.Endpoint"
_MARKS = ("palatine.core.actor.endpoint", "palatine.core.actor.concurrent_endpoint")
_COROUTINE = "typing.Coroutine"
_PORT = "palatine.core.ports.Port"


class EndpointPlugin(Plugin):
    """Types ``mesh.<name>`` as the actor class's endpoint ``name``."""

    def get_attribute_hook(self, fullname: str) -> Callable[[AttributeContext], Type] | None:
        owner, _, _name = fullname.rpartition(".")
        if owner in _MESHES:
            return _endpoint_type
        return None


def _endpoint_type(ctx: AttributeContext) -> Type:
    mesh = get_proper_type(ctx.type)
    if not isinstance(mesh, Instance) or not isinstance(ctx.context, MemberExpr):
        return ctx.default_attr_type
    name = ctx.context.name
    if mesh.type.get(name) is not None or name.startswith("_"):
        return ctx.default_attr_type  # the mesh's own attribute (``gang``, ``sizes``)
    actor = get_proper_type(mesh.args[0]) if mesh.args else None
    if not isinstance(actor, Instance) or actor.type.fullname == "palatine.core.actor.Actor":
        return ctx.default_attr_type  # any actor: any endpoint
    member = find_member(name, actor, actor)
    explicit = _endpoint_mark(actor, name) if member is not None else None
    if member is None or explicit is None:
        what = "is not an endpoint" if member is not None else "has no endpoint"
        where = f'"{actor.type.name}.{name}"' if member is not None else f'"{actor.type.name}"'
        tail = "" if member is not None else f' "{name}"'
        ctx.api.fail(f"{where} {what}{tail}", ctx.context, code=errorcodes.ATTR_DEFINED)
        return AnyType(TypeOfAny.from_error)
    method = get_proper_type(member)
    if not isinstance(method, CallableType):
        return ctx.default_attr_type
    result = get_proper_type(method.ret_type)
    if (
        isinstance(result, Instance)
        and result.type.fullname == _COROUTINE
        and len(result.args) == 3
    ):
        result = get_proper_type(result.args[2])  # an ``async def``: what it returns
    if explicit and method.arg_types and method.arg_kinds[0] == ARG_POS:
        # The reply port is the runtime's, not the caller's; what is sent to it, the reply.
        port = get_proper_type(method.arg_types[0])
        result = (
            get_proper_type(port.args[0])
            if isinstance(port, Instance) and port.type.fullname == _PORT and port.args
            else AnyType(TypeOfAny.unannotated)
        )
        method = method.copy_modified(
            arg_types=method.arg_types[1:],
            arg_kinds=method.arg_kinds[1:],
            arg_names=method.arg_names[1:],
        )
    default = get_proper_type(ctx.default_attr_type)  # what ``__getattr__`` gives
    if not isinstance(default, Instance) or default.type.fullname != _ENDPOINT:
        return ctx.default_attr_type
    params = Parameters(method.arg_types, method.arg_kinds, method.arg_names)
    return Instance(default.type, [params, result])


def _endpoint_mark(actor: Instance, name: str) -> bool | None:
    """How ``name`` is marked in ``actor``'s class or its bases: None when it is not an
    endpoint, else whether it takes an explicit response port."""
    for info in actor.type.mro:
        node = info.names.get(name)
        if node is None:
            continue
        if not isinstance(node.node, Decorator):
            return None
        for mark in node.node.decorators:
            explicit = _mark_kind(mark)
            if explicit is not None:
                return explicit
        return None
    return None


def _mark_kind(mark: Expression) -> bool | None:
    """None when ``mark`` is not ``@endpoint`` / ``@concurrent_endpoint`` (or one called
    with options), else whether it sets ``explicit_response_port=True``."""
    if isinstance(mark, RefExpr) and mark.fullname in _MARKS:
        return False
    if isinstance(mark, CallExpr) and isinstance(mark.callee, RefExpr):
        if mark.callee.fullname not in _MARKS:
            return None
        for arg_name, arg in zip(mark.arg_names, mark.args, strict=True):
            if arg_name == "explicit_response_port":
                return isinstance(arg, RefExpr) and arg.fullname == "builtins.True"
        return False
    return None


def plugin(version: str) -> type[Plugin]:
    """mypy's entry point."""
    return EndpointPlugin
