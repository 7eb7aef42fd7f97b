"""Bounds for comparing two fp32 computations of one value that differ only in rounding (summation order:
two ranks or one, packed or per sequence, fused or a reference loop), derived from the computation.

No tolerance is tuned on one CPU: another CPU (AVX-512 or AVX2, another BLAS kernel) sums in another
order and rounds differently. A bound is a multiple of the rounding error the test measures on this host,
as the distance from the fp32 result `want` to `exact`, the same computation in float64 (exact to fp32
rounding), plus one fp32 ulp per element. Where `got` has a float64 twin too (ours against transformers),
the two measured errors are averaged: one sample of an error norm dominated by a few elements scatters
widely, two rarely both fall low. Norms, not elements: one element's error can be zero by luck. A wrong
computation (a dropped datum, another slot's adapter) is off by far more; the tests check that too.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

# fp32 unit roundoff: fl(x) = x·(1 + d) with |d| <= U; one ulp of x is at most 2U·|x|.
U = 2.0**-24
BF16_U = 2.0**-8  # bfloat16's (8 significant bits)
# Two fp32 computations each within e of the exact value are within 2e of each other; twice that again
# because `got` rounds at other places than `want` (more partial sums, another kernel or packing), so its
# own error may exceed want's, and one measured error norm scatters about its typical size.
NOISE_MULTIPLE = 4.0

Array = torch.Tensor | np.ndarray

logger = logging.getLogger(__name__)


def to_numpy(value: Array | float) -> np.ndarray:
    """A float64 numpy copy of a tensor (any device or dtype, detached), array or number."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().double().numpy()
    return np.asarray(value, dtype=np.float64)


def rounding_bound(
    want: Array | float,
    exact: Array | float,
    multiple: float = NOISE_MULTIPLE,
    unit: float = U,
    got: Array | None = None,
    got_exact: Array | None = None,
) -> float:
    """How far another computation `got` of `want` in the same precision (unit roundoff `unit`) may lie
    from it, in norm: `multiple` times want's own rounding error |want - exact| (averaged with got's,
    |got - got_exact|, where got has a float64 twin), plus one ulp per element (2·unit·|want|), by which
    two results rounded once from the same value may differ even where `want` rounds to `exact` exactly."""
    want_np, exact_np = to_numpy(want), to_numpy(exact)
    assert want_np.shape == exact_np.shape, f"{want_np.shape} != {exact_np.shape}"
    noise = float(np.linalg.norm(want_np - exact_np))
    if got_exact is not None:
        assert got is not None
        noise = (noise + float(np.linalg.norm(to_numpy(got) - to_numpy(got_exact)))) / 2
    return multiple * noise + 2 * unit * float(np.linalg.norm(want_np))


def assert_within_rounding(
    got: Array,
    want: Array,
    exact: Array,
    what: str,
    multiple: float = NOISE_MULTIPLE,
    unit: float = U,
    got_exact: Array | None = None,
) -> None:
    """|got - want| <= rounding_bound(...) of them, in norm; the message names `what`."""
    got_np, want_np = to_numpy(got), to_numpy(want)
    assert got_np.shape == want_np.shape, f"{what}: shape {got_np.shape} != {want_np.shape}"
    error = float(np.linalg.norm(got_np - want_np))
    assert_at_most(error, rounding_bound(want_np, exact, multiple, unit, got_np, got_exact), what)


def gamma(n: int, unit: float = U) -> float:
    """Higham's gamma_n = n·u / (1 - n·u): the relative error that n successive roundings of unit `unit`
    may compound to (Accuracy and Stability of Numerical Algorithms, Lemma 3.1). A dot product of n exact
    products summed in any order is within gamma_n·Σ|products| of the exact one (§3.1), and chained
    computations add their n: gamma_a + gamma_b + gamma_a·gamma_b <= gamma_(a+b) (Lemma 3.3)."""
    assert n * unit < 1, f"{n} roundings of unit {unit} bound nothing"
    return n * unit / (1 - n * unit)


def sum_rounding_bound(terms: Array) -> float:
    """How far an fp32 sum of `terms`, in any order, may lie from their exact sum: gamma_(n-1)·Σ|term|
    (Higham, Accuracy and Stability of Numerical Algorithms, §4.2), n the number of terms."""
    terms_np = to_numpy(terms).reshape(-1)
    n = max(terms_np.size - 1, 0)
    return n * U / (1 - n * U) * float(np.abs(terms_np).sum())


def sums_bound(terms: Array, other_terms: Array) -> float:
    """How far fp32 sums of two lists of terms, each summed in any order, may lie apart: the exact
    difference of their sums plus each sum's rounding (sum_rounding_bound). A sum that cancels to near 0
    keeps the absolute error of its terms, which no relative tolerance of the sum can bound."""
    difference = float(to_numpy(terms).sum() - to_numpy(other_terms).sum())  # float64: exact to ~1e-16
    return abs(difference) + sum_rounding_bound(terms) + sum_rounding_bound(other_terms)


def assert_at_most(error: float, bound: float, what: str) -> None:
    """error <= bound, logging error / bound (the margin) at DEBUG for whoever measures it."""
    ratio = error / bound if bound else 0.0
    logger.debug("%s: error %.3g, bound %.3g, ratio %.3f", what, error, bound, ratio)
    assert error <= bound, f"{what}: error norm {error:.3g} exceeds its rounding bound {bound:.3g}"


def log_softmax_bound(logits_TV: Array, logit_bound_TV: Array, targets_TK: Array) -> np.ndarray:
    """(T, K): how far fp32 log_softmax(ẑ)[t, target] may lie from the exact log_softmax(z)[t, target],
    for fp32 logits ẑ within `logit_bound` ε of the exact logits z (`logits_TV`, float64), elementwise.

    Two parts. The logits' own error: lp_v = z_v - lse(z) moves by at most ε_v + log Σ_u p_u·exp(ε_u)
    (lse is convex, so |lse(z + δ) - lse(z)| <= log Σ_u p_u·exp(|δ_u|), p = softmax(z); ≈ ε_v + Σ_u p_u·ε_u).
    The fp32 log_softmax's rounding, first order (the O(u²) terms are below 1e-12 here), with d = z - m,
    m = max z, S = Σ_u exp(d_u): each d_u rounds by u·|d_u|, which exp turns into a relative u·|d_u|; exp
    itself is within 2 ulps (CUDA's expf; torch's CPU kernels 1), 4u relative; Σ of V positive terms adds
    gamma_(V-1) relative — so S within u·max|d| + gamma_(V+4) relative, which log turns into as much
    absolute, plus log's own ulp (2u·|log S|); then m and log S are subtracted from z_v in either order
    (torch's CPU kernel forms m + log S first, CUDA's d - log S), each within u of its result.
    """
    z_TV, eps_TV = to_numpy(logits_TV), to_numpy(logit_bound_TV)
    targets = to_numpy(targets_TK).astype(np.int64)
    m_T1 = z_TV.max(-1, keepdims=True)
    d_TV = z_TV - m_T1
    log_s_T1 = np.log(np.exp(d_TV).sum(-1, keepdims=True))
    p_TV = np.exp(d_TV - log_s_T1)
    lse_moved_T1 = np.log((p_TV * np.exp(eps_TV)).sum(-1, keepdims=True))
    moved_TK = np.take_along_axis(eps_TV, targets, -1) + lse_moved_T1
    d_TK = np.take_along_axis(d_TV, targets, -1)
    lp_TK = d_TK - log_s_T1
    sum_error_T1 = U * np.abs(d_TV).max(-1, keepdims=True) + gamma(z_TV.shape[-1] + 4)
    rounding_TK = sum_error_T1 + U * (3 * np.abs(log_s_T1) + np.abs(m_T1) + np.abs(d_TK) + np.abs(lp_TK))
    return moved_TK + rounding_TK


def linear_exact(
    x_TI: torch.Tensor, weight_OI: torch.Tensor, lora: tuple[torch.Tensor, torch.Tensor, float] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, ε), float64: y = x·Wᵀ + scale·(x·Aᵀ)·Bᵀ of the given values computed exactly, and how far an
    fp32-accumulated computation of it (fp32_linear.py with the slot's delta added in fp32) may lie from
    it, elementwise. The base is an I-term dot product of exact products (bf16 x bf16 fits in fp32): I
    roundings; the delta's longest path rounds the I-term shrink, the scale, each R-term product with B
    and R + 1 sums into the base: I + R + 3 roundings. So |ŷ - y| <= gamma_(I+R+3)·ỹ, ỹ the same
    computation on absolute values (Higham §3.1, Lemma 3.3)."""
    x, weight = x_TI.detach().double(), weight_OI.detach().double()
    y_TO, magnitude_TO = x @ weight.T, x.abs() @ weight.abs().T
    rank = 0
    if lora is not None:
        A_RI, B_OR, scale = lora[0].detach().double(), lora[1].detach().double(), lora[2]
        y_TO += scale * (x @ A_RI.T) @ B_OR.T
        magnitude_TO += scale * (x.abs() @ A_RI.abs().T) @ B_OR.abs().T
        rank = A_RI.shape[0]
    return y_TO, gamma(x.shape[1] + rank + 3) * magnitude_TO
