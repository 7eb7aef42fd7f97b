"""Checkpoints resume bit for bit, are written atomically, and are verified before a slot is touched;
snapshots are immutable PEFT adapters that HF peft loads to the engine's own logits."""

import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

from loraplex.engine.checkpoints import load_state, save_state
from loraplex.engine.slots import SlotPool
from loraplex.engine.snapshots import load_snapshot, save_snapshot, slot_snapshot_files
from loraplex.engine.types import AdamParams, LoraConfig
from loraplex.errors import PermissionDeniedError, UserError
from loraplex.model.hf_checkpoint import base_model_digest, load_decoder
from loraplex.model.multi_lora import LoRARouting
from loraplex.model.packing import PackedSequences
from tests.engine.conftest import randomize_lora_b

OWNER = "owner-digest-a"
HPARAMS = AdamParams(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=1.0)
TOKENS = [3, 17, 42, 5, 9, 60, 1]


def _write_hf_model(directory: Path, tie_word_embeddings: bool) -> Path:
    """A tiny random Qwen3 saved by transformers itself."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def hf_dir(request, tmp_path_factory):
    return _write_hf_model(tmp_path_factory.mktemp("hf"), tie_word_embeddings=request.param)


@pytest.fixture(scope="module")
def base_digest(hf_dir):
    return base_model_digest(hf_dir)


@pytest.fixture
def decoder(hf_dir):
    return load_decoder(hf_dir)


@pytest.fixture
def pool(decoder):
    return SlotPool(decoder, max_slots=4, max_rank=8)


def _logits(decoder, slot: int | None, tokens: list[int] = TOKENS) -> torch.Tensor:
    routing = LoRARouting.from_sequences([len(tokens)], [slot])
    return decoder.logits(torch.tensor(tokens), PackedSequences.from_lengths([len(tokens)]), routing)


def _train_step(decoder, pool: SlotPool, slot: int, step: int) -> None:
    """Next-token cross-entropy on a step-dependent sequence, then one optimizer step."""
    tokens = [(t * (step + 2)) % 96 for t in TOKENS]
    logits = _logits(decoder, slot, tokens)
    torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(tokens[1:]), reduction="sum").backward()
    pool.step({slot: HPARAMS})


def _state(pool: SlotPool, slot: int) -> dict[str, torch.Tensor]:
    """Copies of everything a slot holds: weights, gradients, moments, step."""
    record = pool.get(slot)
    optimizer = record.optimizer_state()
    state = {f"w.{n}": t.detach().clone() for n, t in record.weights.items()}
    state |= {f"g.{n}": t.grad.clone() for n, t in record.weights.items()}
    state |= {f"m.{n}": t.clone() for n, t in optimizer.exp_avg.items()}
    state |= {f"v.{n}": t.clone() for n, t in optimizer.exp_avg_sq.items()}
    return state | {"step": torch.tensor(optimizer.step)}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_with_optimizer_continues_bit_for_bit(decoder, pool, base_digest, tmp_path):
    """3 steps, save, load into another slot: the 4th step equals the uninterrupted 4th step exactly;
    a weights-only load (fresh AdamW) diverges."""
    original = pool.create(LoraConfig(rank=4, seed=5))
    for step in range(3):
        _train_step(decoder, pool, original, step)
    save_state(pool, original, tmp_path / "ckpt", OWNER, base_digest)

    resumed, config = load_state(pool, tmp_path / "ckpt", OWNER, base_digest, with_optimizer=True)
    weights_only, _ = load_state(pool, tmp_path / "ckpt", OWNER, base_digest, with_optimizer=False)

    assert config == LoraConfig(rank=4, seed=5)
    assert _equal(_state(pool, resumed), _state(pool, original))
    assert pool.get(weights_only).optimizer_state().step == 0
    for slot in (original, resumed, weights_only):
        _train_step(decoder, pool, slot, 3)
    after = _state(pool, original)
    assert after["step"] == 4
    assert _equal(_state(pool, resumed), after)
    diverged = _state(pool, weights_only)
    assert not any(torch.equal(diverged[k], after[k]) for k in after if k.startswith("w."))


def test_load_into_a_live_slot_overwrites_it_in_place(decoder, pool, base_digest, tmp_path):
    source, target = pool.create(LoraConfig(rank=2, seed=1)), pool.create(LoraConfig(rank=2, seed=2))
    _train_step(decoder, pool, source, 0)
    save_state(pool, source, tmp_path / "ckpt", OWNER, base_digest)
    _train_step(decoder, pool, target, 0)

    assert load_state(pool, tmp_path / "ckpt", OWNER, base_digest, True, slot=target)[0] == target

    assert _equal(_state(pool, target), _state(pool, source))
    torch.testing.assert_close(_logits(decoder, target), _logits(decoder, source), rtol=0, atol=0)


def _corrupt(name: str, directory: Path) -> None:
    """Damage a saved checkpoint the way `name` says."""
    if name == "truncated_weights":
        data = (directory / "weights.safetensors").read_bytes()
        (directory / "weights.safetensors").write_bytes(data[: len(data) // 2])
    elif name == "flipped_byte_in_optimizer":
        path = directory / "optimizer.safetensors"
        data = bytearray(path.read_bytes())
        data[-3] ^= 0xFF
        path.write_bytes(bytes(data))
    elif name == "missing_manifest":
        (directory / "manifest.json").unlink()
    elif name == "missing_weights":
        (directory / "weights.safetensors").unlink()


@pytest.mark.parametrize(
    ("damage", "load_kwargs", "error", "message"),
    [
        pytest.param("none", {"base": "another-base"}, UserError, "saved on another base model", id="base"),
        pytest.param(
            "none", {"owner": "owner-b"}, PermissionDeniedError, "belongs to another tenant", id="owner"
        ),
        pytest.param(
            "none", {"max_rank": 2, "target_rank": 2}, UserError, "lora rank 4 is not allowed", id="max_rank"
        ),
        pytest.param(
            "none", {"target_rank": 2, "live_only": True}, UserError, "rank 4 != 2", id="live_slot_shape"
        ),
        pytest.param("truncated_weights", {}, UserError, "weights.safetensors is corrupt", id="truncated"),
        pytest.param(
            "flipped_byte_in_optimizer", {}, UserError, "optimizer.safetensors is corrupt", id="flip"
        ),
        pytest.param("missing_manifest", {}, UserError, "it has no manifest.json", id="no_manifest"),
        pytest.param("missing_weights", {}, UserError, "weights.safetensors is missing", id="no_weights"),
    ],
)
def test_bad_checkpoint_is_refused_before_the_target_slot_is_touched(
    decoder, base_digest, tmp_path, damage, load_kwargs, error, message
):
    saver = SlotPool(decoder, max_slots=2, max_rank=8)
    source = saver.create(LoraConfig(rank=4, seed=1))
    _train_step(decoder, saver, source, 0)
    save_state(saver, source, tmp_path / "ckpt", OWNER, base_digest)
    saver.free(source)
    _corrupt(damage, tmp_path / "ckpt")
    pool = SlotPool(decoder, max_slots=2, max_rank=load_kwargs.get("max_rank", 8))
    target = pool.create(LoraConfig(rank=load_kwargs.get("target_rank", 4), seed=9))
    _train_step(decoder, pool, target, 1)
    _logits(decoder, target).sum().backward()  # pending gradients must survive too
    before = _state(pool, target)

    owner, base = load_kwargs.get("owner", OWNER), load_kwargs.get("base", base_digest)
    # Into the live slot, and (unless only the live slot's shape is wrong) into a new one.
    for slot in (target,) if load_kwargs.get("live_only") else (target, None):
        with pytest.raises(error, match=message):
            load_state(pool, tmp_path / "ckpt", owner, base, with_optimizer=True, slot=slot)

    assert _equal(_state(pool, target), before)
    assert pool.live_slots == [target]


def _save_version_1(pool: SlotPool, decoder, base_digest, directory: Path) -> dict[str, torch.Tensor]:
    """Save a trained slot to `directory`, train it on; return the saved state (without gradients)."""
    slot = pool.create(LoraConfig(rank=2, seed=4))
    _train_step(decoder, pool, slot, 0)
    save_state(pool, slot, directory, OWNER, base_digest)
    version_1 = {k: v for k, v in _state(pool, slot).items() if not k.startswith("g.")}
    _train_step(decoder, pool, slot, 1)
    return version_1


def _loaded(pool: SlotPool, directory: Path, base_digest: str) -> dict[str, torch.Tensor]:
    """Load `directory` into a new slot and return its state (without gradients), freeing the slot."""
    slot, _ = load_state(pool, directory, OWNER, base_digest, with_optimizer=True)
    state = _state(pool, slot)
    pool.free(slot)
    return {k: v for k, v in state.items() if not k.startswith("g.")}


def test_failed_save_keeps_the_previous_version_and_leaves_no_temp_dirs(
    decoder, pool, base_digest, tmp_path, monkeypatch
):
    version_1 = _save_version_1(pool, decoder, base_digest, tmp_path / "ckpt")

    def half_write_then_fail(tensors, filename, **kwargs):
        Path(filename).write_bytes(safetensors.torch.save(tensors)[:100])
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", half_write_then_fail)
    with pytest.raises(OSError, match="disk full"):
        save_state(pool, pool.live_slots[0], tmp_path / "ckpt", OWNER, base_digest)
    monkeypatch.undo()

    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert _equal(_loaded(pool, tmp_path / "ckpt", base_digest), version_1)


def _arm_crash(crash_at: str) -> None:
    """In a forked child: make the process die (exit 0) at the named point of a save."""
    if crash_at == "weights_write":

        def save_file(tensors, filename, **kwargs):
            Path(filename).write_bytes(b"partial")
            os._exit(0)

        safetensors.torch.save_file = save_file
    else:
        real_rename = os.rename

        def rename(src, dst):
            real_rename(src, dst)
            if Path(src).name == "ckpt":  # the old version was just moved aside
                os._exit(0)

        os.rename = rename


@pytest.mark.parametrize("crash_at", ["weights_write", "between_renames"])
def test_save_killed_midway_leaves_the_old_version_whole(decoder, pool, base_digest, tmp_path, crash_at):
    """A forked child dies (os._exit, no cleanup) inside save_state; the parent still loads version 1."""
    version_1 = _save_version_1(pool, decoder, base_digest, tmp_path / "ckpt")
    pid = os.fork()
    if pid == 0:  # the child: arm the crash, save, die without any cleanup
        try:
            _arm_crash(crash_at)
            save_state(pool, pool.live_slots[0], tmp_path / "ckpt", OWNER, base_digest)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child did not reach its crash point"
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == (
        ["ckpt"] if crash_at == "weights_write" else []
    )

    assert _equal(_loaded(pool, tmp_path / "ckpt", base_digest), version_1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.parametrize(
    "config", [LoraConfig(rank=4, seed=2), LoraConfig(rank=3, seed=2, train_mlp=False)], ids=["all", "no_mlp"]
)
def test_snapshot_loaded_by_peft_gives_the_engine_logits(decoder, pool, hf_dir, tmp_path, config):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    slot = pool.create(config)
    randomize_lora_b(pool.get(slot).weights, 0.05, torch.Generator().manual_seed(0))
    save_snapshot(pool, slot, tmp_path / "snap", base_model_name="tiny-qwen3")
    ours = _logits(decoder, slot).detach()
    assert (ours - _logits(decoder, None).detach()).abs().max() > 1e-2  # the adapter matters

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "snap").eval()
    with torch.no_grad():
        theirs = peft_model(torch.tensor([TOKENS])).logits[0]

    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)
    assert peft_model.peft_config["default"].r == config.rank


def test_snapshot_keeps_the_weights_it_was_taken_with(decoder, pool, tmp_path):
    slot = pool.create(LoraConfig(rank=2, seed=3))
    _train_step(decoder, pool, slot, 0)
    taken = {name: t.detach().clone() for name, t in pool.get(slot).weights.items()}
    save_snapshot(pool, slot, tmp_path / "snap", base_model_name="tiny-qwen3")
    _train_step(decoder, pool, slot, 1)

    snapshot = load_snapshot(tmp_path / "snap")

    assert snapshot.rank == 2 and snapshot.scale == 16.0 and snapshot.base_model_name == "tiny-qwen3"
    assert set(snapshot.pairs) == set(pool.targets)
    for path, (A_RI, B_OR) in snapshot.pairs.items():
        assert torch.equal(A_RI, taken[f"{path}.lora_A.weight"]) and torch.equal(
            B_OR, taken[f"{path}.lora_B.weight"]
        )
    assert not torch.equal(snapshot.pairs["lm_head"][1], pool.get(slot).weights["lm_head.lora_B.weight"])


def test_snapshot_files_in_memory_are_the_bytes_save_snapshot_writes_and_nothing_is_written(pool, tmp_path):
    slot = pool.create(LoraConfig(rank=3, seed=4))
    randomize_lora_b(pool.get(slot).weights, 0.05, torch.Generator().manual_seed(1))
    files = slot_snapshot_files(pool, slot, base_model_name="tiny-qwen3")
    assert list(tmp_path.iterdir()) == []
    save_snapshot(pool, slot, tmp_path / "snap", base_model_name="tiny-qwen3")
    on_disk = {p.name: p.read_bytes() for p in (tmp_path / "snap").iterdir()}
    assert files == on_disk and sorted(files) == ["adapter_config.json", "adapter_model.safetensors"]


@pytest.mark.parametrize(
    ("remove", "message"),
    [("adapter_config.json", "it has no adapter_config.json"), ("adapter_model.safetensors", "is missing")],
)
def test_incomplete_snapshot_is_a_user_error(pool, tmp_path, remove, message):
    save_snapshot(pool, pool.create(LoraConfig(rank=2)), tmp_path / "snap", base_model_name="tiny-qwen3")
    (tmp_path / "snap" / remove).unlink()
    with pytest.raises(UserError, match=message):
        load_snapshot(tmp_path / "snap")
