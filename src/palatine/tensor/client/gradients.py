"""Gradients one at a time, in the order the backward makes them: `grad_generator`.

``for g in grad_generator(loss, params): g.reduce_("dp", "avg")`` runs the backward of
``loss`` in stages and yields the gradient of each of ``params`` in turn (Monarch's
``monarch.grad_generator``). Stage ``i`` runs only the autograd nodes that the gradient of
``with_respect_to[i]`` needs and that no earlier stage ran, and the gradient is yielded
before any node of a later stage runs. On mesh tensors every node's ops are issued to the
workers when the node runs, so whatever the loop does with a gradient (its all-reduce) is
issued before the rest of the backward, and the workers overlap the two. The order of
issue is fixed by the graph alone: a stage's nodes run highest ``sequence_nr`` first (the
reverse of the order the forward made them, as torch's engine does), ties in the order
the graph was walked. `gradient_execution_order` says in which order to ask for the
gradients so that each comes as early as possible (for a stack of layers, the reversed
parameter list).

How it runs (the design): the generator walks the autograd graph itself and calls each
node in the current thread (a C++ node as ``node(*grads)``; a custom ``Function``'s node
through its ``apply``, with the engine's rules for it), summing the gradients that reach a
node's input and fitting each to its input's metadata (``sum_to_size`` of a broadcast,
the dtype) as the engine does. Running torch's own engine in a helper thread, paused by
a hook on each input, was the other way; it was not taken because (1) the engine runs
every node the whole backward needs in its own order, so it cannot hold back the nodes
of later stages, which is what makes each reduce overlap the rest; (2) the helper thread
would not see the caller's thread-local torch state (the factory mode of an active mesh,
dispatch modes) and would need hand-offs, timeouts and an owner for every pause, while
here closing the generator early simply stops; (3) the caller's thread issues every op,
so the "Issued at" line of a failed op is the line of the loop. Each node runs with the
stream (and, for a custom ``Function``, the mesh) of its gradients active, so a backward
runs on the stream its forward ran on, whatever stream is active at ``next()``.

Differences from ``loss.backward()`` (and Monarch's C++ generator), all from what Python
can reach of a node: hooks registered on tensors or nodes do not run; a node computes
all of its outputs, even those that no requested gradient needs; the forward's saved
tensors are not freed node by node but with the graph (when the roots are dropped), as
with ``retain_graph=True``; a custom ``Function``'s missing gradients are always
materialized as zeros.

A yielded gradient may be written in place (``reduce_``): when it shares storage with a
gradient the rest of the backward still uses (the two outputs of ``x + b`` are one
tensor) or with another gradient still to be yielded, the generator yields a copy.

`grad_function` (Monarch's too) writes a backward as a closure: the function returns its
result and the function that maps the result's gradient to its arguments' gradients.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_unflatten

from palatine.tensor.client.activation import activate
from palatine.tensor.client.tensor import Tensor

__all__ = ["GradientGenerator", "grad_function", "grad_generator", "gradient_execution_order"]

TensorOrEdge = torch.Tensor | GradientEdge
"""A tensor, or the edge into the autograd graph it names (``get_gradient_edge(t)``)."""

#: The type of a leaf's node (untyped in torch's stubs).
_ACCUMULATE_GRAD: Any = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]

Node = Any  # a torch.autograd.graph.Node (C++ nodes and custom Function nodes alike)
Slot = tuple[Node, int]  # one input of a node: where the gradient of one tensor arrives


def grad_generator(
    roots: TensorOrEdge | Sequence[TensorOrEdge],
    with_respect_to: TensorOrEdge | Sequence[TensorOrEdge],
    grad_roots: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
) -> GradientGenerator:
    """An iterator over the gradients of ``roots`` with respect to each of
    ``with_respect_to``, in that order, each yielded as soon as the backward has made it
    and before it runs anything that only later ones need (see the module).

    ``roots``: a tensor (the loss) or several; ``grad_roots``: the gradient of each root
    (as ``torch.autograd.grad``'s ``grad_outputs``; shorter lists and ``None`` mean ones of
    the root's shape). ``with_respect_to``: tensors (parameters, or intermediate values)
    or gradient edges. A ``None`` is yielded for one the roots do not depend on (or that
    does not require grad). Pass them in `gradient_execution_order` (for a stack of layers,
    reversed parameters) so each comes as early as possible; any order gives the same
    values."""
    return GradientGenerator(roots, with_respect_to, grad_roots)


def gradient_execution_order(
    roots: TensorOrEdge | Sequence[TensorOrEdge],
    with_respect_to: TensorOrEdge | Sequence[TensorOrEdge],
) -> list[int]:
    """The indices of ``with_respect_to`` in the order their gradients are completed by a
    backward of ``roots``: by the last node that contributes to each, latest-made first
    (the node with the highest ``sequence_nr`` runs first). The roots do not depend on
    one that comes first (its gradient is ``None`` at once); ties (two inputs of one node)
    keep their given order. ``grad_generator(roots, [w[i] for i in order])`` then yields
    each gradient with no wait on later ones."""
    graph = _Graph([_root_edge(r, i) for i, r in enumerate(_as_list(roots))])
    wrt = [_slot(x, graph) for x in _as_list(with_respect_to)]
    inf = float("inf")

    def completed_at(i: int) -> float:
        edge = wrt[i]
        feeders = graph.feeders.get(edge) if edge is not None else None
        if not feeders:
            return inf
        return float(min(_sequence_nr(n) for n in feeders))

    keys = [completed_at(i) for i in range(len(wrt))]
    return sorted(range(len(wrt)), key=lambda i: -keys[i])


class GradientGenerator(Iterator[torch.Tensor | None]):
    """The iterator `grad_generator` returns: one gradient (or ``None``) per
    ``with_respect_to`` entry, in order. ``close()`` (or leaving a ``with`` block) stops
    it early: nothing more is run, and what it held is let go. An error of a node is
    raised from ``next()`` and ends the iteration."""

    def __init__(
        self,
        roots: TensorOrEdge | Sequence[TensorOrEdge],
        with_respect_to: TensorOrEdge | Sequence[TensorOrEdge],
        grad_roots: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        root_list = _as_list(roots)
        given = [] if grad_roots is None else _as_list(grad_roots)
        if len(given) > len(root_list):
            raise ValueError(
                f"grad_generator: {len(given)} grad_roots for {len(root_list)} roots "
                "(at most one per root)"
            )
        edges = [_root_edge(r, i) for i, r in enumerate(root_list)]
        self._graph = _Graph(edges)
        self._wanted = [_slot(x, self._graph) for x in _as_list(with_respect_to)]
        self._buffers: dict[Slot, torch.Tensor] = {}
        self._results: dict[int, torch.Tensor | None] = {}
        #: The indices of ``with_respect_to`` each slot answers (a tensor named twice: two).
        self._answers: dict[Slot, list[int]] = {}
        for i, slot in enumerate(self._wanted):
            if slot is not None and slot[0] in self._graph.index:
                self._answers.setdefault(slot, []).append(i)
        self._stage = self._stages()
        self._waiting = {n: len(self._graph.producers[n]) for n in self._stage}
        self._ready: list[tuple[int, int, int, Node]] = []
        self._next = 0
        self._closed = False
        with torch.no_grad():
            for i, edge in enumerate(edges):
                grad = given[i] if i < len(given) else None
                self._accumulate(edge, _root_grad(root_list[i], edge, grad, i))
        for n in self._stage:
            if not self._waiting[n]:
                self._push(n)

    def _stages(self) -> dict[Node, int]:
        """Each node some requested gradient needs, with the first index that needs it:
        the producers of that gradient's slot and everything upstream of them."""
        graph = self._graph
        stage: dict[Node, int] = {}
        for i, slot in enumerate(self._wanted):
            if slot is None:
                continue
            todo = list(graph.feeders.get(slot, ()))
            while todo:
                node = todo.pop()
                if node in stage:
                    continue
                stage[node] = i
                todo.extend(graph.producers[node])
        return stage

    def _push(self, node: Node) -> None:
        key = (self._stage[node], -_sequence_nr(node), self._graph.index[node], node)
        heapq.heappush(self._ready, key)

    # ------------------------------------------------------------ iteration
    def __iter__(self) -> GradientGenerator:
        return self

    def __next__(self) -> torch.Tensor | None:
        if self._closed:
            raise StopIteration
        try:
            while self._ready and self._ready[0][0] <= self._next:
                _, _, _, node = heapq.heappop(self._ready)
                self._run(node)
            if self._next >= len(self._wanted):
                self.close()
                raise StopIteration
            return self._yield(self._next)
        except BaseException:
            self.close()
            raise

    def _yield(self, i: int) -> torch.Tensor | None:
        """The gradient of ``with_respect_to[i]``, now complete (every node of stages up to
        ``i`` has run); a copy when something still to run or to yield shares it."""
        self._next = i + 1
        slot = self._wanted[i]
        if i in self._results:
            grad = self._results.pop(i)
        elif slot is not None:
            grad = self._buffers.get(slot)
            if self._answers.get(slot, [None])[-1] == i and slot[0] not in self._stage:
                self._buffers.pop(slot, None)  # no node will read it: let it go
        else:
            grad = None
        if grad is None:
            return None
        key = _storage_key(grad)
        held = [*self._buffers.values(), *(g for g in self._results.values() if g is not None)]
        if any(_storage_key(h) == key for h in held):
            with torch.no_grad(), _context_of([grad], False):
                grad = grad.clone()
        return grad

    def close(self) -> None:
        """Stop: run nothing more, and let go of every gradient and node held."""
        self._closed = True
        self._ready.clear()
        self._buffers.clear()
        self._results.clear()
        self._stage.clear()
        self._waiting.clear()
        self._answers.clear()
        self._graph = _Graph([])

    def __enter__(self) -> GradientGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ running nodes
    def _run(self, node: Node) -> None:
        """Call ``node`` on the gradients gathered at its inputs and pass each output on."""
        count = len(self._graph.metadata(node))
        inputs: list[torch.Tensor | None] = []
        for s in range(count):
            grad = self._buffers.pop((node, s), None)
            for i in self._answers.get((node, s), ()):
                self._results[i] = grad  # taken before the node consumes it
            inputs.append(grad)
        edges = self._graph.edges[node]
        if all(g is None for g in inputs):
            outputs: list[torch.Tensor | None] = [None] * len(edges)
        else:
            python = isinstance(node, BackwardCFunction)
            with torch.no_grad(), _context_of(inputs, python):
                outputs = (
                    _call_python(node, inputs, len(edges)) if python else _call_cpp(node, inputs)
                )
        for j, (edge, grad) in enumerate(zip(edges, outputs, strict=True)):
            if grad is not None and self._keeps(edge):
                with torch.no_grad(), _context_of([grad], False):
                    self._accumulate(edge, _fit(node, j, edge, grad, self._graph))
        for consumer in self._graph.consumers[node]:
            if consumer in self._waiting:
                self._waiting[consumer] -= 1
                if not self._waiting[consumer]:
                    self._push(consumer)

    def _keeps(self, slot: Slot) -> bool:
        """Whether a gradient reaching ``slot`` is ever read (by a node that will run, or
        as a requested gradient); others are not even summed."""
        return slot[0] in self._stage or slot in self._answers

    def _accumulate(self, slot: Slot, grad: torch.Tensor | None) -> None:
        if grad is None or not self._keeps(slot):
            return
        have = self._buffers.get(slot)
        self._buffers[slot] = grad if have is None else have + grad


class _Graph:
    """The autograd graph upstream of some root edges, walked once in a fixed order:
    each node's edges, the producers that feed each slot, and each node's consumers."""

    def __init__(self, roots: Sequence[Slot]) -> None:
        #: Discovery order: the last tie-break of the run order.
        self.index: dict[Node, int] = {}
        self.edges: dict[Node, list[Slot]] = {}
        self.feeders: dict[Slot, dict[Node, None]] = {}  # (ordered sets)
        self.producers: dict[Node, dict[Node, None]] = {}
        self.consumers: dict[Node, dict[Node, None]] = {}
        #: Each leaf tensor's slot (its ``AccumulateGrad``), by the tensor's id.
        self.leaves: dict[int, Slot] = {}
        self._metadata: dict[Node, Sequence[Any]] = {}
        for node, _ in roots:
            self._add(node)
        todo = [node for node, _ in reversed(roots)]
        walked: set[Node] = set()
        while todo:
            node = todo.pop()
            if node in walked:
                continue
            walked.add(node)
            edges = [(n, nr) for n, nr in node.next_functions if n is not None]
            self.edges[node] = edges
            for n, nr in edges:
                self._add(n)
                self.feeders.setdefault((n, nr), {})[node] = None
                self.producers[n][node] = None
                self.consumers[node][n] = None
            todo.extend(n for n, _ in reversed(edges))

    def _add(self, node: Node) -> None:
        if node not in self.index:
            if isinstance(node, _ACCUMULATE_GRAD):
                self.leaves[id(node.variable)] = (node, 0)
            self.index[node] = len(self.index)
            self.edges[node] = []
            self.producers[node] = {}
            self.consumers[node] = {}

    def metadata(self, node: Node) -> Sequence[Any]:
        """The node's input metadata (shape, dtype, device of each input), read once."""
        md = self._metadata.get(node)
        if md is None:
            md = self._metadata[node] = node._input_metadata
        return md


def _call_cpp(node: Node, inputs: list[torch.Tensor | None]) -> list[Any]:
    """A C++ node: one output per entry of ``next_functions``, kept for valid edges."""
    out = node(*inputs)
    outs = list(out) if isinstance(out, tuple) else [out]
    return [g for g, (n, _) in zip(outs, node.next_functions, strict=True) if n is not None]


def _call_python(node: Node, inputs: list[torch.Tensor | None], n_edges: int) -> list[Any]:
    """A custom ``Function``'s node, by the engine's rules for one: a missing gradient is
    zeros; ``backward`` returns one value per argument of ``forward``, those of arguments
    that need no gradient (not tensors, or not requiring grad) being dropped, and extra
    trailing values must be ``None``."""
    md = node._input_metadata
    example = next(g for g in inputs if g is not None)
    full = [
        g if g is not None else example.new_zeros(m.shape, dtype=m.dtype, device=m.device)
        for g, m in zip(inputs, md, strict=True)
    ]
    out = node.apply(*full)
    outs = list(out) if isinstance(out, tuple) else [out]
    needs = node.needs_input_grad
    name = type(node).__name__
    if len(outs) < len(needs) or any(x is not None for x in outs[len(needs) :]):
        raise RuntimeError(
            f"function {name} returned an incorrect number of gradients "
            f"(expected {len(needs)}, got {len(outs)})"
        )
    kept = [g for g, need in zip(outs, needs, strict=False) if need]
    if len(kept) != n_edges:
        raise RuntimeError(
            f"function {name}: {len(kept)} arguments need a gradient but the node has "
            f"{n_edges} edges"
        )
    for g in kept:
        if g is not None and not isinstance(g, torch.Tensor):
            raise TypeError(f"function {name} returned a gradient that is a {type(g).__name__}")
    return kept


def _fit(node: Node, j: int, slot: Slot, grad: torch.Tensor, graph: _Graph) -> torch.Tensor:
    """``grad`` as the receiving input wants it (the engine's output validation): summed
    down to its shape when it was broadcast, cast to its dtype."""
    target, nr = slot
    md = graph.metadata(target)[nr]
    shape = tuple(md.shape)
    if tuple(grad.shape) != shape:
        if not _expandable(shape, tuple(grad.shape)):
            raise RuntimeError(
                f"function {type(node).__name__} returned an invalid gradient at index {j} - got "
                f"{list(grad.shape)} but expected shape compatible with {list(shape)}"
            )
        grad = grad.sum_to_size(shape)
    if grad.dtype != md.dtype:
        grad = grad.to(md.dtype)
    return grad


def _expandable(shape: tuple[int, ...], to: tuple[int, ...]) -> bool:
    if len(shape) > len(to):
        return False
    return all(a == b or a == 1 for a, b in zip(reversed(shape), reversed(to), strict=False))


def _context_of(grads: Sequence[Any], with_mesh: bool) -> contextlib.AbstractContextManager[Any]:
    """The stream (and mesh, when ``with_mesh``) of the first mesh tensor in ``grads``,
    active for a block: where the ops made from these gradients belong."""
    for g in grads:
        if isinstance(g, Tensor):
            if not with_mesh:
                return g.stream.activate()
            stack = contextlib.ExitStack()
            stack.enter_context(activate(g.mesh))
            stack.enter_context(g.stream.activate())
            return stack
    return contextlib.nullcontext()


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    """What two tensors that share memory share: a mesh tensor's alias group, a local
    tensor's storage (another kind of tensor: only itself)."""
    if isinstance(t, Tensor):
        return ("mesh", id(t._storage))
    try:
        return ("local", t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return ("object", id(t))


def _sequence_nr(node: Node) -> int:
    return cast(int, node._sequence_nr())


def _as_list(x: Any) -> list[Any]:
    if isinstance(x, torch.Tensor | GradientEdge):
        return [x]
    return list(x)


def _slot(x: TensorOrEdge, graph: _Graph) -> Slot | None:
    """Where the gradient of ``x`` arrives: its edge; ``None`` for a tensor that requires no
    grad, or a leaf the graph never reaches. A leaf's slot is found in the graph (its
    ``AccumulateGrad`` node) rather than with ``get_gradient_edge``, which runs an op."""
    if isinstance(x, torch.Tensor):
        if not x.requires_grad:
            return None
        if x.grad_fn is not None:
            return (x.grad_fn, x.output_nr)
        return graph.leaves.get(id(x))
    if isinstance(x, tuple) and len(x) >= 2:
        return (x[0], int(x[1]))
    raise TypeError(f"expected a tensor or a GradientEdge, not {type(x).__name__}")


def _root_edge(root: TensorOrEdge, i: int) -> Slot:
    if isinstance(root, torch.Tensor):
        if not root.requires_grad:
            raise RuntimeError(
                f"element {i} of roots does not require grad and does not have a grad_fn"
            )
        if root.grad_fn is not None:
            return (root.grad_fn, root.output_nr)
        with _context_of([root], False):  # (a leaf: its accumulator is found by a view op)
            edge = get_gradient_edge(root)
        return (edge.node, edge.output_nr)
    if isinstance(root, tuple) and len(root) >= 2:
        return (root[0], int(root[1]))
    raise TypeError(f"expected a tensor or a GradientEdge, not {type(root).__name__}")


def _root_grad(root: TensorOrEdge, slot: Slot, grad: torch.Tensor | None, i: int) -> torch.Tensor:
    """The gradient a root starts with: the one given, else ones of the root's shape."""
    if not isinstance(root, torch.Tensor):
        if grad is None:
            raise ValueError(
                f"grad_generator: root {i} is a GradientEdge: give its grad_roots entry"
            )
        return grad
    if grad is None:
        with _context_of([root], False):
            return torch.ones_like(root, memory_format=torch.preserve_format)
    if grad.shape != root.shape:
        raise RuntimeError(
            f"grad_generator: grad_roots[{i}] has shape {list(grad.shape)} but root {i} "
            f"has shape {list(root.shape)}"
        )
    return grad


# --------------------------------------------------------------------------- grad_function


def grad_function(fn: Callable[..., tuple[Any, Callable[..., Any]]]) -> Callable[..., Any]:
    """``fn`` as an autograd function whose backward is a closure: ``fn(*args)`` returns
    ``(result, backward)``, and ``backward(*grads_of_result)`` returns the gradient of each
    argument (a tuple, or one value for one argument; ``None`` where there is none).

    The tensors the closure captures are saved with ``save_for_backward`` rather than kept
    by the closure: no reference cycle through the result keeps them (and, for mesh
    tensors, their worker-side values) alive, and an in-place change to one before the
    backward is the error torch raises for any saved tensor. Keyword arguments are
    constants of the call (gradients flow to positional arguments)::

        @grad_function
        def to_mesh(x, mesh):
            source = x.mesh
            return x.to_mesh(mesh), lambda g: (g.to_mesh(source), None)
    """

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        f = functools.partial(fn, **kwargs) if kwargs else fn
        return _GradFunction.apply(f, *args)  # type: ignore[no-untyped-call]

    return call


_EMPTY = object()  # a closure cell with no value yet


class _GradFunction(torch.autograd.Function):
    """`grad_function`'s node: runs ``fn`` forward and its closure backward."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Any], *args: Any) -> Any:
        result, backward = fn(*args)
        if not isinstance(backward, types.FunctionType):
            raise TypeError(
                f"grad_function {getattr(fn, '__name__', fn)!r} must return (result, backward) "
                f"with backward a function, not {type(backward).__name__}"
            )
        contents = [_cell_value(c) for c in backward.__closure__ or ()]
        leaves, spec = tree_flatten(contents)
        at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        ctx.save_for_backward(*(leaves[i] for i in at))
        for i in at:
            leaves[i] = None
        ctx.rebuild = (backward.__code__, backward.__globals__, backward.__name__,
                       backward.__defaults__, backward.__kwdefaults__, leaves, spec, at)  # fmt: skip
        return result

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        code, globals_, name, defaults, kwdefaults, leaves, spec, at = ctx.rebuild
        leaves = list(leaves)
        for i, t in zip(at, ctx.saved_tensors, strict=True):
            leaves[i] = t
        cells = tuple(
            types.CellType() if v is _EMPTY else types.CellType(v)
            for v in tree_unflatten(leaves, spec)
        )
        backward = types.FunctionType(code, globals_, name, defaults, cells)
        backward.__kwdefaults__ = kwdefaults
        out = backward(*grads)
        return (None, *out) if isinstance(out, tuple) else (None, out)


def _cell_value(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return _EMPTY
