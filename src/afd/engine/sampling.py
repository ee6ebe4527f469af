"""Per-request sampling: temperature, top-k, top-p and a seed, for a whole batch in one pass.

Greedy (temperature 0, the default) is `argmax` of the scores, bit for bit the engine's greedy path.
A sampled row draws its token by the Gumbel-max trick: `argmax(scores / temperature + g)`, with `g`
Gumbel noise over the kept tokens. The noise is counter-based: a 32-bit hash of (request seed, position
of the token being sampled, token id) computed on the device with exact integer arithmetic. So a
request's tokens depend only on its own seed, prompt and scores, never on the other rows of the batch,
the batch size or any global RNG, and CPU and CUDA draw the same noise. A request without a seed gets a
fresh key per step from torch's default CPU generator (reproducible under `torch.manual_seed`).

Filters follow vLLM: temperature first, then top-k, then top-p on the top-k-renormalised distribution
(the smallest set of most likely tokens whose mass reaches `top_p`). `top_k = 0` turns top-k off (vLLM
also takes -1; here only 0 does, so a negative value is caught as a mistake). A row with `top_k = 1` is
greedy. The engine reports the log-probability of the chosen token under the model's untempered,
unfiltered distribution, as vLLM does by default.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from numbers import Integral, Real

import torch

MIN_TEMPERATURE = 1e-2  # below it, scores / temperature overflow float32; vLLM clamps to the same floor
_MASK32 = 0xFFFFFFFF
_MAX_SEED = 1 << 64


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. `seed`: same seed, prompt and scores give the same tokens;
    None draws a fresh random key every step."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or not (t == 0 or t >= MIN_TEMPERATURE):
            raise ValueError(
                f"temperature must be 0 (greedy) or a finite number of at least {MIN_TEMPERATURE}, got {t!r}"
            )
        p = self.top_p
        if not _is_real(p) or not 0 < p <= 1:  # nan fails both comparisons
            raise ValueError(f"top_p must be a number greater than 0 and at most 1, got {p!r}")
        k = self.top_k
        if not _is_int(k) or k < 0:
            raise ValueError(f"top_k must be 0 (no top-k filtering) or a positive integer, got {k!r}")
        s = self.seed
        if s is not None and (not _is_int(s) or not 0 <= s < _MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, 2**64) or None, got {s!r}")

    @property
    def greedy(self) -> bool:
        """Argmax: temperature 0, or only the most likely token kept."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def filters(self) -> bool:
        """Whether top-k or top-p removes anything (they need a sort of the row)."""
        return self.top_k > 0 or self.top_p < 1


SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))  # what a replica's `add` message carries


def _is_real(x: object) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def _is_int(x: object) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def _mul32(x, c: int):
    """`x * c mod 2**32` for x in [0, 2**32), on Python ints or int64 tensors: the product is split in
    16-bit halves so no intermediate leaves int64 (signed overflow is not defined behaviour)."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _MASK32


def mix32(x):
    """A 32-bit integer hash (a bijection of [0, 2**32), "lowbias32"), on ints or int64 tensors alike."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_key(seed: int, position: int) -> int:
    """The 32-bit key of one draw: the request's seed (all 64 bits) and the position being sampled."""
    return mix32(((seed >> 32) & _MASK32) ^ mix32((seed & _MASK32) ^ mix32(position & _MASK32)))


def gumbel_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, V] fp32 Gumbel noise; row i is a function of `keys[i]` (int64, 32-bit values) and the token id only."""
    token_hash = mix32(torch.arange(vocab_size, dtype=torch.long, device=keys.device) ^ 0x9E3779B9)
    bits = mix32(keys[:, None] ^ token_hash[None, :]) >> 8  # 24 uniform bits, exact in float32
    u = (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1): the logs below stay finite
    return -torch.log(-torch.log(u))


def sample(logits: torch.Tensor, params: Sequence[SamplingParams | None], positions: Sequence[int]) -> torch.Tensor:
    """Tokens [B] (int64, on the scores' device) for scores [B, V] fp32, one row per request.

    `logits` may be any per-row shift of the logits (the engine passes log-probabilities: its greedy
    path is their argmax). `params[i]` None means greedy; `positions[i]` is the index, in its sequence,
    of the token row i samples (the counter of its noise). Greedy rows are `argmax` exactly, also in a
    mixed batch. No host sync: the sampled rows' parameters go to the device in one asynchronous copy.
    """
    B, V = logits.shape
    if len(params) != B or len(positions) != B:
        raise ValueError(f"sample got {B} rows of scores but {len(params)} params and {len(positions)} positions")
    best = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if p is not None and not p.greedy]
    if not rows:
        return best
    chosen = [params[i] for i in rows]
    keys = [
        row_key(p.seed, positions[i]) if p.seed is not None else int(torch.randint(0, 1 << 32, ()).item())
        for i, p in zip(rows, chosen, strict=True)
    ]
    # one host->device copy: every value is an integer below 2**53 or a float, exact in float64
    host = torch.tensor(
        [rows, keys, [p.temperature for p in chosen], [p.top_p for p in chosen], [p.top_k or V for p in chosen]],
        dtype=torch.float64,
        pin_memory=logits.is_cuda,
    )
    meta = host.to(logits.device, non_blocking=True)
    row_idx, key, top_k = (meta[i].to(torch.long) for i in (0, 1, 4))
    temperature, top_p = meta[2].to(torch.float32), meta[3].to(torch.float32)
    every_row = len(rows) == B
    scores = (logits if every_row else logits.index_select(0, row_idx)) / temperature[:, None]
    noise = gumbel_noise(key, V)
    if any(p.filters for p in chosen):
        tokens = _sample_filtered(scores, noise, top_k, top_p)
    else:
        tokens = (scores + noise).argmax(dim=-1)
    return tokens if every_row else best.index_copy(0, row_idx, tokens)


def _sample_filtered(
    scores: torch.Tensor, noise: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Gumbel-max over the tokens top-k and then top-p keep, in the row's sorted order (one sort per row).

    The noise is the token's own (gathered by token id), so a row that filters nothing draws the same
    token here as on the unfiltered path."""
    S, V = scores.shape
    ordered, order = scores.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(V, device=scores.device)
    keep = rank[None, :] < top_k[:, None]
    ordered = ordered.masked_fill(~keep, -math.inf)
    probs = ordered.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # the most likely token always stays: its mass before is 0
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1)
    ordered = ordered.masked_fill(~keep, -math.inf)
    choice = (ordered + noise.gather(1, order)).argmax(dim=-1, keepdim=True)
    return order.gather(1, choice).squeeze(1)
