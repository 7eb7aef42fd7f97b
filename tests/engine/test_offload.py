"""The host tier's engine half: a slot moved to host memory and back holds exactly what it held (weights,
AdamW moments and step, unstepped gradients), trains on bit for bit as if it had never left, and a host
copy written to disk is the state a parked slot's save_state writes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor

from loraplex.engine.local import LocalEngine, build_local_engine
from loraplex.engine.types import AdamParams, DatumInput, LoraConfig, PassRequest
from loraplex.errors import CapacityError, NotFoundError

CONFIG = LoraConfig(rank=4, seed=7)


def _request(slot: int, seed: int) -> PassRequest:
    tokens = np.random.default_rng(seed).integers(0, 256, 17)
    datum = DatumInput(tokens[:-1], {"target_tokens": tokens[1:]})
    return PassRequest(slot, "cross_entropy", {}, [datum], False)


def _trained_slot(engine: LocalEngine) -> int:
    """A slot with moments and a step count from one step, and a second pass's gradients not yet stepped."""
    slot = engine.create_slot(CONFIG)
    engine.run_pass([_request(slot, 1)])
    engine.optim_step({slot: AdamParams(learning_rate=1e-2)})
    engine.run_pass([_request(slot, 2)])
    return slot


def _state(engine: LocalEngine, slot: int) -> dict[str, Tensor | int | bool]:
    """Copies of everything the slot holds."""
    adam = engine.pool.get(slot).adam
    flat = {
        "weights": adam.weights_N,
        "grads": adam.grads_N,
        "exp_avg": adam.exp_avg_N,
        "exp_avg_sq": adam.exp_avg_sq_N,
    }
    return {k: v.clone() for k, v in flat.items()} | {"step": adam.step, "has_gradients": adam.has_gradients}


def _assert_equal(got: dict[str, Tensor | int | bool], expected: dict[str, Tensor | int | bool]) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, Tensor):
            assert torch.equal(got[key], value), key  # type: ignore[arg-type]
        else:
            assert got[key] == value, key


def _free_all(engine: LocalEngine) -> None:
    for slot in engine.pool.live_slots:
        engine.free_slot(slot)


@pytest.fixture
def fresh(engine: LocalEngine) -> LocalEngine:
    _free_all(engine)
    yield engine
    _free_all(engine)


def test_a_slot_moved_to_host_and_back_holds_exactly_what_it_held_and_trains_on_bit_for_bit(fresh) -> None:
    _check_round_trip(fresh)


@pytest.mark.gpu
def test_on_cuda_the_copies_through_pinned_memory_on_a_side_stream_are_exact(tmp_path: Path) -> None:
    """The CUDA path (pinned buffers, a side stream, the freed slot reused while the copy drains)."""
    _check_round_trip(build_local_engine("tiny", tmp_path, "cuda", 4, 8, None))


def _check_round_trip(engine: LocalEngine) -> None:
    twin, slot = _trained_slot(engine), _trained_slot(engine)
    before = _state(engine, slot)
    assert before["step"] == 1 and before["has_gradients"] and torch.count_nonzero(before["grads"]) > 0

    key = engine.offload_slot(slot)
    assert not engine.pool.has_slot(slot)
    # The freed slot is reused meanwhile and trained: nothing of it may reach the host copy.
    other = engine.create_slot(LoraConfig(rank=8, seed=3))
    engine.run_pass([_request(other, 9)])
    engine.free_slot(other)
    back = engine.restore_slot(key)
    _assert_equal(_state(engine, back), before)
    with pytest.raises(NotFoundError):  # the copy is forgotten once back
        engine.restore_slot(key)

    # It steps and trains on exactly as its twin, which never left its slot.
    for s in (back, twin):
        engine.optim_step({s: AdamParams(learning_rate=1e-2)})
        engine.run_pass([_request(s, 3)])
    _assert_equal(_state(engine, back), _state(engine, twin))


def test_no_free_slot_keeps_the_host_copy(fresh) -> None:
    engine = fresh
    slot = _trained_slot(engine)
    before = _state(engine, slot)
    key = engine.offload_slot(slot)
    fillers = [engine.create_slot(CONFIG) for _ in range(engine.max_slots)]
    with pytest.raises(CapacityError):
        engine.restore_slot(key)
    engine.free_slot(fillers[0])
    _assert_equal(_state(engine, engine.restore_slot(key)), before)


def test_a_host_copy_written_to_disk_loads_as_the_parked_slot_would(fresh, tmp_path) -> None:
    engine = fresh
    slot = _trained_slot(engine)
    before = _state(engine, slot)
    engine.save_state(slot, tmp_path / "parked", "owner", with_gradients=True)
    key = engine.offload_slot(slot)
    size = engine.spill_offloaded(key, tmp_path / "spilled", "owner")

    files = sorted(p.name for p in (tmp_path / "spilled").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "parked").iterdir())
    assert size == sum(p.stat().st_size for p in (tmp_path / "spilled").iterdir())
    for name in files:  # byte for byte the files parking writes
        assert (tmp_path / "spilled" / name).read_bytes() == (tmp_path / "parked" / name).read_bytes()
    loaded, config = engine.load_state(tmp_path / "spilled", "owner", with_optimizer=True)
    assert config == CONFIG
    _assert_equal(_state(engine, loaded), before)
    with pytest.raises(NotFoundError):
        engine.spill_offloaded(key, tmp_path / "again", "owner")


def test_host_bytes_per_slot_counts_four_fp32_buffers_of_a_max_rank_slot(fresh) -> None:
    engine = fresh
    slot = engine.create_slot(LoraConfig(rank=engine.info.max_rank))
    adam = engine.pool.get(slot).adam
    assert engine.host_bytes_per_slot() == 4 * adam.weights_N.nbytes
    key = engine.offload_slot(slot)
    assert sum(t.nbytes for t in engine._offloaded[key].buffers) == engine.host_bytes_per_slot()
