"""The KV cache: prefill + one-token decode steps give the packed forward's logits at every position."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from loraplex.model.attention import decode_attention
from loraplex.model.decoder import Decoder
from loraplex.model.hf_checkpoint import load_decoder
from loraplex.model.kv_cache import DecodeStep, KVCache
from loraplex.model.multi_lora import LoRARouting
from loraplex.model.packing import PackedSequences
from tests.model.rounding import assert_within_rounding
from tests.model.test_decoder_parity import save_random_hf_model

SHAPES = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
SLOT = 3


@pytest.fixture(scope="module")
def decoders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Decoder, Decoder]:
    """A random Qwen3 (GQA, q/k norm) with one LoRA slot attached to every target, and its float64 twin
    (the same weights and slot)."""
    directory = tmp_path_factory.mktemp("qwen3")
    save_random_hf_model(Qwen3Config(**SHAPES), directory)
    pair = load_decoder(directory), load_decoder(directory, "cpu", torch.float64)
    generator = torch.Generator().manual_seed(1)
    for (layer, _), (twin_layer, _) in zip(*(d.lora_targets().values() for d in pair), strict=True):
        A = 0.1 * torch.randn(4, layer.in_features, generator=generator)
        B = 0.1 * torch.randn(layer.out_features, 4, generator=generator)
        layer.attach(SLOT, A, B, scale=2.0)
        twin_layer.attach(SLOT, A, B, scale=2.0)
    return pair


@pytest.fixture(scope="module")
def decoder(decoders: tuple[Decoder, Decoder]) -> Decoder:
    return decoders[0]


def full_logits(decoder: Decoder, tokens: torch.Tensor, slot: int | None) -> torch.Tensor:
    """Reference: the packed forward over the whole sequence alone."""
    routing = LoRARouting.from_sequences([len(tokens)], [slot])
    return decoder.logits(tokens, PackedSequences.from_lengths([len(tokens)]), routing)


@torch.no_grad()
def test_decode_logits_equal_the_packed_forward_at_every_position(decoders: tuple[Decoder, Decoder]) -> None:
    decoder, twin = decoders
    torch.manual_seed(0)
    lengths, prompt_lengths = (9, 14, 5, 11), (3, 6, 1, 6)  # two sequences share a prompt length
    slots = (None, SLOT, SLOT, None)
    sequences = [torch.randint(0, SHAPES["vocab_size"], (n,)) for n in lengths]
    expected = [full_logits(decoder, seq, slot) for seq, slot in zip(sequences, slots, strict=True)]
    exact = [full_logits(twin, seq, slot) for seq, slot in zip(sequences, slots, strict=True)]
    cache = KVCache(decoder.config, "cpu", torch.float32, max_tokens=1024)
    rows = [cache.allocate(n) for n in lengths]

    step = cache.prefill(rows, prompt_lengths)
    prompts = torch.cat([seq[:p] for seq, p in zip(sequences, prompt_lengths, strict=True)])
    routing = LoRARouting.from_sequences(prompt_lengths, slots)
    hidden = decoder.forward_cached(prompts, step, routing)
    for i, logits in enumerate(decoder.lm_head(hidden, routing).split(prompt_lengths)):
        p = prompt_lengths[i]
        assert_within_rounding(logits, expected[i][:p], exact[i][:p], f"prefill {i}")

    positions = list(prompt_lengths)
    while active := [i for i in range(len(lengths)) if positions[i] < lengths[i]]:
        # Batch order by slot, as the sampler orders it; not the cache-row order.
        active.sort(key=lambda i: -1 if slots[i] is None else slots[i])
        step = cache.decode([rows[i] for i in active])
        tokens = torch.stack([sequences[i][positions[i]] for i in active])
        routing = LoRARouting.from_sequences([1] * len(active), [slots[i] for i in active])
        logits = decoder.lm_head(decoder.forward_cached(tokens, step, routing), routing)
        for b, i in enumerate(active):
            p = positions[i]
            assert_within_rounding(logits[b], expected[i][p], exact[i][p], f"sequence {i} position {p}")
            positions[i] += 1
    assert [cache.length(row) for row in rows] == list(lengths)


@torch.no_grad()
def test_a_copied_prefix_decodes_like_its_source_and_growth_keeps_the_pool(
    decoders: tuple[Decoder, Decoder],
) -> None:
    decoder, twin = decoders
    torch.manual_seed(1)
    sequence = torch.randint(0, SHAPES["vocab_size"], (8,))
    expected, exact = full_logits(decoder, sequence, None), full_logits(twin, sequence, None)
    cache = KVCache(decoder.config, "cpu", torch.float32, max_tokens=1024)
    source = cache.allocate(8)
    pool = cache.keys[0]
    decoder.forward_cached(sequence[:5], cache.prefill([source], [5]))
    copies = [cache.allocate(8) for _ in range(12)]
    for row in copies:
        cache.copy_prefix(source, row)
    cache.allocate(300)  # a long row, while rows hold tokens
    assert cache.keys[0] is pool and cache.stored_bytes == 65 * cache.block_bytes  # 1024 / 16, and scratch

    rows = [copies[-1], source, copies[0]]
    for position in range(5, 8):
        step = cache.decode(rows)
        logits = decoder.lm_head(decoder.forward_cached(sequence[position].repeat(3), step))
        for b in range(3):
            assert_within_rounding(logits[b], expected[position], exact[position], f"row {b} at {position}")
    assert cache.keys[0] is pool


@torch.no_grad()
def test_rows_grow_a_block_at_a_time_independently_and_a_freed_rows_blocks_serve_the_next(
    decoders: tuple[Decoder, Decoder],
) -> None:
    """A row takes a block as its tokens cross a block boundary, whatever another row holds; a finished
    row's blocks go back, and a new row over them (their old keys still there) decodes like a fresh one."""
    decoder, twin = decoders
    torch.manual_seed(3)
    cache = KVCache(decoder.config, "cpu", torch.float32, max_tokens=64, block_tokens=4)  # 16 blocks
    long_row, short_row = cache.allocate(40), cache.allocate(6)
    assert cache.num_free_blocks == 16 and cache.num_reserved_blocks == 10 + 2
    long_tokens = torch.randint(0, SHAPES["vocab_size"], (33,))
    decoder.forward_cached(long_tokens, cache.prefill([long_row], [33]))
    assert cache.num_free_blocks == 16 - 9  # ceil(33 / 4)
    decoder.forward_cached(torch.tensor([1, 2, 3]), cache.prefill([short_row], [3]))
    assert cache.num_free_blocks == 16 - 9 - 1
    # The short row reaches 4, 5, 6 tokens (a second block at 5); the long row 34..36, within its 9th.
    for free_blocks in (6, 5, 5):
        cache.decode([short_row, long_row])
        assert cache.num_free_blocks == free_blocks
    cache.free(long_row)
    assert cache.num_free_blocks == 16 - 2 and cache.num_reserved_blocks == 2

    sequence = torch.randint(0, SHAPES["vocab_size"], (12,))
    expected, exact = full_logits(decoder, sequence, SLOT), full_logits(twin, sequence, SLOT)
    row = cache.allocate(12)
    routing = LoRARouting.from_sequences([9], [SLOT])
    decoder.forward_cached(sequence[:9], cache.prefill([row], [9]), routing)
    for position in range(9, 12):
        routing = LoRARouting.from_sequences([1], [SLOT])
        logits = decoder.lm_head(
            decoder.forward_cached(sequence[position : position + 1], cache.decode([row]), routing), routing
        )
        assert_within_rounding(logits[0], expected[position], exact[position], f"reused blocks at {position}")


def _prefilled(
    decoder: Decoder, sequences: list[torch.Tensor], block_tokens: int = 4
) -> tuple[KVCache, list[int]]:
    """A cache of 16 blocks (the scratch block after them) holding every sequence but its last token,
    routed to SLOT."""
    cache = KVCache(decoder.config, "cpu", torch.float32, max_tokens=64, block_tokens=block_tokens)
    rows = [cache.allocate(len(sequence)) for sequence in sequences]
    lengths = [len(sequence) - 1 for sequence in sequences]
    routing = LoRARouting.from_sequences(lengths, [SLOT] * len(lengths))
    decoder.forward_cached(torch.cat([s[:-1] for s in sequences]), cache.prefill(rows, lengths), routing)
    return cache, rows


def _step_logits(decoder: Decoder, tokens: torch.Tensor, step: DecodeStep) -> torch.Tensor:
    """A decode step's logits with every row routed to SLOT (padding rows too: their logits are
    discarded; the sampler routes them to the snapshot pools' zero entry)."""
    routing = LoRARouting.from_sequences([1] * len(tokens), [SLOT] * len(tokens))
    return decoder.lm_head(decoder.forward_cached(tokens, step, routing), routing)


@torch.no_grad()
def test_a_padded_decode_step_gives_the_live_rows_logits_and_writes_only_the_scratch_block(
    decoders: tuple[Decoder, Decoder],
) -> None:
    """Padding rows (token 0 at position 0) write and attend to their own scratch slot only: every live
    row's blocks hold what the unpadded step writes, and its logits are the reference's. Equal within
    rounding, not bit for bit: a CPU GEMM rounds a row differently with another row count (MKL's kernels
    for M mod 4 rows), and the softmax sums another number of masked positions."""
    decoder, twin = decoders
    torch.manual_seed(4)
    sequences = [torch.randint(0, SHAPES["vocab_size"], (n,)) for n in (7, 3, 12)]
    expected = [full_logits(decoder, sequence, SLOT)[-1] for sequence in sequences]
    exact = [full_logits(twin, sequence, SLOT)[-1] for sequence in sequences]
    cache, rows = _prefilled(decoder, sequences)
    assert cache.num_blocks == 16 and cache.stored_bytes == 17 * cache.block_bytes
    step = cache.decode(rows, num_rows=8, span=32)
    assert step.slots_BL.shape == step.is_visible_BL.shape == (8, 32)
    scratch = range(16 * 4, 17 * 4)
    assert step.slots_B[3:].tolist() == [64, 65, 66, 67, 64]  # five padding rows over the 4 scratch slots
    assert step.positions_T[3:].tolist() == [0] * 5
    for b in range(3, 8):
        assert step.slots_BL[b][step.is_visible_BL[b]].tolist() == [step.slots_B[b].item()]
    assert all(slot not in scratch for slot in step.slots_B[:3].tolist())
    assert [int(step.is_visible_BL[b].sum()) for b in range(3)] == [len(s) for s in sequences]
    keys_before = cache.keys[0].clone()
    tokens = torch.cat([torch.stack([s[-1] for s in sequences]), torch.zeros(5, dtype=torch.int64)])
    logits = _step_logits(decoder, tokens, step)
    for b in range(3):
        assert_within_rounding(logits[b], expected[b], exact[b], f"live row {b}")
    # Bits, not values: an unwritten slot may hold NaN, which equals nothing.
    written = cache.keys[0].flatten(0, 1).view(torch.int32) != keys_before.flatten(0, 1).view(torch.int32)
    changed = set(written.any(-1).any(-1).nonzero().flatten().tolist())
    assert changed <= set(step.slots_B.tolist())  # the live rows' new tokens and the scratch slots
    assert cache.num_free_blocks == 16 - sum(-(-len(s) // 4) for s in sequences)  # no row holds scratch


@torch.no_grad()
def test_in_a_padded_step_a_rows_logits_do_not_depend_on_the_rows_beside_it(decoder: Decoder) -> None:
    """Bit for bit: three rows in a bucket of 8 rows and 32 positions beside five padding rows, and
    beside five live rows of other lengths; the padding and the other rows add nothing to a row."""
    torch.manual_seed(5)
    sequences = [torch.randint(0, SHAPES["vocab_size"], (n,)) for n in (7, 3, 12, 5, 9, 2, 8, 4)]
    alone_cache, alone_rows = _prefilled(decoder, sequences[:3])
    beside_cache, beside_rows = _prefilled(decoder, sequences)
    last = torch.stack([s[-1] for s in sequences])
    padded = torch.cat([last[:3], torch.zeros(5, dtype=torch.int64)])
    alone = _step_logits(decoder, padded, alone_cache.decode(alone_rows, num_rows=8, span=32))
    beside = _step_logits(decoder, last, beside_cache.decode(beside_rows, num_rows=8, span=32))
    assert torch.equal(alone[:3], beside[:3])


def test_a_padded_step_must_hold_its_live_rows_and_their_span(decoder: Decoder) -> None:
    cache = KVCache(decoder.config, "cpu", torch.float32, max_tokens=64)
    rows = [cache.allocate(20), cache.allocate(20)]
    with torch.no_grad():
        decoder.forward_cached(torch.arange(17), cache.prefill(rows, [10, 7]))
    with pytest.raises(ValueError, match="does not fit 1 rows of span 16"):
        cache.decode(rows, num_rows=1, span=16)
    with pytest.raises(ValueError, match="up to position 10 does not fit 2 rows of span 10"):
        cache.decode(rows, num_rows=2, span=10)


def test_a_row_larger_than_the_pool_is_refused_with_the_numbers(decoder: Decoder) -> None:
    cache = KVCache(decoder.config, "cpu", torch.float32, max_tokens=100)  # 7 blocks of 16
    with pytest.raises(ValueError) as refused:
        cache.allocate(10**15)
    assert str(refused.value) == (
        "a cache row of 1000000000000000 tokens needs 62500000000000 blocks of 16 tokens; "
        "the pool has 7 of its 7 blocks unreserved"
    )
    assert cache.stored_bytes == 0  # nothing was allocated for it
    cache.allocate(60)
    with pytest.raises(ValueError, match="needs 4 blocks of 16 tokens; the pool has 3 of its 7 blocks"):
        cache.allocate(49)
    cache.allocate(48)
    assert cache.num_reserved_blocks == 7


def test_rows_are_reused_lowest_first_and_storage_is_dropped_when_none_is_live(decoder: Decoder) -> None:
    cache = KVCache(decoder.config, "cpu", torch.float32, max_tokens=1024)
    rows = [cache.allocate(10) for _ in range(3)]
    assert rows == [0, 1, 2]
    cache.free(1)
    assert cache.allocate(10) == 1
    for row in rows:
        cache.free(row)
    assert cache.num_live_rows == 0 and cache.stored_bytes == 0 and cache.keys == []
    with pytest.raises(ValueError, match="row 0 is not live"):
        cache.decode([0])


def test_a_row_refuses_tokens_beyond_its_allocation(decoder: Decoder) -> None:
    cache = KVCache(decoder.config, "cpu", torch.float32, max_tokens=1024)
    row = cache.allocate(2)
    with torch.no_grad():
        decoder.forward_cached(torch.tensor([1, 2]), cache.prefill([row], [2]))
    with pytest.raises(ValueError, match="allocated for 2 tokens"):
        cache.decode([row])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_decode_attention_equals_softmax_over_each_rows_prefix(device: str) -> None:
    """Reference: explicit softmax(q kᵀ/√H) v per sequence over its visible slots, kv heads repeated."""
    torch.manual_seed(2)
    P, S, N, K, H = 6, 4, 4, 2, 8
    k_pool, v_pool = torch.randn(P, S, K, H), torch.randn(P, S, K, H)
    tables, lengths = [[3, 0], [5], [1, 4, 2]], [7, 1, 12]  # blocks in any order, a one-token row
    span = max(lengths)
    slots = torch.zeros(len(lengths), span, dtype=torch.int64)
    visible = torch.zeros(len(lengths), span, dtype=torch.bool)
    for b, (table, length) in enumerate(zip(tables, lengths, strict=True)):
        row_slots = (torch.tensor(table)[:, None] * S + torch.arange(S)).flatten()[:length]
        slots[b, :length], visible[b, :length] = row_slots, True
    q = torch.randn(len(lengths), N, H)

    def reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        out = []
        for b, length in enumerate(lengths):
            k = k_pool.flatten(0, 1)[slots[b, :length]].repeat_interleave(N // K, dim=1)  # (length, N, H)
            v = v_pool.flatten(0, 1)[slots[b, :length]].repeat_interleave(N // K, dim=1)
            weights = (torch.einsum("nh,lnh->nl", q[b], k) / H**0.5).softmax(-1)
            out.append(torch.einsum("nl,lnh->nh", weights, v))
        return torch.stack(out)

    on_device = (x.to(device) for x in (q, k_pool, v_pool, slots, visible))
    out = decode_attention(*on_device)
    exact = reference(q.double(), k_pool.double(), v_pool.double())
    assert_within_rounding(out, reference(q, k_pool, v_pool), exact, "attention")
