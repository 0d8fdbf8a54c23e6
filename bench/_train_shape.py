"""The training-step benchmarks' one program shape, shared by palatine, torchmonarch and torchrun.

The job, the same on every side: the demo's model (``palatine.cli.demo_common.mlp(128)``,
``IN_FEATURES`` inputs, a fixed teacher ``mlp(32)``), MSE loss, SGD (lr 0.05, momentum 0.9),
a batch of 64 per rank, data parallel on 2 CPU ranks of this host: every step the
gradients are averaged over the ranks before the optimizer's step. Each rank runs torch's
intra-op pool with ``threads_per_rank()`` threads (this machine's cores shared by the
ranks, palatine's own rule for a local mesh), so the sides compute alike.

Used by bench/train_bench.py (palatine's two styles, and torchrun beside them),
bench/peers/monarch_train.py (torchmonarch's tensor engine) and
bench/peers/torchrun_train.py (the script torchrun starts). Needs torch, the model's
module (``palatine.cli.demo_common``: it imports nothing of palatine's runtime, so the
peers' interpreter takes it from the source tree) and ``bench/_common.py``.

What is timed (`measure`): a *round* is N steps issued one after another, ended by one
fetch of the last step's loss (checked finite); its value is N / seconds (steps/s). Every
side first runs a warm-up round and timed calibration rounds that size its N so a
repetition takes about max(1 s, 2 x ``--rep-seconds``); then the sides' repetitions are
interleaved (side A, side B, ..., again), so a machine that slows down mid-run weighs on
every side alike. The median of ``--reps`` repetitions is reported. Metrics:

* ``torch_style_step_per_s``: the plain torch step on mesh tensors (`MeshTorch`): model,
  teacher and optimizer built under ``mesh.activate()``; each step a batch from a remote
  function, forward, backward, the gradients averaged over the mesh (with the
  framework's ``grad_generator`` when it has one, each gradient reduced as the backward
  yields it; else ``loss.backward()`` then one ``reduce_`` of every gradient), then
  ``optimizer.step()``. Where the framework has a recording ``compile`` (palatine's
  recorded and replayed step), this is the compiled step's figure (``variant:
  compiled``); else, where it has ``coalescing``, each step inside ``with
  coalescing():`` (``variant: coalesced``); else the plain step's (``variant: plain``). torchrun's side: the same model and step as a plain
  script (gloo, one all-reduce of the flattened gradients), timed inside rank 0.
* ``torch_style_plain_step_per_s``: the plain step, printed only where a coalesced one
  is the headline above.
* ``function_style_step_per_s`` (palatine only): the demo's function-style step
  (``remote(train_step, mutates=("state",))(state)``), the reference of the goal
  "torch-style >= 0.9 x function-style": the torch-style line carries that bound as its
  ``target_value``.

Every wait is bounded: each fetch (``FETCH_TIMEOUT_S``), and the whole measurement
(`Watchdog`: the metrics not printed by then are printed as errors and the program exits).
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _common import emit, emit_error, median, parse_args, wanted

try:
    from palatine.cli.demo_common import IN_FEATURES, mlp
except ImportError:  # the peers' interpreter: the same module, from the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    from palatine.cli.demo_common import IN_FEATURES, mlp

PROCS = 2
SEED = 0
HIDDEN = 128
TEACHER_HIDDEN = 32
LR = 0.05
MOMENTUM = 0.9
BATCH = 64
WARMUP_STEPS = 5
CALIBRATE_STEPS = 20  # the first calibration round
CALIBRATE_S = 0.5  # the calibration round that sizes N takes at least this long
MIN_REP_S = 1.0
MAX_STEPS = 1_000_000
FETCH_TIMEOUT_S = 60.0
MESH_BUDGET_S = 240.0  # the whole measurement on one mesh, start-up included

TORCH_STYLE = "torch_style_step_per_s"
TORCH_PLAIN = "torch_style_plain_step_per_s"
FUNCTION_STYLE = "function_style_step_per_s"
METRICS = (TORCH_STYLE, TORCH_PLAIN, FUNCTION_STYLE)
UNIT = "steps/s"
FUNCTION_STYLE_FACTOR = 0.9  # the goal: torch-style >= 0.9 x function-style

JOB = {
    "procs": PROCS,
    "in_features": IN_FEATURES,
    "hidden": HIDDEN,
    "teacher_hidden": TEACHER_HIDDEN,
    "batch_per_rank": BATCH,
    "optimizer": f"SGD(lr={LR}, momentum={MOMENTUM})",
}


def log(msg: str) -> None:
    print(f"[train_shape] {msg}", file=sys.stderr, flush=True)


def threads_per_rank() -> int:
    """torch's intra-op threads on each rank: this machine's cores shared by the ranks."""
    return max(1, (os.cpu_count() or 1) // PROCS)


# --------------------------------------------------------------------------- measuring


@dataclass
class Side:
    """One way of taking a training step, measured in rounds."""

    name: str  # for the log
    step: Callable[[], Any]  # one step, issued; its loss (a mesh value, or a local number)
    end: Callable[[Any], float]  # the last step's loss, here: what ends a round
    n: int = 0  # steps per repetition, from the calibration
    values: list[float] = field(default_factory=list)  # steps/s, one per repetition
    rep_s: list[float] = field(default_factory=list)
    error: BaseException | None = None

    def round(self, n: int) -> float:
        """``n`` steps, then the last loss fetched and checked; seconds from the first."""
        t0 = time.perf_counter()
        loss: Any = None
        for _ in range(n):
            loss = self.step()
        got = self.end(loss)
        seconds = time.perf_counter() - t0
        if not math.isfinite(got):
            raise AssertionError(f"{self.name}: the loss after {n} steps is {got}")
        return seconds

    def result(self) -> tuple[float, dict[str, Any]]:
        """The median steps/s and the repetitions' extras."""
        return median(self.values), {
            "steps_per_rep": self.n,
            "rep_s": self.rep_s,
            "reps": [round(v, 3) for v in self.values],
        }


def _attempt(side: Side, what: Callable[[Side], None]) -> None:
    """Run one part of a side's measurement; a failure ends that side only."""
    if side.error is not None:
        return
    try:
        what(side)
    except Exception as exc:  # noqa: BLE001 - reported as the side's error
        side.error = exc
        log(f"{side.name}: {type(exc).__name__}: {exc}")


def measure(
    sides: list[Side], reps: int, target_s: float, agree: Callable[[int], int] = lambda n: n
) -> None:
    """Warm up and calibrate each side, then ``reps`` repetitions of every side in turn.

    The calibration runs rounds of twice the steps until one takes ``CALIBRATE_S``, and
    sizes N from its rate. ``agree`` turns each of its decisions (the next round's steps,
    or -N) into the one every process follows (torchrun's ranks take rank 0's: the same
    number of collectives everywhere)."""

    def calibrate(side: Side) -> None:
        side.round(WARMUP_STEPS)
        n = CALIBRATE_STEPS
        while True:  # rounds of twice the steps until one takes CALIBRATE_S
            seconds = side.round(n)
            rate = n / seconds
            if seconds >= CALIBRATE_S or n >= MAX_STEPS:  # the plan: -N, the final count
                plan = -min(MAX_STEPS, max(CALIBRATE_STEPS, math.ceil(rate * target_s * 1.25)))
            else:
                plan = 2 * n
            plan = agree(plan)  # every process follows the same plan
            if plan < 0:
                side.n = -plan
                break
            n = plan
        log(f"{side.name}: calibrated {rate:.1f} steps/s; {side.n} steps per repetition")

    def repetition(side: Side) -> None:
        seconds = side.round(side.n)
        side.values.append(side.n / seconds)
        side.rep_s.append(round(seconds, 3))

    for side in sides:
        _attempt(side, calibrate)
    for _ in range(reps):
        for side in sides:
            _attempt(side, repetition)


class Printer:
    """Prints each metric's line once, from whichever thread gets there first."""

    def __init__(self, args: Any, impl: str, version: str) -> None:
        self.args, self.impl, self.version = args, impl, version
        self.printed: set[str] = set()
        self.lock = threading.Lock()

    def emit(self, metric: str, fn: Callable[[], None]) -> None:
        """Print ``metric`` (through ``fn``) unless it was printed already."""
        with self.lock:
            if metric not in self.printed:
                self.printed.add(metric)
                fn()

    def error(self, metric: str, exc: BaseException) -> None:
        if wanted(self.args, metric):
            self.emit(metric, lambda: emit_error(metric, self.impl, UNIT, True, self.version, exc))

    def side(
        self, metric: str, side: Side | None, extra: dict[str, Any], error: Any = None
    ) -> None:
        """``metric``'s line: the side's median and extras, or its (or ``error``'s) error."""
        if not wanted(self.args, metric):
            return
        if side is None or side.error is not None or not side.values:
            fault = side.error if side is not None and side.error is not None else error
            self.error(metric, fault if isinstance(fault, BaseException) else RuntimeError(
                f"{self.impl}: {metric} not measured"))  # fmt: skip
            return
        value, own = side.result()
        reps = own.pop("reps")

        def line() -> None:
            emit(metric, self.impl, round(value, 3), UNIT, True, reps, self.version, **own, **extra)

        self.emit(metric, line)


class Watchdog:
    """The bound on a whole measurement: after ``seconds``, every wanted metric not yet
    printed is printed as an error naming the bound, and the process exits (status 3)."""

    def __init__(self, printer: Printer, seconds: float) -> None:
        self.printer, self.seconds = printer, seconds
        self.timer = threading.Timer(seconds, self._fire)
        self.timer.daemon = True

    def __enter__(self) -> Watchdog:
        self.timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.timer.cancel()

    def _fire(self) -> None:
        p = self.printer
        for metric in failed_lines(p.impl):
            p.error(metric, TimeoutError(f"{p.impl}: no result within {self.seconds:.0f} s"))
        os._exit(3)


def failed_lines(impl: str) -> tuple[str, ...]:
    """The metrics an implementation prints as errors when it measured nothing."""
    return (TORCH_STYLE, FUNCTION_STYLE) if impl == "palatine" else (TORCH_STYLE,)


# --------------------------------------------------------------------------- mesh tensors


@dataclass(frozen=True)
class MeshTorch:
    """One mesh-tensor framework's side of the torch-style step."""

    impl: str  # the results' name ("palatine", "torchmonarch")
    version: str
    open_mesh: Callable[[], Any]  # a 2-proc CPU mesh on this host, with .activate()
    close_mesh: Callable[[Any], None]
    tensor_type: type  # what torch factories (and so the model's parameters) are under it
    seed_ranks: Callable[[int], None]  # every rank's torch RNG seeded alike
    batches: Callable[[int, int], Callable[[], Any]]  # (seed, batch) -> each step's inputs
    reduce_avg: Callable[[Any], Any]  # a mesh tensor (or a list) averaged over every rank
    fetch: Callable[[Any, float], float]  # a scalar mesh tensor from rank 0, bounded wait
    grad_generator: Callable[..., Any] | None  # (loss, tensors) -> their grads, in order
    coalescing: Callable[[], AbstractContextManager[Any]] | None
    mesh_text: str
    notes: dict[str, Any] = field(default_factory=dict)
    # (step) -> the step recorded once and replayed (palatine.compile), if it has one
    compile: Callable[[Callable[[], Any]], Callable[[], Any]] | None = (
        None  # extras for every line it prints
    )


def _torch_step(fw: MeshTorch) -> Callable[[], Any]:
    """Build the model on the active mesh; the plain torch step, as a function."""
    fw.seed_ranks(SEED)  # identical replicas
    model, teacher = mlp(HIDDEN), mlp(TEACHER_HIDDEN)
    for p in teacher.parameters():
        p.requires_grad_(False)
    params = list(model.parameters())
    if not all(isinstance(p, fw.tensor_type) for p in params):
        got = {type(p).__qualname__ for p in params}
        raise TypeError(
            f"{fw.impl}: a model built under mesh.activate() has parameters of {got}, not "
            f"{fw.tensor_type.__qualname__}: no mesh tensors to train"
        )
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    backward_order = list(reversed(params))  # the order a backward produces them in
    next_batch = fw.batches(SEED, BATCH)
    generate = fw.grad_generator

    def step() -> Any:
        x = next_batch()
        loss = F.mse_loss(model(x), teacher(x))
        opt.zero_grad()
        if generate is not None:
            for p, g in zip(backward_order, generate(loss, backward_order), strict=True):
                fw.reduce_avg(g)  # issued before the rest of the backward
                p.grad = g
        else:
            loss.backward()  # type: ignore[no-untyped-call]
            fw.reduce_avg([p.grad for p in params])
        opt.step()
        return loss

    return step


def _coalesced(fw: MeshTorch, step: Callable[[], Any]) -> Callable[[], Any]:
    if fw.compile is not None:
        return fw.compile(step)
    coalescing = fw.coalescing
    assert coalescing is not None

    def coalesced_step() -> Any:
        with coalescing():
            return step()

    return coalesced_step


def unavailable(description: str, impl: str, version: str, exc: BaseException) -> int:
    """Print every wanted metric as an error naming ``exc``; the program's exit status."""
    out = Printer(parse_args(description), impl, version)
    for metric in failed_lines(impl):
        out.error(metric, exc)
    return 1


def run_mesh(
    description: str,
    fw: MeshTorch,
    function_style: Callable[[Any], Callable[[], Any]] | None = None,
) -> int:
    """Measure the torch-style step of ``fw`` (plain, and coalesced where it can) and, given
    ``function_style`` (mesh -> the function-style step, set up), that step beside it, on
    one mesh. The exit status."""
    args = parse_args(description)
    if not any(wanted(args, m) for m in METRICS):
        return 0
    target_s = max(MIN_REP_S, 2 * args.rep_seconds)
    os.environ["OMP_NUM_THREADS"] = str(threads_per_rank())  # for the ranks it starts
    out = Printer(args, fw.impl, fw.version)
    with Watchdog(out, MESH_BUDGET_S):
        try:
            mesh = fw.open_mesh()
        except Exception as exc:  # noqa: BLE001 - reported as each metric's error
            return unavailable(description, fw.impl, fw.version, exc)
        end = lambda loss: fw.fetch(loss, FETCH_TIMEOUT_S)  # noqa: E731
        sides: dict[str, Side] = {}
        setup_error: Exception | None = None
        try:
            with mesh.activate():
                try:
                    if function_style is not None:
                        sides[FUNCTION_STYLE] = Side("function-style", function_style(mesh), end)
                    plain = _torch_step(fw)
                    sides[TORCH_PLAIN] = Side("torch-style", plain, end)
                    if fw.coalescing is not None or fw.compile is not None:
                        coalesced = _coalesced(fw, plain)
                        what = "compiled" if fw.compile is not None else "coalesced"
                        sides[TORCH_STYLE] = Side(f"torch-style {what}", coalesced, end)
                    measure(list(sides.values()), args.reps, target_s)
                except Exception as exc:  # noqa: BLE001 - the set-up failed: every metric says so
                    log(f"{fw.impl}: set-up failed: {type(exc).__name__}: {exc}")
                    setup_error = exc
        finally:
            fw.close_mesh(mesh)
        _report(out, fw, sides, setup_error)
    return 0


def _report(out: Printer, fw: MeshTorch, sides: dict[str, Side], setup_error: Any) -> None:
    """Print the metrics: the headline (coalesced where there is one and it ran), the plain
    step where the headline is another, the function-style reference."""
    common = {**JOB, "threads_per_rank": threads_per_rank(), "mesh": fw.mesh_text}
    backward = "grad_generator" if fw.grad_generator is not None else "loss.backward() + reduce_"
    torch_style = {**common, "backward": backward, **fw.notes}
    plain, coalesced = sides.get(TORCH_PLAIN), sides.get(TORCH_STYLE)
    function = sides.get(FUNCTION_STYLE)
    head, variant = plain, "plain"
    extra: dict[str, Any] = {}
    if coalesced is not None:
        if coalesced.values and coalesced.error is None:
            head, variant = coalesced, "compiled" if fw.compile is not None else "coalesced"
        else:
            extra["coalesced_error"] = f"{type(coalesced.error).__name__}: {coalesced.error}"
    if function is not None and function.values and head is not None and head.values:
        ref = median(function.values)
        extra["function_style_step_per_s"] = round(ref, 3)
        extra["vs_function_style"] = round(median(head.values) / ref, 3)
        extra["target_value"] = round(FUNCTION_STYLE_FACTOR * ref, 3)
    out.side(TORCH_STYLE, head, {**torch_style, "variant": variant, **extra}, setup_error)
    if head is not plain:
        out.side(TORCH_PLAIN, plain, {**torch_style, "variant": "plain"}, setup_error)
    if fw.impl == "palatine":
        out.side(FUNCTION_STYLE, function, common, setup_error)
