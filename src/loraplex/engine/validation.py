"""What a forward / forward_backward request must satisfy before any compute: at least one datum, each
datum's tokens within the model's vocabulary and context, and its loss inputs as its loss reads them
(losses.py). Numpy only. The one set of rules every engine applies, the test suite's fake engine
included, so no engine accepts what another refuses. No HTTP, no SQL.
"""

from __future__ import annotations

import numpy as np

from loraplex.engine.losses import validate_loss_request
from loraplex.engine.types import PassRequest
from loraplex.errors import UserError


def validate_pass_request(request: PassRequest, vocab_size: int, max_context_length: int) -> dict[str, float]:
    """Raise UserError naming datum index, key and expectation; return the request's resolved loss config."""
    if not request.datums:
        raise UserError("a forward/forward_backward request needs at least one datum")
    for index, datum in enumerate(request.datums):
        _check_tokens(index, datum.tokens, vocab_size, max_context_length)
    return validate_loss_request(request, vocab_size)


def _check_tokens(index: int, tokens: np.ndarray, vocab_size: int, max_length: int) -> None:
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise UserError(f"datum {index}: model_input must be a 1-D list of integer token ids")
    if not 1 <= len(tokens) <= max_length:
        raise UserError(
            f"datum {index}: model_input has {len(tokens)} tokens; expected 1..{max_length} "
            "(the model's context length)"
        )
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise UserError(
            f"datum {index}: model_input token id {bad} is outside the vocabulary [0, {vocab_size})"
        )
