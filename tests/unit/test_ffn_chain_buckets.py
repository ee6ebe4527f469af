"""Device-driven FFN passes: the pass buckets cover every row count up to the slot."""

from __future__ import annotations


def test_pass_buckets_cover_every_row_count_up_to_the_slot() -> None:
    """Decode buckets, powers of two, and the slot's rows: every message up to the slot has a bucket of less than
    twice its rows."""
    from afd.buckets import pick_bucket
    from afd.connectors.asynchronous.ffn_chain import pass_buckets

    assert pass_buckets(1) == [1] and pass_buckets(300)[-2:] == [256, 300]
    assert pass_buckets(8192)[-5:] == [512, 1024, 2048, 4096, 8192]
    for cap in (1, 7, 256, 1000, 6000):
        buckets = pass_buckets(cap)
        assert buckets == sorted(set(buckets)) and buckets[-1] == cap
        for rows in range(1, cap + 1):
            bucket = pick_bucket(rows, buckets)
            assert bucket is not None and rows <= bucket < 2 * rows, (cap, rows, bucket)
