"""`palatine.random` on real workers: seeds, per-rank seeds and saved states.

One 1 × 2 local mesh (dims ``host`` and ``proc``, ranks 0-1) serves every test. A rank's
numbers are checked against local torch seeded as the rank was: that is what makes two
runs with the same seed agree.
"""

from __future__ import annotations

import pytest
import torch
from meshes import module_mesh

from palatine import call_on_shard_and_fetch, inspect, no_mesh, remote
from palatine.tensor.client.mesh import DeviceMesh
from palatine.tensor.client.random import (
    State,
    get_rng_state_all_cuda_remote,
    get_rng_state_remote,
    get_state,
    make_deterministic,
    new_state,
    seed_remote,
    set_manual_seed_remote,
    set_rng_state_all_cuda_remote,
    set_rng_state_remote,
    set_state,
)

pytestmark = pytest.mark.timeout(180)

RANKS = (0, 1)


mesh = module_mesh(1, 2, device="cpu")


def local_rand(seed: int, *shape: int) -> torch.Tensor:
    """What local torch draws first after ``torch.manual_seed(seed)``."""
    with no_mesh():
        g = torch.Generator().manual_seed(seed)
        return torch.rand(*shape, generator=g)


def shards(t: object) -> list[torch.Tensor]:
    return [inspect(t, proc=r) for r in RANKS]


def test_a_seed_gives_every_rank_the_numbers_local_torch_draws_after_it(mesh: DeviceMesh) -> None:
    with mesh.activate():
        set_manual_seed_remote(1234)
        a = torch.rand(4)
        set_manual_seed_remote(1234)
        b = torch.rand(4)
        set_manual_seed_remote(1235)
        c = torch.rand(4)
    expected = local_rand(1234, 4)
    for x, y, z in zip(shards(a), shards(b), shards(c), strict=True):
        assert torch.equal(x, expected) and torch.equal(y, expected)
        assert torch.equal(z, local_rand(1235, 4))


def test_process_idx_as_a_rank_tensor_gives_each_rank_its_own_numbers(mesh: DeviceMesh) -> None:
    with mesh.activate():
        set_manual_seed_remote(1234, process_idx=mesh.rank(("host", "proc")))
        per_rank = torch.rand(4)
        set_manual_seed_remote(1234, process_idx=3)
        shared = torch.rand(4)
    got = shards(per_rank)
    assert not torch.equal(got[0], got[1])
    for r in RANKS:
        assert torch.equal(got[r], local_rand(1234 ^ r, 4))
        assert torch.equal(inspect(shared, proc=r), local_rand(1234 ^ 3, 4))


def test_a_fetched_state_set_back_draws_the_same_numbers_again(mesh: DeviceMesh) -> None:
    with mesh.activate():
        set_manual_seed_remote(7, process_idx=mesh.rank("proc"))
        state = get_rng_state_remote()
        first = torch.rand(3)
        second = torch.rand(3)
        set_rng_state_remote(state)
        again = torch.rand(3)
    assert state.dtype == torch.uint8 and state.shape == torch.get_rng_state().shape
    with no_mesh():
        torch_state = torch.Generator().manual_seed(7 ^ 1).get_state()
    assert torch.equal(inspect(state, proc=1), torch_state)
    for r in RANKS:
        assert torch.equal(inspect(again, proc=r), inspect(first, proc=r))
        assert not torch.equal(inspect(second, proc=r), inspect(first, proc=r))


def test_new_state_leaves_the_current_state_and_set_state_switches_to_it(
    mesh: DeviceMesh,
) -> None:
    with mesh.activate():
        set_manual_seed_remote(5)
        mine = new_state(mesh.rank("proc") + 40)
        unchanged = torch.rand(2)
        saved = get_state()
        set_state(mine)
        own = torch.rand(2)
        set_state(saved)
        resumed = torch.rand(2)
    assert isinstance(mine, State) and mine.cuda is None  # CPU workers
    with no_mesh():
        g = torch.Generator().manual_seed(5)
        first, next_ = torch.rand(2, generator=g), torch.rand(2, generator=g)
    for r in RANKS:
        assert torch.equal(inspect(unchanged, proc=r), first)
        assert torch.equal(inspect(resumed, proc=r), next_)
        assert torch.equal(inspect(own, proc=r), local_rand(40 + r, 2))


def test_cuda_states_are_an_empty_list_on_cpu_workers(mesh: DeviceMesh) -> None:
    with mesh.activate():
        states = get_rng_state_all_cuda_remote()
        set_rng_state_all_cuda_remote(states)
        seed_remote()
        x = torch.rand(2)
    assert states == []
    assert not torch.equal(inspect(x, proc=0), inspect(x, proc=1))


def test_seeds_of_the_wrong_kind_fail_at_the_call(mesh: DeviceMesh) -> None:
    with pytest.raises(TypeError, match="no mesh is active"):
        get_state()
    with mesh.activate():
        with pytest.raises(TypeError, match="seed must be an int"):
            set_manual_seed_remote(1.5)
        with pytest.raises(TypeError, match="process_idx must be a 0-dim integer tensor"):
            set_manual_seed_remote(1, process_idx=torch.rand(()))
        with pytest.raises(ValueError, match="outside torch's seeds"):
            set_manual_seed_remote(2**64)


def test_make_deterministic_turns_on_deterministic_algorithms_on_every_rank(
    mesh: DeviceMesh,
) -> None:
    enabled = "torch.are_deterministic_algorithms_enabled"
    with mesh.activate():
        make_deterministic()
        try:
            assert all(call_on_shard_and_fetch(enabled, shard=r).result() for r in RANKS)
        finally:
            remote("torch.use_deterministic_algorithms")(False)
