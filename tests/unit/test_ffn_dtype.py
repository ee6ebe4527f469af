"""An FFN rank computes in the dtype the attention ranks run, which they publish at rendezvous
(`RankInfo.dtype`); a `--dtype` given to the FFN rank must name the same one."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from afd.config import parse_config
from afd.distributed.rendezvous import RankInfo
from afd.distributed.store import host_store
from afd.distributed.world import World, init_world
from afd.runtime.launch import free_port
from afd.runtime.rank import RankJob, ffn_dtype
from afd.runtime.spec import RunSpec


def _job(dtype: str = "float32", *, given: bool) -> RankJob:
    return RankJob(parse_config({}), "ffn", 0, RunSpec(dtype=dtype), dtype_given=given)


def _world(*attention_dtypes: str | None) -> SimpleNamespace:
    """A world's peers: the attention ranks with these dtypes, then one FFN rank."""
    num_attention = len(attention_dtypes)
    peers = {
        r: RankInfo(r, "attention", r, num_attention, 1, "attention_first", "h", 1, dtype)
        for r, dtype in enumerate(attention_dtypes)
    }
    peers[num_attention] = RankInfo(num_attention, "ffn", 0, num_attention, 1, "attention_first", "h", 2)
    return SimpleNamespace(peers=peers)


def test_ffn_rank_takes_the_attention_dtype_unless_given() -> None:
    assert ffn_dtype(_job(given=False), _world("bfloat16", "bfloat16")) == "bfloat16"
    assert ffn_dtype(_job("bfloat16", given=True), _world("bfloat16")) == "bfloat16"
    assert ffn_dtype(_job("float16", given=False), _world(None)) == "float16"  # nothing published: its own


def test_a_given_dtype_that_differs_is_refused_in_one_sentence() -> None:
    with pytest.raises(ValueError) as exc:
        ffn_dtype(_job("float32", given=True), _world("bfloat16"))
    assert str(exc.value) == (
        "ffn rank 0 was started with --dtype float32 but the attention side runs bfloat16; leave --dtype out "
        "(an FFN rank takes the attention side's) or give bfloat16"
    )
    with pytest.raises(ValueError, match=r"different dtypes \(bfloat16, float32\)"):
        ffn_dtype(_job(given=False), _world("float32", "bfloat16"))


@pytest.mark.timeout(60)
def test_attention_dtype_travels_with_the_rendezvous() -> None:
    """A real 1A1F world (the store hosted here, as `afd launch` hosts it): the FFN rank sees the attention
    rank's dtype in its peers once `init_world` returns."""
    port = free_port()
    store = host_store("127.0.0.1", port, 30.0, "s")
    worlds: dict[str, World] = {}

    def join(role: str, world_rank: int, dtype: str | None) -> None:
        worlds[role] = init_world(
            "127.0.0.1",
            port,
            world_rank,
            2,
            timeout=30.0,
            num_attention=1,
            num_ffn=1,
            world_order="attention_first",
            secret="s",
            store_external=True,
            dtype=dtype,
        )

    threads = [threading.Thread(target=join, args=a) for a in (("attention", 0, "bfloat16"), ("ffn", 1, None))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(45)
    try:
        assert sorted(worlds) == ["attention", "ffn"]
        assert ffn_dtype(_job(given=False), worlds["ffn"]) == "bfloat16"
        assert worlds["ffn"].peers[0].dtype == "bfloat16" and worlds["attention"].peers[1].dtype is None
    finally:
        for world in worlds.values():
            world.close()
        del store
