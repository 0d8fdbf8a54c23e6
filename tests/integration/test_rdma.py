"""One-sided buffers (`palatine.rdma.RDMABuffer`) between real actor procs of one host.

One script (a module fixture) runs an owner actor that publishes a tensor and a
bytearray as buffers, reader actors on other procs and the client script itself that
read and write them (async endpoints with ``await``, plain ``def`` endpoints and the
script with ``.get()``), through both backends, and last SIGKILLs the owner while a
reader holds its buffer. Each test checks one behaviour in what the script printed.
"""

from __future__ import annotations

import pytest
from user_scripts import run_script

pytestmark = pytest.mark.timeout(120)

SCRIPT = """
import asyncio, os, select, signal, time, torch
from palatine import Actor, config, endpoint, this_host
from palatine.rdma import RDMABuffer

N = 1 << 18  # floats: 1 MiB

class Owner(Actor):
    def __init__(self):
        self.weights = torch.arange(N, dtype=torch.float32)
        self.note = bytearray(b"hello, buffers")

    @endpoint
    def publish(self):
        return RDMABuffer(self.weights), RDMABuffer(self.note)

    @endpoint
    def publish_view(self):
        # a view of part of the storage: updates through the tensor still show
        return RDMABuffer(self.weights[16:32])

    @endpoint
    def publish_constant(self):
        # read-only bytes: readable, never written
        return RDMABuffer(b"constant bytes")

    @endpoint
    def bump(self):
        self.weights.add_(1)

    @endpoint
    def republish(self, old):
        # a fresh tensor each time, the last one dropped
        if old is not None:
            old.drop().get()
        self.fresh = torch.ones(1024)
        return RDMABuffer(self.fresh)

    @endpoint
    def look(self):
        return float(self.weights[:8].sum()), bytes(self.note), os.getpid()

class Reader(Actor):
    @endpoint
    async def read(self, buf, backend="auto"):
        dst = torch.empty(buf.size() // 4)
        with config.override(rdma_backend=backend):
            await buf.read_into(dst)
        return float(dst.sum()), float(dst[5])

    @endpoint
    def read_sync(self, buf, offset, backend="auto"):
        dst = bytearray(buf.size() - offset)
        with config.override(rdma_backend=backend):
            buf.read_into(dst, offset=offset).get()
        return bytes(dst)

    @endpoint
    async def write(self, buf, data, offset, backend="auto"):
        with config.override(rdma_backend=backend):
            await buf.write_from(data, offset=offset)

    @endpoint
    def wrong_sizes(self, buf):
        out = []
        for call in (
            lambda: buf.read_into(torch.empty(10)),
            lambda: buf.write_from(torch.empty(N + 1)),
            lambda: buf.write_from(torch.empty(8), offset=buf.size() - 4),
            lambda: buf.read_into(torch.empty(N), offset=buf.size() + 1),
        ):
            try:
                call()
                out.append("accepted")
            except ValueError as e:
                out.append("ValueError")
        return out

    @endpoint
    async def read_dropped(self, buf, backend):
        try:
            with config.override(rdma_backend=backend):
                await buf.read_into(bytearray(buf.size()))
            return "read"
        except ValueError as e:
            return "ValueError: " + str(e)

    @endpoint
    async def read_timed(self, buf, backend):
        try:
            with config.override(rdma_backend=backend):
                await buf.read_into(torch.empty(buf.size() // 4), timeout=1.0)
            return "read"
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    @endpoint
    def mapped(self):
        from palatine.rdma import shm

        return sum(len(peer.maps) for peer in shm._peers.values())

    @endpoint
    async def read_dead(self, buf, backend):
        t0 = time.monotonic()
        try:
            with config.override(rdma_backend=backend):
                await buf.read_into(torch.empty(buf.size() // 4), timeout=30)
            return "read", 0.0, {}
        except Exception as e:
            return f"{type(e).__name__}: {e}", time.monotonic() - t0, getattr(e, "details", {})

procs = this_host().spawn_procs(per_host={"procs": 4})
owner = procs.slice(procs=0).spawn("owner", Owner)
readers = procs.slice(procs=slice(1, 4)).spawn("reader", Reader)
weights, note = owner.publish.call_one().get()
print("SIZE", weights.size(), note.size())
print("OWNER", weights.owner)
expect = float(torch.arange(N, dtype=torch.float32).sum())
for backend in ("auto", "socket"):
    got = readers.read.call(weights, backend).get().values()
    print("READ_" + backend, all(g == (expect, 5.0) for g in got), len(got))
    print("READ_SYNC_" + backend, readers.slice(procs=1).read_sync.call_one(note, 7, backend).get())

# the script itself, as a plain thread: .get()
mine = torch.empty(N)
weights.read_into(mine).get()
print("CLIENT_READ", float(mine.sum()) == expect)

# the owner's in-place updates are what readers see
owner.bump.call_one().get()
got = readers.slice(procs=2).read.call_one(weights).get()
print("AFTER_BUMP", got == (expect + N, 6.0))
view = owner.publish_view.call_one().get()
small = torch.empty(16)
view.read_into(small).get()
print("VIEW", small.tolist() == [float(i + 1) for i in range(16, 32)])

# writes with offsets land in the owner's tensor and bytearray
readers.slice(procs=1).write.call_one(weights, torch.full((4,), -1.0), 8).get()
readers.slice(procs=3).write.call_one(note, b"HELLO", 0).get()
readers.slice(procs=2).write.call_one(note, b"BUFFERS", 7, "socket").get()
total, text, owner_pid = owner.look.call_one().get()
print("WRITES", total == float(sum([1, 2, -1, -1, -1, -1, 7, 8])), text)

constant = owner.publish_constant.call_one().get()
try:
    constant.write_from(b"x")
    refused = "accepted"
except ValueError:
    refused = "ValueError"
print("READONLY", readers.slice(procs=1).read_sync.call_one(constant, 9).get(), refused)

print("WRONG", ",".join(readers.slice(procs=1).wrong_sizes.call_one(weights).get()))

# drop: by a holder (through the owner's server), then reads fail on both paths
spare = owner.publish.call_one().get()[1]
spare.drop().get()
for backend in ("auto", "socket"):
    print("DROPPED_" + backend, readers.slice(procs=1).read_dropped.call_one(spare, backend).get())

# files of dropped buffers are unmapped by the reader: its mappings do not pile up
one = readers.slice(procs=1)
before = one.mapped.call_one().get()
fresh = None
for _ in range(5):
    fresh = owner.republish.call_one(fresh).get()
    one.read.call_one(fresh).get()
print("MAPPED", before, one.mapped.call_one().get())

# a stopped owner (SIGSTOP): its memory is read all the same on this host, and a
# transfer through its server times out, naming it
os.kill(owner_pid, signal.SIGSTOP)
try:
    for backend in ("auto", "socket"):
        print("STOPPED_" + backend, readers.slice(procs=2).read_timed.call_one(weights, backend).get())
finally:
    os.kill(owner_pid, signal.SIGCONT)

# the owner dies: a transfer fails at once, naming it
gone = os.pidfd_open(owner_pid)  # readable once the whole process has exited
os.kill(owner_pid, signal.SIGKILL)
assert select.select([gone], [], [], 10)[0], "the owner outlived SIGKILL by 10 s"
for backend in ("auto", "socket"):
    what, took, details = readers.slice(procs=3).read_dead.call_one(weights, backend).get()
    print("DEAD_" + backend, what)
    print("DEAD_TOOK_" + backend, took)
    print("DEAD_DETAILS_" + backend, details.get("pid") == owner_pid, details.get("rank"), details.get("host"))
procs.stop().get()
"""


@pytest.fixture(scope="module")
def out() -> dict[str, str]:
    lines, _ = run_script(SCRIPT, timeout_s=110)
    return lines


def test_buffers_travel_in_messages_with_their_size_and_owner(out: dict[str, str]) -> None:
    assert out["SIZE"] == f"{1 << 20} 14"
    assert "[0] on host " in out["OWNER"]


@pytest.mark.parametrize("backend", ["auto", "socket"])
def test_readers_on_other_procs_read_the_owners_bytes(out: dict[str, str], backend: str) -> None:
    assert out[f"READ_{backend}"] == "True 3"
    assert out[f"READ_SYNC_{backend}"] == repr(b"buffers")


def test_the_client_script_reads_with_get(out: dict[str, str]) -> None:
    assert out["CLIENT_READ"] == "True"


def test_readers_see_the_owners_in_place_updates_and_views(out: dict[str, str]) -> None:
    assert out["AFTER_BUMP"] == "True"
    assert out["VIEW"] == "True"


def test_writes_at_offsets_land_in_the_owners_tensor_and_bytearray(out: dict[str, str]) -> None:
    assert out["WRITES"] == "True " + repr(b"HELLO, BUFFERS")


def test_read_only_bytes_are_read_and_never_written(out: dict[str, str]) -> None:
    assert out["READONLY"] == repr(b"bytes") + " ValueError"


def test_a_destination_or_source_of_the_wrong_size_is_a_value_error(out: dict[str, str]) -> None:
    assert out["WRONG"] == "ValueError,ValueError,ValueError,ValueError"


@pytest.mark.parametrize("backend", ["auto", "socket"])
def test_a_dropped_buffer_fails_its_reads(out: dict[str, str], backend: str) -> None:
    assert out[f"DROPPED_{backend}"].startswith("ValueError: ")
    assert "dropped" in out[f"DROPPED_{backend}"] or "not registered" in out[f"DROPPED_{backend}"]


def test_a_reader_unmaps_the_files_of_dropped_buffers(out: dict[str, str]) -> None:
    before, after = map(int, out["MAPPED"].split())
    assert after <= before + 1, (before, after)


def test_a_stopped_owner_is_read_on_its_host_and_times_out_through_its_server(
    out: dict[str, str],
) -> None:
    assert out["STOPPED_auto"] == "read"
    assert out["STOPPED_socket"].startswith("CallTimeout: rdma read: "), out["STOPPED_socket"]
    assert "[0] on host " in out["STOPPED_socket"]


@pytest.mark.parametrize("backend", ["auto", "socket"])
def test_a_dead_owner_fails_a_transfer_at_once_naming_it(out: dict[str, str], backend: str) -> None:
    assert out[f"DEAD_{backend}"].startswith("DeviceException: rdma read: the buffer's owner ")
    assert "[0] on host " in out[f"DEAD_{backend}"]
    assert float(out[f"DEAD_TOOK_{backend}"]) < 2.0
    assert out[f"DEAD_DETAILS_{backend}"].startswith("True 0 ")
