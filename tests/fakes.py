"""FakeEngine: an honest, tiny implementation of the Engine interface in numpy, for runtime and API tests.

The "model" is a bigram table: the logits for position t depend only on tokens[t], as
base[tokens[t]] + (A @ B)[tokens[t]], with a real LoRA pair per slot (A seeded, B zero) trained by
AdamW. Losses: cross_entropy, importance_sampling, ppo (docs/LOSSES.md). Deterministic, so two runs fed
the same requests give bit-identical results, and it learns, so loss curves mean something.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from loraplex.engine.interface import Engine, EngineInfo
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
from loraplex.errors import CapacityError, NotFoundError, ServerError, UserError

VOCAB = 64
RL_INPUTS = ("target_tokens", "logprobs", "advantages")
LOSS_INPUTS = {"cross_entropy": ("target_tokens",), "importance_sampling": RL_INPUTS, "ppo": RL_INPUTS}
LOSS_CONFIG = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
}


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

    # --- passes
    def validate_pass_request(self, request: PassRequest) -> None:
        if request.loss_fn not in LOSS_INPUTS:
            raise UserError(f"unknown loss_fn {request.loss_fn!r}; supported: {sorted(LOSS_INPUTS)}")
        allowed = LOSS_CONFIG[request.loss_fn]
        for key, value in request.loss_fn_config.items():
            if key not in allowed:
                raise UserError(
                    f"unknown loss_fn_config key {key!r} for {request.loss_fn}; allowed: {sorted(allowed)}"
                )
            if not np.isfinite(value):
                raise UserError(f"loss_fn_config[{key!r}] must be finite")
        for i, datum in enumerate(request.datums):
            n = len(datum.tokens)
            for key in LOSS_INPUTS[request.loss_fn]:
                if key not in datum.loss_fn_inputs:
                    raise UserError(f"datum {i}: {request.loss_fn} needs loss_fn_inputs[{key!r}]")
            if np.any((datum.tokens < 0) | (datum.tokens >= VOCAB)):
                raise UserError(f"datum {i}: token ids must be in [0, {VOCAB})")
            for key, value in datum.loss_fn_inputs.items():
                if value.shape[:1] != (n,):
                    raise UserError(
                        f"datum {i}: loss_fn_inputs[{key!r}] has length {value.shape[0]}, expected {n}"
                    )
                if key == "target_tokens" and np.any((value < 0) | (value >= VOCAB)):
                    raise UserError(f"datum {i}: target_tokens must be in [0, {VOCAB})")
                if value.dtype.kind == "f" and not np.all(np.isfinite(value)):
                    raise UserError(f"datum {i}: loss_fn_inputs[{key!r}] has non-finite values")

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
                    self.validate_pass_request(request)
                    out.append(self._run_one(request))
                except UserError as exc:
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
        slot = self.slots[request.slot] if request.slot is not None else None
        config = {**LOSS_CONFIG[request.loss_fn], **request.loss_fn_config}
        outputs, total = [], 0.0
        for datum in request.datums:
            delta = slot.A @ slot.B if slot is not None else 0.0
            logits = (self.base + delta)[datum.tokens]  # (N, V)
            logits = logits - logits.max(axis=1, keepdims=True)
            probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
            targets = datum.loss_fn_inputs["target_tokens"].astype(np.int64)
            lp = np.log(probs[np.arange(len(targets)), targets])
            loss, grad_lp = _loss(request.loss_fn, lp, datum.loss_fn_inputs, config)
            total += float(loss.sum())
            outputs.append({"logprobs": lp.astype(np.float32), "elementwise_loss": loss.astype(np.float32)})
            if not request.forward_only and slot is not None:
                onehot = np.zeros_like(probs)
                onehot[np.arange(len(targets)), targets] = 1.0
                g_logits = grad_lp[:, None] * (onehot - probs)  # (N, V): dL/dlogits
                g_delta = np.zeros((VOCAB, VOCAB))
                np.add.at(g_delta, datum.tokens, g_logits)
                slot.grad["A"] += g_delta @ slot.B.T
                slot.grad["B"] += slot.A.T @ g_delta
        return PassResult(outputs=outputs, metrics={"loss:sum": total})

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
        arrays = {"A": s.A, "B": s.B, **s.moments, "steps": np.array(s.steps)}
        if with_gradients:
            arrays |= {f"grad_{k}": g for k, g in s.grad.items()}
        return _write(directory, s, owner_digest, arrays)

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


def _norm(grad: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum((g**2).sum() for g in grad.values())))


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _write(directory: Path, slot: _Slot, owner: str, arrays: dict[str, np.ndarray]) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    np.savez(directory / "state.npz", **arrays)
    (directory / "meta.json").write_text(json.dumps({"config": asdict(slot.config), "owner": owner}))
    return sum(f.stat().st_size for f in directory.iterdir())


def _loss(
    name: str, lp: np.ndarray, inputs: dict[str, np.ndarray], config: dict[str, float]
) -> tuple[np.ndarray, np.ndarray]:
    """Per-token loss and its gradient with respect to lp (docs/LOSSES.md)."""
    if name == "cross_entropy":
        w = inputs.get("weights", np.ones_like(lp)).astype(np.float64)
        return -w * lp, -w
    q, adv = inputs["logprobs"].astype(np.float64), inputs["advantages"].astype(np.float64)
    mask = (adv != 0) | (q != 0)
    ratio = np.where(mask, np.exp(np.where(mask, lp - q, 0.0)), 0.0)
    if name == "importance_sampling":
        return -ratio * adv, -ratio * adv
    lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
    unclipped, clipped = ratio * adv, np.clip(ratio, lo, hi) * adv
    takes_unclipped = unclipped <= clipped
    return -np.minimum(unclipped, clipped), np.where(takes_unclipped & mask, -ratio * adv, 0.0)
