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


def test_an_item_serves_the_row_counts_whose_experts_compute_as_its_buckets_do(monkeypatch) -> None:
    """`PassChain._other_class_below`: an item of n rows serves messages of more rows than the largest count below
    n of another experts class (`FFNModel.experts_class`); at V2-Lite's sizes on the GPU path that is the kernels'
    tile buckets (<= 42, 43-128, 129-512 tokens) and the grouped GEMM past 512, each class one interval."""
    from types import SimpleNamespace

    import torch

    import afd.model.moe as moe
    from afd.connectors.asynchronous.ffn_chain import PassChain

    monkeypatch.setattr(moe, "_moe_kernels_run", lambda x: True)

    class Lite:  # V2-Lite's routed experts (top-6 of 64) on the fixed-shape path
        def experts_class(self, layer_idx: int, x: torch.Tensor) -> tuple:
            return moe.routed_experts_class(x, 6, 64, None, fixed_shape=True)

    chain = SimpleNamespace(ends=SimpleNamespace(x=torch.empty(4096, 1)), ffn_model=Lite(), _class_bounds={})
    bound = {n: PassChain._other_class_below(chain, 1, n) for n in (8, 42, 43, 128, 256, 512, 1024, 4096)}
    assert bound == {8: 0, 42: 0, 43: 42, 128: 42, 256: 128, 512: 128, 1024: 512, 4096: 512}
    classes = [Lite().experts_class(1, torch.empty(n, 1)) for n in range(1, 4097)]
    changes = [n for n in range(1, 4096) if classes[n] != classes[n - 1]]
    assert changes == [42, 128, 512]  # indices: the counts 43, 129 and 513 start a class
    assert (1, 512) in chain._class_bounds  # computed once per (layer, rows)
