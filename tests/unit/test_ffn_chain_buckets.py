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


def _lite_chain(monkeypatch, buckets: list[int]):
    """A PassChain's class arithmetic over V2-Lite's routed experts (top-6 of 64) on the fixed-shape path, without
    a window or a device."""
    from types import SimpleNamespace

    import torch

    import afd.model.moe as moe
    from afd.connectors.asynchronous.ffn_chain import PassChain

    monkeypatch.setattr(moe, "_moe_kernels_run", lambda x: True)

    class Lite:
        def experts_class(self, layer_idx: int, x: torch.Tensor) -> tuple:
            return moe.routed_experts_class(x, 6, 64, None, fixed_shape=True)

    chain = SimpleNamespace(ends=SimpleNamespace(x=torch.empty(4096, 1)), ffn_model=Lite(), _class_starts={})
    chain.buckets = buckets
    chain.first_served_rows = lambda layer_idx, n: PassChain.first_served_rows(chain, layer_idx, n)
    chain.serving_bucket = lambda layer_idx, rows: PassChain.serving_bucket(chain, layer_idx, rows)
    return chain, Lite()


def test_an_item_serves_the_row_counts_whose_experts_compute_as_its_buckets_do(monkeypatch) -> None:
    """`PassChain.first_served_rows`: an item of n rows serves messages of at least the first count of n's experts
    class (`FFNModel.experts_class`); at V2-Lite's sizes on the GPU path that is the kernels'
    tile buckets (<= 42, 43-128, 129-512 tokens) and the grouped GEMM past 512, each class one interval."""
    import torch

    chain, lite = _lite_chain(monkeypatch, [])
    first = {n: chain.first_served_rows(1, n) for n in (8, 42, 43, 128, 256, 512, 1024, 4096)}
    assert first == {8: 1, 42: 1, 43: 43, 128: 43, 256: 129, 512: 129, 1024: 513, 4096: 513}
    classes = [lite.experts_class(1, torch.empty(n, 1)) for n in range(1, 4097)]
    changes = [n for n in range(1, 4096) if classes[n] != classes[n - 1]]
    assert changes == [42, 128, 512]  # indices: the counts 43, 129 and 513 start a class
    assert (1, 512) in chain._class_starts  # computed once per (layer, rows)


def test_every_message_goes_to_a_bucket_whose_item_serves_it_or_to_the_host(monkeypatch) -> None:
    """`PassChain.serving_bucket`, for every row count up to the slot: a bucket that holds the rows and whose item
    accepts them (its class's first count or more), or None (the host serves them). Never the smallest bucket that
    merely holds them: at 33-42 rows that is 64, whose item refuses them, so a pass started there would abort on
    the same message forever."""
    from afd.connectors.asynchronous.ffn_chain import pass_buckets

    buckets = pass_buckets(4096)
    chain, _ = _lite_chain(monkeypatch, buckets)
    served = {}
    for rows in range(1, 4097):
        bucket = chain.serving_bucket(1, rows)
        if bucket is not None:
            assert bucket in buckets and chain.first_served_rows(1, bucket) <= rows <= bucket, (rows, bucket)
        served[rows] = bucket
    assert [rows for rows, b in served.items() if b is None] == list(range(33, 43))
    assert (served[32], served[43], served[129], served[300], served[513]) == (32, 64, 256, 512, 1024)
