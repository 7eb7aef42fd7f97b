"""The snapshot pool's per-token LoRA delta: equal to the per-token loop for mixed ranks and base-only
tokens; base-only tokens add exactly nothing; loading an entry leaves no trace of what it held."""

from __future__ import annotations

import pytest
import torch

from loraplex.model.lora_pool import LoRAPool, add_pooled_lora_delta_
from loraplex.model.multi_lora import LoRARouting, add_lora_delta_reference
from tests.model.rounding import assert_within_rounding
from tests.model.test_multi_lora import LAYOUTS, delta_exact, random_slots

IN, OUT = 12, 20


def pool_of(slots: dict, entries: int, rank: int) -> tuple[LoRAPool, dict[int, int]]:
    """A pool holding every slot (in slot order) and each slot's entry."""
    pool = LoRAPool(entries, rank, IN, OUT, torch.device("cpu"), torch.float32)
    entry_of = {slot: entry for entry, slot in enumerate(sorted(slots))}
    for slot, weights in slots.items():
        pool.load(entry_of[slot], weights.A_RI, weights.B_OR, weights.scale)
    return pool, entry_of


@pytest.mark.parametrize("rank", [1, 8, 16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pooled_delta_equals_per_token_loop(rank: int, layout: str) -> None:
    torch.manual_seed(rank)
    slots = random_slots({0: rank, 1: max(1, rank // 2), 2: rank + 3}, IN, OUT)
    pool, entry_of = pool_of(slots, entries=4, rank=rank + 3)
    routing = LoRARouting(tuple(LAYOUTS[layout]))
    # An unattached slot routes like the base model: -1.
    index_T = torch.tensor(
        [entry_of.get(s.slot, -1) for s in routing.segments for _ in range(s.start, s.end)]  # type: ignore[arg-type]
    )
    x, y = torch.randn(10, IN), torch.randn(10, OUT)
    expected = add_lora_delta_reference(y, x, routing, slots)
    # Each delta sums the same products (and the padding's exact zeros) in another order than the loop.
    exact = delta_exact(y, x, routing, slots)
    got = add_pooled_lora_delta_(y.clone(), x, index_T, pool)
    assert_within_rounding(got, expected, exact, "pooled delta")


def test_base_only_tokens_add_exactly_zero() -> None:
    torch.manual_seed(0)
    pool, _ = pool_of(random_slots({0: 2}, IN, OUT), entries=3, rank=8)
    x, y = torch.randn(4, IN), torch.randn(4, OUT)
    out = add_pooled_lora_delta_(y.clone(), x, torch.tensor([-1, 0, -1, 0]), pool)
    assert torch.equal(out[[0, 2]], y[[0, 2]])  # the zero entry: bit for bit the base output
    assert not torch.equal(out[[1, 3]], y[[1, 3]])


def test_loading_an_entry_clears_what_it_held() -> None:
    torch.manual_seed(0)
    wide, narrow = random_slots({0: 6}, IN, OUT)[0], random_slots({0: 2}, IN, OUT)[0]
    pool = LoRAPool(1, 6, IN, OUT, torch.device("cpu"), torch.float32)
    pool.load(0, wide.A_RI, wide.B_OR, wide.scale)
    pool.load(0, narrow.A_RI, narrow.B_OR, narrow.scale)
    assert not pool.A_PRI[0, 2:].any() and not pool.B_POR[0, :, 2:].any()
    pool.clear(0)
    assert not pool.A_PRI.any() and not pool.B_POR.any() and not pool.scale_P.any()
    with pytest.raises(ValueError, match="do not fit"):
        pool.load(0, torch.zeros(7, IN), torch.zeros(OUT, 7), 1.0)
