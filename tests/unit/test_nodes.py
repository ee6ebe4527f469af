"""Which world ranks each node of `afd launch --nnodes` starts, and the refusals of a split that cannot be."""

from __future__ import annotations

import pytest

from afd.config import parse_config
from afd.runtime.nodes import NodeSpec, node_ranks, ranks_in_world_order, run_digest, split_problem
from afd.runtime.spec import RunSpec


def config(connector: str, num_attention: int, num_ffn: int):
    return parse_config({"connector": connector, "num_attention_ranks": num_attention, "num_ffn_ranks": num_ffn})


def node(rank: int, nnodes: int, nproc: int) -> NodeSpec:
    return NodeSpec(nnodes=nnodes, node_rank=rank, nproc_per_node=nproc, master_addr="127.0.0.1", master_port=6239)


def test_p2p_world_order_puts_ffn_ranks_on_the_first_node() -> None:
    cfg = config("p2p", 2, 2)
    assert node_ranks(cfg, node(0, 2, 2)) == [("ffn", 0, 0), ("ffn", 1, 1)]
    assert node_ranks(cfg, node(1, 2, 2)) == [("attention", 0, 2), ("attention", 1, 3)]


def test_async_world_order_puts_attention_ranks_on_the_first_node() -> None:
    cfg = config("async", 2, 2)
    assert node_ranks(cfg, node(0, 2, 2)) == [("attention", 0, 0), ("attention", 1, 1)]
    assert node_ranks(cfg, node(1, 2, 2)) == [("ffn", 0, 2), ("ffn", 1, 3)]


@pytest.mark.parametrize("connector", ["p2p", "async"])
@pytest.mark.parametrize("num_attention, num_ffn, nnodes", [(3, 1, 2), (3, 1, 4), (2, 4, 3), (1, 1, 1), (5, 3, 8)])
def test_nodes_cover_every_world_rank_once_in_order(connector: str, num_attention: int, num_ffn: int, nnodes: int):
    cfg = config(connector, num_attention, num_ffn)
    world_size = num_attention + num_ffn
    nproc = world_size // nnodes
    started = [r for k in range(nnodes) for r in node_ranks(cfg, node(k, nnodes, nproc))]
    assert [w for _, _, w in started] == list(range(world_size))
    assert [(role, r) for role, r, _ in started] == ranks_in_world_order(cfg)
    assert sorted(r for role, r, _ in started if role == "attention") == list(range(num_attention))
    assert sorted(r for role, r, _ in started if role == "ffn") == list(range(num_ffn))


def test_describe_names_a_node_by_its_world_ranks() -> None:
    assert node(1, 2, 2).describe(1) == "node 1 (world ranks 2-3)"
    assert node(0, 4, 1).describe(3) == "node 3 (world rank 3)"


@pytest.mark.parametrize(
    "nnodes, node_rank, nproc, world_size, message",
    [
        (2, 2, None, 4, "--node-rank 2 is out of range for --nnodes 2 (0 to 1)"),
        (2, 0, None, 5, "a world of 5 ranks does not split evenly over --nnodes 2"),
        (2, 1, 3, 4, "--nproc-per-node 3 x --nnodes 2 is 6 ranks, but the world has 4"),
        (3, 0, 1, 4, "--nproc-per-node 1 x --nnodes 3 is 3 ranks, but the world has 4"),
    ],
)
def test_a_split_that_cannot_be_is_one_sentence(nnodes, node_rank, nproc, world_size, message) -> None:
    problem = split_problem(nnodes, node_rank, nproc, world_size)
    assert problem is not None and problem.startswith(message) and "\n" not in problem


@pytest.mark.parametrize("nnodes, node_rank, nproc, world_size", [(2, 1, None, 4), (2, 0, 2, 4), (1, 0, None, 3)])
def test_a_right_split_passes(nnodes, node_rank, nproc, world_size) -> None:
    assert split_problem(nnodes, node_rank, nproc, world_size) is None


def test_the_run_digest_ignores_the_node_rank_and_the_timeout_only() -> None:
    cfg = config("p2p", 2, 2)
    base = run_digest(cfg, RunSpec(), [[1, 2]], node(0, 2, 2))
    assert run_digest(cfg, RunSpec(timeout_s=9), [[1, 2]], node(1, 2, 2)) == base
    assert run_digest(cfg, RunSpec(), [[1, 3]], node(1, 2, 2)) != base
    assert run_digest(cfg, RunSpec(max_new_tokens=3), [[1, 2]], node(1, 2, 2)) != base
    assert run_digest(config("async", 2, 2), RunSpec(), [[1, 2]], node(1, 2, 2)) != base
