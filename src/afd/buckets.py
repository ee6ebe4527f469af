"""The sizes CUDA graphs are captured for and how a step picks one: pure arithmetic, shared by the engine's
graph runners and the async connector's FFN pass chains."""

from __future__ import annotations

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def batch_buckets(max_num_seqs: int, candidates: tuple[int, ...] = DEFAULT_BATCH_BUCKETS) -> list[int]:
    """The batch sizes graphs are captured for, so that every batch up to `max_num_seqs` has one: the candidates
    below `max_num_seqs`, then quarter octaves above the largest candidate (256, 320, 384, 448, 512, 640, ...: a
    batch is padded by at most 25%), then `max_num_seqs` itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    sizes, size = {b for b in candidates if b < max_num_seqs}, candidates[-1]
    while size < max_num_seqs:
        sizes.add(size)
        size += 1 << max(0, size.bit_length() - 3)
    return sorted(sizes | {max_num_seqs})


SMALLEST_BUCKET = 128


def token_buckets(max_tokens: int, smallest: int = SMALLEST_BUCKET) -> list[int]:
    """Token counts prefill graphs are captured for, up to `max_tokens` (which is always one).

    Multiples of `smallest` up to 8 of them, then a quarter of each power of two (so padding adds at most 25%
    of the row-wise work above 8 x `smallest`, and fewer than `smallest` rows below).
    """
    if max_tokens < 1 or smallest < 1:
        raise ValueError(f"max_tokens and smallest must be at least 1, got {max_tokens} and {smallest}")
    buckets, size = set(), smallest
    while size < max_tokens:
        buckets.add(size)
        step = smallest if size < 8 * smallest else 1 << (size.bit_length() - 3)
        size += step
    return sorted(buckets | {max_tokens})


def pick_bucket(num_seqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds `num_seqs`, or None when none does (the step runs eager)."""
    return next((b for b in buckets if b >= num_seqs), None) if num_seqs > 0 else None


def path_rows(rows: int) -> int:
    """The row count a size-dependent choice of kernels is made by: `rows` rounded up to a power of two.

    Why: a step's rows reach the MoE padded to a graph bucket, and the engine's buckets (`token_buckets`,
    `batch_buckets`) differ from an FFN rank's pass buckets (powers of two); kernels that round differently must
    not be picked by the padded count, or a disaggregated run stops equalling the single-process one. Every bucket
    family here keeps a count and its bucket inside one power-of-two interval, so choosing by `path_rows` gives
    the same path padded or not."""
    return 1 << max(0, rows - 1).bit_length()
