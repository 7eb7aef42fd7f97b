"""Snapshots on the device: loaded from disk on first use, refcounted, LRU-evicted beyond a capacity.

A resident snapshot is attached to the decoder's LoRA targets like a training slot, under an id of its
own range (SNAPSHOT_ID_BASE + i), so prefill routes tokens to snapshots with the same `LoRARouting`
segments as training; and it is written into entry i of every `MultiLoRALinear`'s snapshot pool
(model/lora_pool.py, zero-padded to the pool's rank), by which the decode step routes each token
(`pool_index`) in ops that do not grow with the number of snapshots. The pools are allocated once, at
`capacity` entries of the server's largest LoRA rank: a fixed size and fixed addresses, so a captured
decode step stays valid as snapshots come and go. Under tensor parallelism each rank attaches its parts
of the snapshot's tensors, as it does a slot's. A snapshot in use by an unfinished request is never
evicted; an evicted one is read again from its directory when next asked for. Snapshots are immutable,
so a resident copy is reused as long as the directory's weights file is unchanged. Engine code: no HTTP,
no SQL; knows nothing of runs, tenants or requests.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.engine.snapshots import WEIGHTS_FILE, load_snapshot
from loraplex.errors import UserError
from loraplex.model.lora_pool import LoRAPool
from loraplex.model.multi_lora import LoRATarget, MultiLoRALinear

# Far above any training slot id, so snapshot and slot ids never meet on a layer.
SNAPSHOT_ID_BASE = 1 << 20


@dataclass
class _Resident:
    snapshot_id: int
    users: int  # unfinished requests holding it


class SnapshotCache:
    """Up to `capacity` snapshots of rank at most `max_rank` attached to `targets` (module path ->
    (layer, group)) at once; gives each `MultiLoRALinear` target a snapshot pool of that size."""

    def __init__(self, targets: dict[str, tuple[LoRATarget, str]], capacity: int, max_rank: int) -> None:
        if capacity < 1:
            raise ValueError(f"snapshot capacity must be at least 1, got {capacity}")
        self._targets = targets
        self._capacity = capacity
        self.max_rank = max_rank
        self._device = next(iter(targets.values()))[0].weight.device
        self._pools: dict[str, LoRAPool] = {}
        for path, (layer, _) in targets.items():
            if isinstance(layer, MultiLoRALinear):
                (_, columns), (rows, _) = layer.lora_shapes(max_rank)
                pool = LoRAPool(capacity, max_rank, columns, rows, self._device, layer.output_dtype)
                layer.snapshot_pool = self._pools[path] = pool
        # Least recently acquired first; keyed by (resolved directory, weights file mtime_ns and size).
        self._resident: OrderedDict[tuple[str, int, int], _Resident] = OrderedDict()
        self.loads = 0  # reads from disk so far

    def acquire(self, directory: Path) -> int | None:
        """The attached id of the snapshot at `directory`, loading it if needed (one more user).

        None when it is not resident and every resident snapshot is in use: try again after a release.
        Raises UserError when the directory is not a snapshot this model can serve.
        """
        key = _identity(directory)
        resident = self._resident.get(key)
        if resident is None:
            snapshot_id = self._free_id()
            if snapshot_id is None:
                return None
            self._attach(snapshot_id, directory)
            resident = self._resident[key] = _Resident(snapshot_id, users=0)
        self._resident.move_to_end(key)
        resident.users += 1
        return resident.snapshot_id

    def release(self, snapshot_id: int) -> None:
        """One user fewer; the snapshot stays attached until capacity is needed for another."""
        resident = next((r for r in self._resident.values() if r.snapshot_id == snapshot_id), None)
        if resident is None or resident.users < 1:
            raise ValueError(f"snapshot id {snapshot_id} released more often than acquired")
        resident.users -= 1

    def release_all(self) -> None:
        """Forget every use (after a failed sampler step); the snapshots stay attached until evicted."""
        for resident in self._resident.values():
            resident.users = 0

    @staticmethod
    def pool_index(snapshot_id: int | None) -> int:
        """The pools' entry of an attached snapshot; -1 (the zero entry) for the base model alone."""
        return -1 if snapshot_id is None else snapshot_id - SNAPSHOT_ID_BASE

    @property
    def pool_bytes(self) -> int:
        """What the snapshot pools hold on this rank's device."""
        return sum(pool.nbytes for pool in self._pools.values())

    @property
    def resident_ids(self) -> list[int]:
        """Ids attached now, least recently acquired first."""
        return [r.snapshot_id for r in self._resident.values()]

    def _free_id(self) -> int | None:
        """An unused id, evicting the least recently acquired unused snapshot if at capacity."""
        if len(self._resident) >= self._capacity:
            victim = next((key for key, r in self._resident.items() if r.users == 0), None)
            if victim is None:
                return None
            self._detach(self._resident.pop(victim).snapshot_id)
        taken = {r.snapshot_id for r in self._resident.values()}
        return next(SNAPSHOT_ID_BASE + i for i in range(self._capacity) if SNAPSHOT_ID_BASE + i not in taken)

    def _attach(self, snapshot_id: int, directory: Path) -> None:
        """Read the snapshot, check every pair against its layer, then attach them all."""
        snapshot = load_snapshot(directory)
        self.loads += 1
        where = f"snapshot {Path(directory).name}"
        unknown = sorted(set(snapshot.pairs) - set(self._targets))
        if unknown:
            raise UserError(f"{where} adapts modules this model lacks: {unknown}")
        if snapshot.rank > self.max_rank:
            raise UserError(
                f"{where} has rank {snapshot.rank}; this server samples ranks up to {self.max_rank}"
            )
        for path, (A_RI, B_OR) in snapshot.pairs.items():
            layer = self._targets[path][0]
            if A_RI.shape[1] != layer.in_features or B_OR.shape[0] != layer.out_features:
                raise UserError(
                    f"{where}: {path} has lora_A {tuple(A_RI.shape)} and lora_B {tuple(B_OR.shape)}; this "
                    f"model's layer needs (r, {layer.in_features}) and ({layer.out_features}, r)"
                )
        entry = self.pool_index(snapshot_id)
        for pool in self._pools.values():  # targets the snapshot leaves alone add 0
            pool.clear(entry)
        for path, (A_RI, B_OR) in snapshot.pairs.items():
            layer = self._targets[path][0]
            parts = layer.lora_sharding(snapshot.rank).of(A_RI, B_OR)  # the tensors themselves with one rank
            A_RI, B_OR = (t.to(self._device, torch.float32) for t in parts)
            layer.attach(snapshot_id, A_RI, B_OR, snapshot.scale)
            if path in self._pools:
                self._pools[path].load(entry, A_RI, B_OR, snapshot.scale)

    def _detach(self, snapshot_id: int) -> None:
        for layer, _ in self._targets.values():
            layer.detach(snapshot_id)


def _identity(directory: Path) -> tuple[str, int, int]:
    """Which snapshot a directory holds now: its resolved path and its weights file's mtime and size."""
    try:
        stat = (Path(directory) / WEIGHTS_FILE).stat()
    except OSError:
        raise UserError(f"snapshot {Path(directory).name} has no readable {WEIGHTS_FILE}") from None
    return str(Path(directory).resolve()), stat.st_mtime_ns, stat.st_size
