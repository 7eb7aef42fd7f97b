"""The axes of the console's charts: which values a metric can take (its domain, read from its name), a y
range padded around the data that padding never pushes outside that domain, and round tick values, on a
linear or a log scale. No tensors, no SQL.

The domain only stops padding: a value outside it (a KL estimate that came out negative) still widens
the axis, so a chart never hides a point. docs/METRICS.md lists the table below.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Domain:
    """The values a metric can take: [low, high], None for no bound."""

    low: float | None
    high: float | None


UNBOUNDED = Domain(None, None)
NON_NEGATIVE = Domain(0.0, None)
FRACTION = Domain(0.0, 1.0)

# A metric's stem: its name after the last "/" (rl/clipped_tokens -> clipped_tokens), without its
# ":reduction" (loss:sum -> loss), split into words at "_". The first rule that matches gives the domain;
# a name no rule matches (advantage_mean, reward) is unbounded.
_FIRST_WORD, _LAST_WORD, _ANY_WORD = "first", "last", "any"
DOMAIN_RULES: tuple[tuple[str, frozenset[str], Domain], ...] = (
    (_LAST_WORD, frozenset({"fraction", "frac"}), FRACTION),
    (
        _ANY_WORD,
        frozenset(
            {"tokens", "length", "lengths", "count", "norm", "entropy", "std", "abs", "sequences", "reason"}
        ),
        NON_NEGATIVE,
    ),
    (_FIRST_WORD, frozenset({"kl", "num", "n", "learning", "lr", "loss", "nll"}), NON_NEGATIVE),
)
# Tick counts aimed at: round step sizes give between about half and twice this many.
Y_TICKS, X_TICKS = 5, 6
_PAD = 0.05  # of the data's span, each way


def metric_domain(name: str) -> Domain:
    """The domain of metric `name` by the rules of DOMAIN_RULES."""
    words = name.rsplit("/", 1)[-1].split(":", 1)[0].lower().split("_")
    for where, names, domain in DOMAIN_RULES:
        picked = {_FIRST_WORD: words[:1], _LAST_WORD: words[-1:], _ANY_WORD: words}[where]
        if names.intersection(picked):
            return domain
    return UNBOUNDED


@dataclass(frozen=True)
class Axis:
    """A chart axis from `low` to `high`, its tick values, linear or log (base 10)."""

    low: float
    high: float
    ticks: tuple[float, ...]
    is_log: bool = False

    def position(self, value: float) -> float:
        """Where `value` lies along the axis: 0 at low, 1 at high."""
        if self.is_log:
            return (math.log10(value) - math.log10(self.low)) / (math.log10(self.high) - math.log10(self.low))
        return (value - self.low) / (self.high - self.low)


def y_axis(values: Sequence[float], domain: Domain, is_log: bool = False) -> Axis:
    """The y axis of `values` (all > 0 when `is_log`): padded, rounded out to tick steps, within `domain`
    where the data is."""
    if not values:
        return Axis(0.0, 1.0, _ticks(0.0, 1.0, 0.25))
    low, high = min(values), max(values)
    if is_log:
        return _log_axis(low, high, domain)
    pad = (high - low) * _PAD if high > low else abs(low) / 2 or 1.0
    step = nice_step((high - low) + 2 * pad, Y_TICKS - 1)
    bottom, top = _tidy(math.floor((low - pad) / step) * step), _tidy(math.ceil((high + pad) / step) * step)
    if domain.low is not None and low >= domain.low:
        bottom = max(bottom, domain.low)
    if domain.high is not None and high <= domain.high:
        top = min(top, domain.high)
    return Axis(bottom, top, _ticks(bottom, top, step))


def x_axis(steps: Sequence[int]) -> Axis:
    """The x axis of optimizer steps: the data's first to last step, ticks on whole steps."""
    if not steps:
        return Axis(0.0, 1.0, (0.0, 1.0))
    first, last = min(steps), max(steps)
    if first == last:
        return Axis(first - 1.0, last + 1.0, (float(first),))
    step = max(1.0, nice_step(last - first, X_TICKS - 1))
    return Axis(float(first), float(last), _ticks(float(first), float(last), step))


def nice_step(span: float, count: int) -> float:
    """The smallest of 1, 2 or 5 times a power of ten that splits `span` into at most about `count` steps."""
    raw = span / max(count, 1)
    magnitude = 10.0 ** math.floor(math.log10(raw))
    return next(_tidy(m * magnitude) for m in (1.0, 2.0, 5.0, 10.0) if raw <= m * magnitude * (1 + 1e-9))


def _ticks(low: float, high: float, step: float) -> tuple[float, ...]:
    """The multiples of `step` from `low` to `high`, rounded so 0.1 * 3 reads 0.3."""
    first, last = math.ceil(low / step - 1e-9), math.floor(high / step + 1e-9)
    return tuple(_tidy(k * step) for k in range(first, last + 1))


def _tidy(value: float) -> float:
    """`value` to 12 significant digits: float steps read as the round numbers they stand for."""
    return float(f"{value:.12g}")


def _log_axis(low: float, high: float, domain: Domain) -> Axis:
    """Whole decades around the data; inside a single decade, 2 and 5 times it marked too."""
    first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
    if last == first:
        last += 1
    bottom, top = 10.0**first, 10.0**last
    if domain.high is not None and high <= domain.high:
        top = min(top, domain.high)
    multiples = (1.0,) if last - first > 1 else (1.0, 2.0, 5.0)
    ticks = [_tidy(m * 10.0**e) for e in range(first, last + 1) for m in multiples]
    return Axis(bottom, top, tuple(t for t in ticks if bottom <= t <= top), is_log=True)
