"""The demo: data-parallel training of a small MLP on a local mesh, or with ``--connect``
on the job ``palatine launch`` runs it in (``palatine launch --scheduler slurm --hosts 2
--procs-per-host 2 -- palatine demo --connect``).

Every rank builds the same model (same seed), draws its own data, and all-reduces the
flattened gradients (plus the loss) over the mesh's process group each step. The
functions below run on the workers (imported there by their path); `main` drives them.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from typing import Any

from palatine.cli import demo_torch
from palatine.cli.demo_common import HELD_OUT, IN_FEATURES, data_seed, header, mlp, report
from palatine.config import roles
from palatine.config.roles import ControllerOptions

__all__ = [
    "init_state",
    "train_step",
    "evaluate",
    "rejoin",
    "steps_done",
    "main",
    "add_arguments",
    "run",
]

# --------------------------------------------------------------------------- worker side


def init_state(pg: Any, seed: int, hidden: int, lr: float, batch_size: int) -> dict[str, Any]:
    """Identical replicas (same seed), a fixed teacher, per-rank data, a held-out set."""
    import torch
    import torch.distributed as dist

    from palatine.tensor.worker import worker_info

    rank = worker_info()["rank"]
    torch.manual_seed(seed)
    model = mlp(hidden)
    teacher = mlp(32)
    for p in teacher.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(data_seed(seed, rank))
    held = torch.Generator().manual_seed(data_seed(seed, None))
    x_held = torch.randn(HELD_OUT, IN_FEATURES, generator=held)
    return {
        "model": model,
        "teacher": teacher,
        "opt": torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
        "gen": gen,
        "pg": pg,
        "world": dist.get_world_size(pg),
        "batch": batch_size,
        "held": (x_held, teacher(x_held)),
        "steps": 0,  # steps completed: where this rank's data stream is
    }


def train_step(state: dict[str, Any]) -> float:
    """Forward, backward, one all-reduce of gradients + loss (averaged), optimizer step.

    A step whose all-reduce fails (a rank died) changes nothing, its data included, and
    returns NaN: the state stays usable, and the step is taken again after a recovery.
    It also leaves the process group, closing its connections: a rank still waiting in
    the same all-reduce for this one then fails at once too, instead of waiting out the
    collective timeout (gloo cannot abort a collective).
    """
    import torch
    import torch.distributed as dist

    model, opt = state["model"], state["opt"]
    if state["pg"] is None:  # it left the group after a failure: wait for a recovery
        return math.nan
    at = state["gen"].get_state()
    x = torch.randn(state["batch"], IN_FEATURES, generator=state["gen"])
    y = state["teacher"](x)
    opt.zero_grad(set_to_none=False)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    params = [p for p in model.parameters()]
    flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.detach().reshape(1)])
    try:
        dist.all_reduce(flat, group=state["pg"])
    except Exception:  # noqa: BLE001 - a peer is gone: leave everything as it was, and the group
        state["gen"].set_state(at)
        state["pg"] = None  # the last reference: its connections close now
        if dist.is_initialized():
            dist.destroy_process_group()
        return math.nan
    flat /= state["world"]
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p))
        offset += n
    opt.step()
    state["steps"] += 1
    from palatine.hosting import user_metrics  # the dashboard plots it (docs/dashboard.md)

    user_metrics.gauge("loss").set(float(flat[-1]))
    return float(flat[-1])


def steps_done(state: dict[str, Any]) -> int:
    """How many steps this rank has completed."""
    return int(state["steps"])


def rejoin(state: dict[str, Any], pg: Any, steps: int) -> None:
    """After a recovery: train over the new process group ``pg``; a rank that starts
    afresh moves its data stream to where the others are (``steps`` batches on), which
    the user's code does the way its data is read."""
    import torch
    import torch.distributed as dist

    state["pg"] = pg
    state["world"] = dist.get_world_size(pg)
    while state["steps"] < steps:
        torch.randn(state["batch"], IN_FEATURES, generator=state["gen"])
        state["steps"] += 1


def evaluate(state: dict[str, Any]) -> tuple[float, float]:
    """Held-out loss and a checksum of the parameters (replicas must agree)."""
    import torch

    x, y = state["held"]
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(state["model"](x), y).item()
        checksum = float(sum(p.double().sum() for p in state["model"].parameters()))
    return loss, checksum


# --------------------------------------------------------------------------- client side


def rebuild(
    mesh: Any, state: Any, recovered: list[int], seed: int, hidden: int, lr: float, batch: int
) -> tuple[int, int]:
    """After ``mesh.recover()`` brought back ``recovered``: a new process group, the state
    made again on those ranks, the data position of the others, the model and optimizer
    of a survivor. The survivor and the steps done. The group's handle is dropped when
    this returns: a group nobody holds any more is freed, closing its connections (what
    ends a later loss's hung collectives on the survivors)."""
    from palatine import fetch, remote, resync

    pg = mesh.process_group()  # over the new generation of the collectives
    state.restore(init_state, pg, seed, hidden, lr, batch)
    survivor = next(r for r in range(len(mesh)) if r not in recovered)
    done = int(fetch(remote(steps_done)(state), shard=survivor).result())
    remote(rejoin, mutates=("state",))(state, pg, done)
    resync(state, src=survivor)
    return survivor, done


MAX_RECOVERIES = 5
"""Recoveries in a row without progress (a fetched step, or a phase done) before the demo
gives up: a rank lost each time it comes back ends the demo with its last fault, not a
loop."""


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _fresh_state(mesh: Any, args: argparse.Namespace) -> Any:
    """The state made on every rank, as at the start (a new process group)."""
    from palatine import remote

    return remote(init_state)(
        mesh.process_group(), args.seed, args.hidden, args.lr, args.batch_size
    )


def _kill(mesh: Any, rank: int) -> float:
    """SIGKILL ``rank``'s worker, a fault as from outside; when it was sent."""
    from palatine import fetch, remote

    pid = fetch(remote(os.getpid)(), shard=rank).result()
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


class _Faults:
    """Recovery from any lost rank, in every phase after the mesh is up (the set-up, a
    training step, the final evaluation, a recovery itself): the lost ranks are brought
    back (again when one is lost while that runs), made level with the others, and the
    phase is taken again. At most `MAX_RECOVERIES` in a row without progress."""

    def __init__(self, mesh: Any, args: argparse.Namespace, console: Any) -> None:
        self.mesh, self.args, self.console = mesh, args, console
        self.in_a_row = 0
        self.while_recovering: Any = None  # the demo's own fault inside the next recovery

    def progressed(self) -> None:
        """A step's result was fetched, or a phase done: the count of recoveries restarts."""
        self.in_a_row = 0

    def recover(self, error: BaseException, state: Any) -> tuple[Any, int]:
        """After ``error`` (a lost rank): the state on every rank again, and the step to
        go on at (past the last step: training is done). ``state`` None (lost during the
        set-up), or no rank left that kept it: the state is made afresh, from step 1."""
        from palatine import DeviceException, RecoveryError, fetch, remote

        setup = state is None
        behind: set[int] = set()  # ranks brought back, not level with the others yet
        seconds = 0.0
        while True:
            self.in_a_row += 1
            if self.in_a_row > MAX_RECOVERIES:
                raise RecoveryError(
                    f"gave up after {MAX_RECOVERIES} recoveries in a row without progress; "
                    f"the last fault: {_first_line(error)}"
                )
            rec = self.mesh.recover()
            behind.update(rec.ranks)
            seconds += rec.seconds
            if self.while_recovering is not None:
                fault, self.while_recovering = self.while_recovering, None
                fault()
            try:
                survivor: int | None = None
                if state is None or len(behind) >= len(self.mesh):
                    state, done = _fresh_state(self.mesh, self.args), 0
                else:
                    args = self.args
                    survivor, done = rebuild(self.mesh, state, sorted(behind), args.seed,
                                             args.hidden, args.lr, args.batch_size)  # fmt: skip
                # Every rank level (the resync done) before the phase is taken again.
                for r in range(len(self.mesh)):
                    fetch(remote(steps_done)(state), shard=r).result()
            except DeviceException as e:
                error = e
                self.console.print(f"fault during the recovery: {_first_line(e)}")
                continue
            break
        ranks = ", ".join(map(str, sorted(behind)))
        if survivor is None:
            how = "the state made afresh"
        else:
            how = f"state from rank {survivor}"
        if setup:
            then = "setting up again"
        elif done >= self.args.steps:
            then = "evaluating again"
        else:
            then = f"going on at step {done + 1}"
        self.console.print(f"recovered rank {ranks} in {seconds:.2f} s ({how}); {then}")
        return state, done + 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hosts", type=int, default=1, help="hosts of the local mesh")
    p.add_argument("--procs-per-host", type=int, default=4, help="worker procs per host")
    p.add_argument("--steps", type=int, default=300, help="training steps")
    p.add_argument("--batch-size", type=int, default=64, help="samples per rank and step")
    p.add_argument("--hidden", type=int, default=128, help="width of the MLP's hidden layer")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the data")
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where the workers compute (auto: CUDA when there is a GPU)",
    )
    p.add_argument("--log-every", type=int, default=10, help="steps between two loss lines")
    p.add_argument(
        "--style",
        choices=["function", "torch"],
        default="function",
        help="function: each step is one remote function on every rank (recovers lost "
        "ranks); torch: the same training as a plain torch program on mesh tensors",
    )
    # the controller's, as `palatine controller` declares them
    roles.add_arguments(
        p, ControllerOptions, only=("operation_timeout_s", "fail_on_worker_timeout")
    )
    p.add_argument(
        "--kill-rank",
        type=int,
        default=None,
        help="SIGKILL this rank's worker (a fault, when --kill-at says), recover it and go on",
    )
    p.add_argument("--at-step", type=int, default=None, help="the step --kill-rank kills at")
    p.add_argument(
        "--kill-at",
        choices=["step", "recovery", "evaluation"],
        default="step",
        help="when --kill-rank kills: at --at-step (step); at --at-step and again while "
        "the demo recovers from that (recovery); as the final evaluation starts (evaluation)",
    )
    p.add_argument(
        "--connect",
        action="store_true",
        help="train on the job 'palatine launch' runs this in (--hosts, --procs-per-host, "
        "--device and the timeouts are the job's)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        print("the demo needs torch: pip install 'palatine[torch]'", file=sys.stderr)
        return 2
    return main(args)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from palatine import RecoveryError, connect, local_mesh

    console = Console(stderr=False)
    if args.kill_rank is not None:
        if args.style == "torch":
            print("demo: --kill-rank needs --style function", file=sys.stderr)
            return 2
        if args.connect:
            print("demo: --kill-rank kills a local worker; not with --connect", file=sys.stderr)
            return 2
        at_step = args.kill_at != "evaluation"
        if at_step and (args.at_step is None or not 1 <= args.at_step <= args.steps):
            print(f"demo: --at-step must be from 1 to {args.steps}", file=sys.stderr)
            return 2
        if not 0 <= args.kill_rank < args.hosts * args.procs_per_host:
            print("demo: --kill-rank must be a rank of the mesh", file=sys.stderr)
            return 2
    t0 = time.monotonic()
    if args.connect:
        mesh = connect()
    else:
        mesh = local_mesh(
            args.hosts,
            args.procs_per_host,
            device=args.device,
            operation_timeout_s=args.operation_timeout_s,
            fail_on_worker_timeout=args.fail_on_worker_timeout,
        )
    try:
        with mesh:
            header(mesh, args, console)
            if args.style == "torch":
                return demo_torch.run(mesh, args, console, t0)
            return _demo(mesh, args, console, t0)
    except RecoveryError as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1


def _demo(mesh: Any, args: argparse.Namespace, console: Any, t0: float) -> int:
    """Set up, train, evaluate; a lost rank in any of them is recovered from (`_Faults`)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from palatine import DeviceException, fetch, remote

    n = len(mesh)
    faults = _Faults(mesh, args, console)
    state: Any = None
    while True:  # the set-up
        try:
            if state is None:
                state = _fresh_state(mesh, args)
            first_eval = fetch(remote(evaluate)(state)).result()
            break
        except DeviceException as e:
            console.print(f"fault: {_first_line(e)}")
            state, _ = faults.recover(e, None)
    faults.progressed()
    console.print(f"mesh ready in {time.monotonic() - t0:.1f} s; collectives initialised")
    step_fn = remote(train_step, mutates=("state",))
    first_loss: float | None = None
    last_loss = math.nan
    t_train = time.monotonic()
    interactive = console.is_terminal
    progress = Progress(
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[rate]:.1f} steps/s"),
        TimeElapsedColumn(),
        console=console,
        disable=not interactive,
    )
    kill_at = args.kill_at if args.kill_rank is not None else None
    killed_at: float | None = None  # when the demo's own kill was, until a recovery from it
    since, what = 0.0, "the fault"  # what the last recovery was from
    resumed = False
    with progress:
        task = progress.add_task("train", total=args.steps, loss=math.nan, rate=0.0)
        next_print = 0.1
        step = 1
        while True:
            while step <= args.steps:
                if kill_at in ("step", "recovery") and step == args.at_step:
                    killed_at = _kill(mesh, args.kill_rank)
                    if kill_at == "recovery":  # and again while recovering from it
                        faults.while_recovering = lambda: _kill(mesh, args.kill_rank)
                    kill_at = None
                try:
                    loss = step_fn(state)
                    if step == 1 or step % args.log_every == 0 or step == args.steps or resumed:
                        last_loss = fetch(loss).result()
                        faults.progressed()
                except DeviceException as e:
                    # Any lost rank is recovered from: the demo's kill, timed from the
                    # kill, or another (killed from outside, out of memory), timed from
                    # when it was seen.
                    since, what = time.monotonic(), "the fault"
                    if killed_at is not None:
                        since, what, killed_at = killed_at, "the kill", None
                    console.print(f"fault: {_first_line(e)}")
                    state, step = faults.recover(e, state)
                    resumed = True
                    continue
                if resumed:
                    resumed = False
                    console.print(f"step {step} done {time.monotonic() - since:.2f} s after {what}")
                if first_loss is None:
                    first_loss = last_loss
                rate = step / max(time.monotonic() - t_train, 1e-9)
                progress.update(task, completed=step, loss=last_loss, rate=rate)
                if not interactive and step / args.steps >= next_print:
                    print(
                        f"step {step}/{args.steps} loss {last_loss:.4f} ({rate:.1f} steps/s)",
                        flush=True,
                    )
                    next_print += 0.1
                step += 1
            train_s = time.monotonic() - t_train
            try:  # the final evaluation and the replicas' check
                if kill_at == "evaluation":
                    killed_at, kill_at = _kill(mesh, args.kill_rank), None
                results = [fetch(remote(evaluate)(state), shard=r).result() for r in range(n)]
                break
            except DeviceException as e:
                console.print(f"fault: {_first_line(e)}")
                # Past the last step, or from step 1 again when no rank kept the model.
                state, step = faults.recover(e, state)
                resumed = step <= args.steps
    return report(console, args, (first_loss, last_loss), first_eval[0], results, train_s, t0)
