"""Smoothing of a chart's curve: TensorBoard's exponential moving average, debiased. No tensors, no SQL.

An EMA started at 0 is pulled toward 0 for its first points; TensorBoard divides the n-th average by
1 - weight**n, the total weight its terms carry, so the first smoothed point is the first value and a
constant series stays constant. The console does the same, so its curves read like TensorBoard's.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_WEIGHT = 1.0  # excluded: a weight of 1 would never move from the first value


def smooth(values: Sequence[float], weight: float) -> list[float]:
    """The debiased EMA of `values` with `weight` in [0, 1) given to the past; weight 0 is the values.

    Semantics: ema_n = weight * ema_(n-1) + (1 - weight) * value_n from ema_0 = 0; smoothed_n =
    ema_n / (1 - weight**n).
    """
    if not 0.0 <= weight < MAX_WEIGHT:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    ema, smoothed = 0.0, []
    for n, value in enumerate(values, start=1):
        ema = weight * ema + (1.0 - weight) * value
        smoothed.append(ema / (1.0 - weight**n))
    return smoothed
