"""FakeEngine: an honest, tiny implementation of the Engine interface in numpy, for runtime and API tests.

The "model" is a bigram table: the logits for position t depend only on tokens[t], as
base[tokens[t]] + (A @ B)[tokens[t]], with a real LoRA pair per slot (A seeded, B zero) trained by
AdamW. What a request must satisfy and what each loss computes are the engine's own
(engine/validation.py, engine/losses.py: every loss of the registry, (N,) and (N, K) targets), never
restated here, so the fake accepts exactly what the real engine accepts. Deterministic, so two runs fed
the same requests give bit-identical results, and it learns, so loss curves mean something.
"""

from __future__ import annotations

import copy
import io
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from loraplex.engine.health import health_stats
from loraplex.engine.interface import Engine, EngineInfo, EngineUsage, ParameterBytes
from loraplex.engine.losses import compute_loss, pack_loss_inputs
from loraplex.engine.pending_step import PendingStep
from loraplex.engine.types import (
    AdamParams,
    LoraConfig,
    PassRequest,
    PassResult,
    PreparedStep,
    SampledSequence,
    SampleRequest,
    SampleResult,
)
from loraplex.engine.validation import validate_pass_request
from loraplex.errors import CapacityError, NotFoundError, ServerError, UserError

VOCAB = 64


@dataclass
class _Slot:
    config: LoraConfig
    A: np.ndarray  # (V, R)
    B: np.ndarray  # (R, V)
    grad: dict[str, np.ndarray] = field(default_factory=dict)
    moments: dict[str, np.ndarray] = field(default_factory=dict)  # m_A, v_A, m_B, v_B
    steps: int = 0

    def zero_grad(self) -> None:
        self.grad = {"A": np.zeros_like(self.A), "B": np.zeros_like(self.B)}


class FakeEngine(Engine):
    """A bigram LoRA model with the Engine's full contract (slots, passes, AdamW, checkpoints)."""

    def __init__(self, max_slots: int = 4, model_name: str = "fake/bigram") -> None:
        self.info = EngineInfo(
            model_name=model_name,
            arch="fake",
            tokenizer_dir="",
            vocab_size=VOCAB,
            max_context_length=4096,
            max_rank=64,
            base_model_digest="fake-base-0",
            device="cpu",
        )
        self.max_slots = max_slots
        self.base = np.random.default_rng(0).normal(0.0, 1.0, (VOCAB, VOCAB))
        self.slots: dict[int, _Slot] = {}
        self.offloaded: dict[int, _Slot] = {}  # host copies by key
        self._next_key = 0
        self.pass_log: list[list[int | None]] = []  # slots of every run_pass call, for scheduler tests
        self.optim_log: list[list[int]] = []
        self.sample_queue: list[tuple[str, SampleRequest]] = []
        self.holds_samples = False  # while True, sampling requests stay generating, as long ones do
        self._undo: dict[int, _Slot] | None = None
        self._step: PendingStep[tuple[dict[int, AdamParams], dict[int, float]]] = PendingStep()

    # --- slots
    def create_slot(self, config: LoraConfig) -> int:
        rng = np.random.default_rng(config.seed)
        A = rng.normal(0.0, 1.0 / np.sqrt(config.rank), (VOCAB, config.rank))
        return self._put(_Slot(config, A, np.zeros((config.rank, VOCAB))))

    def free_slot(self, slot: int) -> None:
        self._undo = None
        self._step.invalidate()
        del self.slots[slot]

    def _put(self, state: _Slot, slot: int | None = None) -> int:
        self._step.invalidate()
        if slot is None:
            if len(self.slots) >= self.max_slots:
                raise CapacityError(f"all {self.max_slots} slots are in use")
            slot = next(i for i in range(self.max_slots) if i not in self.slots)
        state.zero_grad()
        self.slots[slot] = state
        return slot

    # --- the host tier: the slot's arrays move aside as they are (the fake's "device" is host memory)
    def offload_slot(self, slot: int) -> int:
        state = self.slots[slot]
        self.free_slot(slot)
        key = self._next_key
        self._next_key += 1
        self.offloaded[key] = state
        return key

    def restore_slot(self, key: int) -> int:
        if len(self.slots) >= self.max_slots:
            raise CapacityError(f"all {self.max_slots} slots are in use")
        slot = next(i for i in range(self.max_slots) if i not in self.slots)
        self._step.invalidate()
        self.slots[slot] = self.offloaded.pop(key)
        return slot

    def spill_offloaded(self, key: int, directory: Path, owner_digest: str) -> int:
        s = self.offloaded[key]
        size = _write(directory, s, owner_digest, _state_arrays(s, with_gradients=True))
        del self.offloaded[key]
        return size

    def host_bytes_per_slot(self) -> int:
        return 8 * VOCAB * self.info.max_rank * 8  # A and B, their gradients and two moments, float64

    # --- passes
    def validate_pass_request(self, request: PassRequest) -> None:
        validate_pass_request(request, VOCAB, self.info.max_context_length)

    def run_pass(self, requests: list[PassRequest], keep_undo: bool = False) -> list[PassResult | UserError]:
        missing = sorted({r.slot for r in requests if r.slot is not None and r.slot not in self.slots})
        if missing:
            raise ServerError(f"a pass was built for adapter slots {missing}, which are not loaded")
        self.pass_log.append([r.slot for r in requests])
        self._step.invalidate()
        with self._transaction(keep_undo):
            out: list[PassResult | UserError] = []
            for request in requests:
                try:
                    out.append(self._run_one(request))
                except UserError as exc:  # refused before anything of it ran
                    out.append(exc)
        return out

    @contextmanager
    def _transaction(self, keep_undo: bool) -> Iterator[None]:
        """Transactional, as the Engine contract asks: every slot as before if the body raises."""
        self._undo = None
        before = copy.deepcopy(self.slots)
        try:
            yield
        except BaseException:
            self.slots = before
            raise
        if keep_undo:
            self._undo = before

    def undo_last(self) -> None:
        undo, self._undo = self._undo, None
        self._step.invalidate()
        if undo is not None:
            self.slots = undo

    def _run_one(self, request: PassRequest) -> PassResult:
        """The request's logprobs through the bigram table, its loss by the engine's own loss code (torch
        autograd gives dℓ/dlogprob), and the LoRA gradient from there by hand."""
        slot = self.slots[request.slot] if request.slot is not None else None
        config = validate_pass_request(request, VOCAB, self.info.max_context_length)
        delta = slot.A @ slot.B if slot is not None else 0.0
        logits = [(self.base + delta)[datum.tokens] for datum in request.datums]  # per datum (N, V)
        logits = [x - x.max(axis=1, keepdims=True) for x in logits]
        probs = [np.exp(x) / np.exp(x).sum(axis=1, keepdims=True) for x in logits]
        targets = [_targets(datum.loss_fn_inputs["target_tokens"]) for datum in request.datums]  # (N, K)
        lp_TK = np.concatenate(
            [np.log(np.take_along_axis(p, k, 1)) for p, k in zip(probs, targets, strict=True)]
        )
        is_wide = np.asarray(request.datums[0].loss_fn_inputs["target_tokens"]).ndim == 2
        lp = torch.tensor(lp_TK if is_wide else lp_TK[:, 0], dtype=torch.float32, requires_grad=True)
        batch = pack_loss_inputs(request.loss_fn, config, [d.loss_fn_inputs for d in request.datums])
        loss_T, metrics = compute_loss(request.loss_fn, lp, batch, config)
        if not request.forward_only and slot is not None:
            loss_T.sum().backward()
            grad_TK = lp.grad.numpy().reshape(len(lp_TK), -1).astype(np.float64)
            for datum, p, k, grad_NK in zip(
                request.datums, probs, targets, np.split(grad_TK, np.cumsum(batch.lengths)[:-1]), strict=True
            ):
                onehot = np.zeros((len(k), k.shape[1], VOCAB))
                np.put_along_axis(onehot, k[:, :, None], 1.0, axis=2)
                g_logits = (grad_NK[:, :, None] * (onehot - p[:, None, :])).sum(axis=1)  # (N, V): dℓ/dlogits
                g_delta = np.zeros((VOCAB, VOCAB))
                np.add.at(g_delta, datum.tokens, g_logits)
                slot.grad["A"] += g_delta @ slot.B.T
                slot.grad["B"] += slot.A.T @ g_delta
        outputs = [
            {"logprobs": lp_N.numpy(), "elementwise_loss": loss_N.numpy()}
            for lp_N, loss_N in zip(
                lp.detach().split(batch.lengths), loss_T.detach().split(batch.lengths), strict=True
            )
        ]
        health = health_stats(lp, batch, metrics)
        return PassResult(
            outputs,
            {key: float(value) for key, value in metrics.items()},
            {key: float(value) for key, value in health.items()},
        )

    # --- optimizer: prepare computes every norm and metric and changes nothing; apply updates in place
    def prepare_step(self, steps: dict[int, AdamParams]) -> PreparedStep:
        missing = sorted(slot for slot in steps if slot not in self.slots)
        if missing:
            raise NotFoundError(f"adapter slots {missing} are not in use")
        norms = {slot: _norm(self.slots[slot].grad) for slot in steps}
        metrics = {
            slot: {"grad_norm": norms[slot], "learning_rate": p.learning_rate} for slot, p in steps.items()
        }
        return self._step.hold(metrics, (dict(steps), norms))

    def apply_step(self, prepared: PreparedStep) -> None:
        steps, norms = self._step.claim(prepared, "applied")
        self._undo = None
        self.optim_log.append(sorted(steps))
        for slot_id, p in steps.items():
            self._update(self.slots[slot_id], p, norms[slot_id])

    def abort_step(self, prepared: PreparedStep) -> None:
        self._step.claim(prepared, "aborted")

    @staticmethod
    def _update(slot: _Slot, p: AdamParams, norm: float) -> None:
        scale = min(1.0, p.grad_clip_norm / (norm + 1e-6)) if p.grad_clip_norm > 0 else 1.0
        slot.steps += 1
        for name in ("A", "B"):
            g = slot.grad[name] * scale
            m = slot.moments.setdefault(f"m_{name}", np.zeros_like(g))
            v = slot.moments.setdefault(f"v_{name}", np.zeros_like(g))
            m[:] = p.beta1 * m + (1 - p.beta1) * g
            v[:] = p.beta2 * v + (1 - p.beta2) * g * g
            m_hat, v_hat = m / (1 - p.beta1**slot.steps), v / (1 - p.beta2**slot.steps)
            weights = getattr(slot, name)
            weights *= 1 - p.learning_rate * p.weight_decay
            weights -= p.learning_rate * m_hat / (np.sqrt(v_hat) + p.eps)
        slot.zero_grad()

    # --- checkpoints
    def save_state(self, slot: int, directory: Path, owner_digest: str, with_gradients: bool = False) -> int:
        s = self.slots[slot]
        return _write(directory, s, owner_digest, _state_arrays(s, with_gradients))

    def export_snapshot(self, checkpoint_dir: Path, snapshot_dir: Path, owner_digest: str) -> int:
        config, meta = self._read_meta(checkpoint_dir)
        if meta["owner"] and meta["owner"] != owner_digest:
            raise UserError("checkpoint belongs to another tenant")
        arrays = np.load(checkpoint_dir / "state.npz")
        return _write(
            snapshot_dir, _Slot(config, arrays["A"], arrays["B"]), "", {"A": arrays["A"], "B": arrays["B"]}
        )

    def save_snapshot(self, slot: int, directory: Path) -> int:
        s = self.slots[slot]
        return _write(directory, s, "", {"A": s.A, "B": s.B})

    def snapshot_files(self, slot: int) -> dict[str, bytes]:
        s = self.slots[slot]
        return _files(s, "", {"A": s.A, "B": s.B})

    def _read_meta(self, directory: Path) -> tuple[LoraConfig, dict]:
        try:
            meta = json.loads((directory / "meta.json").read_text())
            return LoraConfig(**meta["config"]), meta
        except (OSError, ValueError, KeyError) as exc:
            raise UserError(f"unreadable checkpoint at {directory.name}: {exc}") from exc

    def load_state(
        self, directory: Path, owner_digest: str, with_optimizer: bool, slot: int | None = None
    ) -> tuple[int, LoraConfig]:
        config, meta = self._read_meta(directory)
        if meta["owner"] and meta["owner"] != owner_digest:
            raise UserError("checkpoint belongs to another tenant")
        arrays = dict(np.load(directory / "state.npz"))
        state = _Slot(config, arrays.pop("A"), arrays.pop("B"))
        gradients = {k.removeprefix("grad_"): arrays.pop(k) for k in list(arrays) if k.startswith("grad_")}
        steps = int(arrays.pop("steps", 0))  # a sampler snapshot has none
        if with_optimizer:
            state.steps = steps
            state.moments = arrays
        slot = self._put(state, slot)
        if gradients:
            state.grad = gradients
        return slot, config

    # --- sampling: bigram draws from base (+ a snapshot's A @ B); every request finishes in one step
    # (none while holds_samples). Stop strings are accepted but never match (the fake has no tokenizer);
    # stop ids do stop.
    def validate_sample_request(self, request: SampleRequest) -> None:
        prompt = np.asarray(request.prompt)
        if prompt.ndim != 1 or len(prompt) == 0 or np.any((prompt < 0) | (prompt >= VOCAB)):
            raise UserError(f"prompt must be a non-empty list of token ids in [0, {VOCAB})")
        if request.num_samples < 1 or request.params.temperature < 0:
            raise UserError("num_samples must be ≥ 1 and temperature ≥ 0")
        if request.snapshot is not None and not (Path(request.snapshot) / "state.npz").is_file():
            raise NotFoundError(f"sampler weights {Path(request.snapshot).name} do not exist")

    def add_sample(self, key: str, request: SampleRequest) -> None:
        self.validate_sample_request(request)
        self.sample_queue.append((key, request))

    def step_sampler(
        self, max_prefill_tokens: int | None = None
    ) -> list[tuple[str, SampleResult | UserError]]:
        if self.holds_samples:
            time.sleep(0.001)  # a decode step's time: the engine loop steps again at once
            return []
        done: list[tuple[str, SampleResult | UserError]] = []
        while self.sample_queue:
            key, request = self.sample_queue.pop(0)
            done.append((key, self._sample(request)))
        return done

    def cancel_sample(self, key: str) -> bool:
        kept = [(queued, request) for queued, request in self.sample_queue if queued != key]
        is_queued = len(kept) < len(self.sample_queue)
        self.sample_queue = kept
        return is_queued

    def has_sampling_work(self) -> bool:
        return bool(self.sample_queue)

    def _sample(self, request: SampleRequest) -> SampleResult:
        table = self.base
        if request.snapshot is not None:
            arrays = np.load(Path(request.snapshot) / "state.npz")
            table = table + arrays["A"] @ arrays["B"]
        params = request.params
        stop_ids = {int(item) for item in params.stop or () if not isinstance(item, str)}
        sequences = []
        for index in range(request.num_samples):
            rng = np.random.default_rng([params.seed or 0, index])
            token, tokens, logprobs, reason = int(request.prompt[-1]), [], [], "length"
            for _ in range(params.max_tokens or 16):
                lp = _log_softmax(table[token] / (params.temperature or 1.0))
                token = int(lp.argmax()) if params.temperature == 0 else int(rng.choice(VOCAB, p=np.exp(lp)))
                tokens.append(token)
                logprobs.append(lp[token])
                if token in stop_ids:
                    reason = "stop"
                    break
            tokens_array, logprobs_array = np.array(tokens, np.int32), np.array(logprobs, np.float32)
            sequences.append(SampledSequence(tokens_array, logprobs_array, reason))
        prompt_logprobs = None
        if request.prompt_logprobs:
            lp = _log_softmax(table[request.prompt[:-1]])
            scored = lp[np.arange(len(lp)), request.prompt[1:]]
            prompt_logprobs = np.concatenate([[np.nan], scored]).astype(np.float32)
        return SampleResult(sequences, prompt_logprobs)

    # --- telemetry: one rank, its arrays' bytes by kind
    def usage(self) -> EngineUsage:
        slots = self.slots.values()
        adapter = sum(s.A.nbytes + s.B.nbytes for s in slots)
        optimizer = sum(a.nbytes for s in slots for a in (*s.grad.values(), *s.moments.values()))
        return EngineUsage(parameter_bytes=(ParameterBytes(self.base.nbytes, adapter, optimizer),))


def _norm(grad: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum((g**2).sum() for g in grad.values())))


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _state_arrays(s: _Slot, with_gradients: bool) -> dict[str, np.ndarray]:
    """What a checkpoint of the slot holds (a parked one: its gradients too)."""
    arrays = {"A": s.A, "B": s.B, **s.moments, "steps": np.array(s.steps)}
    if with_gradients:
        arrays |= {f"grad_{k}": g for k, g in s.grad.items()}
    return arrays


def _write(directory: Path, slot: _Slot, owner: str, arrays: dict[str, np.ndarray]) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in _files(slot, owner, arrays).items():
        (directory / name).write_bytes(data)
    return sum(f.stat().st_size for f in directory.iterdir())


def _files(slot: _Slot, owner: str, arrays: dict[str, np.ndarray]) -> dict[str, bytes]:
    """The fake's checkpoint and snapshot format, in memory: the arrays and a meta.json."""
    npz = io.BytesIO()
    np.savez(npz, **arrays)
    meta = json.dumps({"config": asdict(slot.config), "owner": owner}).encode()
    return {"state.npz": npz.getvalue(), "meta.json": meta}


def _targets(target_tokens: np.ndarray) -> np.ndarray:
    """A datum's target ids as (N, K) int64 (K = 1 for a (N,) target)."""
    targets = np.asarray(target_tokens, dtype=np.int64)
    return targets.reshape(len(targets), -1)
