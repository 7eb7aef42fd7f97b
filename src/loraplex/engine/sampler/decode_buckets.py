"""The fixed shapes a decode step is padded to: its rows to a batch bucket, its span to a span bucket.

Why: a step whose tensors take their shapes from the live batch has a new shape nearly every step (a row
joins or stops, every row's context grows by one), so nothing shaped by it can be reused; padded to a few
buckets, a step's ops and shapes depend on the bucket alone, which is what one captured CUDA graph per
bucket needs (decode_graphs.py) and what makes a row's logits independent of how many rows share its
bucket.

What padding costs: padding rows (token 0 at position 0, the pools' zero adapter entry, attending only to
the KV cache's scratch block) go through every matmul as the live rows do; a decode step reads every
weight once whatever its rows, so up to 7 padding rows add little until the batch nears the compute bound.
The padded span adds masked positions to every row's key/value gather and attention, and at decode
lengths those reads are the step's largest (Qwen3-4B, 128 rows at 1k context: ~19 GB of keys and values
gathered, against 8 GB of weights), so spans step finely: four steps per doubling, never a quarter more
blocks than the live span fills (1088 positions pad to 1280; in steps of whole doublings they padded to
2048, 1.9x the reads).

Buckets: rows 1, 2, 4, 8, then multiples of 8 (at most 7 padding rows, and 8-row multiples suit tensor
cores), the last one `max_batch` itself; spans whole KV blocks up to 8 blocks (16, 32, ..., 128
positions), then in quarter doublings (160, 192, 224, 256, 320, ...), the last one the longest context
rounded up to a block. With --max-sampling-batch 128 and a 32k context that is 19 x 40 buckets, of which a
server meets the few its traffic has (a request's rows cross a bucket every quarter doubling of context).
"""

from __future__ import annotations

from loraplex.model.kv_cache import BLOCK_TOKENS

# Below this many rows, buckets double; from it, they step by it.
_ROW_STEP = 8
# Span buckets per doubling of the span, from 2 x this many blocks on.
_SPAN_STEPS = 4


def batch_bucket(num_rows: int, max_batch: int) -> int:
    """Rows a decode step of `num_rows` live rows is padded to: 1, 2, 4, 8, then the next multiple of 8,
    never past `max_batch` (a step holds at most that many live rows)."""
    if not 0 < num_rows <= max_batch:
        raise ValueError(f"a decode step of {num_rows} rows, with at most {max_batch} a step")
    bucket = 1
    while bucket < min(num_rows, _ROW_STEP):
        bucket *= 2
    if num_rows > _ROW_STEP:
        bucket = -(-num_rows // _ROW_STEP) * _ROW_STEP
    return min(bucket, max_batch)


def span_bucket(span: int, max_context_length: int) -> int:
    """Positions a decode step whose longest row attends to `span` of them is padded to: its KV blocks
    rounded up to a multiple of the largest power of two at most a quarter of them (whole blocks up to 8,
    then four steps per doubling), never past the longest context rounded up to a block (no row holds
    more)."""
    longest = -(-max_context_length // BLOCK_TOKENS) * BLOCK_TOKENS
    if not 0 < span <= longest:
        raise ValueError(f"a decode step spanning {span} positions, with contexts of at most {longest}")
    blocks = -(-span // BLOCK_TOKENS)
    step = 1 << max(0, (blocks // _SPAN_STEPS).bit_length() - 1)  # largest power of two ≤ blocks / 4
    return min(-(-blocks // step) * step * BLOCK_TOKENS, longest)
