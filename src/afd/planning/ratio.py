"""The closed-form A:F ratio of a decode-bound rA–F group, on the simulator's own cost functions.

Per boundary layer, a group of `r·F` attention replicas of `batch` decode rows each and `F` FFN ranks takes
`cycle(a, f(r), c(r), m)` (`costs.layer_cycle_s`): `a` is one replica's attention (independent of r), `f` the FFN
rank's pass over all `r·batch` rows' share, `c` the round trip with the FFN rank's link carrying them. Output per
GPU is `Φ(r) = r·batch / ((r + 1)·cycle)`. Without micro-batches every part adds to the cycle (`r_A` = 0).
While attention binds (`r < r_A`, where f or c catches up with a) Φ
grows with r; past it the binding side X grows linearly, `x0 + x1·r`, and `r/((r + 1)(x0 + x1·r))` peaks at
`r_peak = sqrt(x0 / x1)`. So `r* = max{r_A, r_peak}` with r_peak taken for the side that binds past r_A — FFN
(`r_F`) or communication (`r_C`) — which is arXiv 2601.21351's `max{r_A, r_C, r_peak}` in this model's terms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from afd.planning import costs
from afd.planning.costs import Shapes
from afd.planning.profile import Profile

REGIMES = ("attention", "ffn", "communication")


@dataclass(frozen=True)
class RatioRule:
    r_star: float
    r_a: float
    r_peak: float
    bound: str  # the regime at r*: attention-, FFN- or communication-bound


def _terms(p: Profile, s: Shapes, connector: str, ffn: int, batch: int, ctx: int, r: float, m: int):
    layers = max(s.moe_layers, 1)
    a = costs.attention_step_s(p, s, batch // m, batch * ctx / m, 0, 0.0) / layers
    tokens = r * ffn * batch / m
    local = -(-s.num_experts // ffn)
    f = costs.routed_pass_s(p, s, tokens, local) + costs.shared_pass_s(p, s, tokens / ffn)
    part = p.part("exchange_p2p" if connector == "p2p" else "exchange_async")
    c = part.time(costs.exchange_bytes(s, connector, tokens, ffn) / ffn)
    return a, f, c


def per_gpu(p: Profile, s: Shapes, connector: str, ffn: int, batch: int, ctx: int, r: float, m: int = 1) -> float:
    """Φ(r): decode tokens per second per GPU of an (r·F)A–F group, every replica at `batch` rows of `ctx`."""
    a, f, c = _terms(p, s, connector, ffn, batch, ctx, r, m)
    cycle = costs.layer_cycle_s(a, f, c, m) * max(s.moe_layers, 1)
    return r * batch / ((r + 1) * cycle)


def bound_at(p: Profile, s: Shapes, connector: str, ffn: int, batch: int, ctx: int, r: float, m: int = 1) -> str:
    a, f, c = _terms(p, s, connector, ffn, batch, ctx, r, m)
    if m <= 1:  # nothing overlaps: the largest part of the chain binds
        return REGIMES[max(range(3), key=lambda i: (a, f, c)[i])]
    return "attention" if m * a >= max(m * f, a + c + f) else ("ffn" if m * f >= a + c + f else "communication")


def optimal_ratio(
    p: Profile, s: Shapes, connector: str, ffn: int, batch: int, ctx: int, m: int = 1, r_max: float = 64.0
) -> RatioRule:
    """r* = max{r_A, r_peak} of the module's rule, with the regime at r*."""
    lo, hi = 1e-3, r_max
    if m <= 1:  # nothing overlaps: every part adds to the cycle, which is linear in r from the start
        r_a = 0.0
    elif bound_at(p, s, connector, ffn, batch, ctx, hi, m) == "attention":
        r_a = hi
    else:  # the ratio where attention stops binding (bisection: the sides are monotone in r)
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if bound_at(p, s, connector, ffn, batch, ctx, mid, m) == "attention" else (lo, mid)
        r_a = lo
    # past r_A the bound is x0 + x1·r: its two points give the line, the line gives the peak
    r1, r2 = r_a * 1.5 + 1, r_a * 1.5 + 2
    y1 = r1 * batch / ((r1 + 1) * per_gpu(p, s, connector, ffn, batch, ctx, r1, m))
    y2 = r2 * batch / ((r2 + 1) * per_gpu(p, s, connector, ffn, batch, ctx, r2, m))
    x1 = (y2 - y1) / (r2 - r1)
    x0 = y1 - x1 * r1
    r_peak = math.sqrt(x0 / x1) if x1 > 0 and x0 > 0 else r_max
    r_star = min(max(r_a, r_peak), r_max)
    return RatioRule(r_star, r_a, r_peak, bound_at(p, s, connector, ffn, batch, ctx, r_star, m))
