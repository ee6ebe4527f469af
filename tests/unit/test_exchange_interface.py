"""The `Exchange` interface: every implementation is one, and an exchange that overrides nothing gets the defaults
the engine and the graph runners rely on instead of probing."""

from __future__ import annotations

import pytest
import torch

from afd.connectors.asynchronous.attention import AsyncAttentionExchange
from afd.connectors.base import Exchange, ZeroExchange
from afd.connectors.p2p.attention import P2pAttentionExchange
from afd.engine.engine import LocalExchange
from afd.engine.graphs.decode import RealRowsExchange
from afd.engine.warm_up import SharedExpertsOnly
from afd.model.attention_side import zero_exchange
from afd.model.weights import load_attention_model, load_ffn_model
from afd.routing import Routing
from afd.vllm_plugin.session import AFDSession


class Doubling(Exchange):
    """Overrides only `__call__`."""

    def __call__(self, layer_idx: int, x: torch.Tensor, routing: Routing | None) -> torch.Tensor:
        return 2 * x


@pytest.mark.parametrize(
    "cls",
    [
        LocalExchange,
        ZeroExchange,
        RealRowsExchange,
        SharedExpertsOnly,
        P2pAttentionExchange,
        AsyncAttentionExchange,
        AFDSession,
    ],  # fmt: skip
)
def test_every_implementation_is_an_exchange(cls: type) -> None:
    assert issubclass(cls, Exchange)
    assert not getattr(cls, "__abstractmethods__", None)  # each can be built: `__call__` is implemented


def test_the_interface_is_abstract_in_call_only() -> None:
    with pytest.raises(TypeError, match="abstract"):
        Exchange()  # type: ignore[abstract]
    assert Exchange.__abstractmethods__ == frozenset({"__call__"})


def test_defaults() -> None:
    ex = Doubling()
    x = torch.ones(3, 4)  # [T, H]
    assert torch.equal(ex(0, x, None), 2 * x)
    assert ex.num_ubatches == 1 and ex.captured_sends == 0 and ex.timeline is None and ex.capturable is False
    assert ex.begin_step(3) is None and ex.begin_step(3, [1, 2]) is None
    assert ex.warm_up_graph_kernels() is None and ex.before_replay() is None and ex.after_replay(2) is None
    assert ex.close() is None
    with pytest.raises(NotImplementedError, match="Doubling does not split steps into micro-batches"):
        ex.send(0, x, None)
    with pytest.raises(NotImplementedError, match="micro-batches"):
        ex.recv()


def test_the_async_exchange_overrides_what_a_captured_step_uses() -> None:
    for name in ("capturable", "warm_up_graph_kernels", "before_replay", "after_replay", "send", "recv", "close"):
        assert getattr(AsyncAttentionExchange, name) is not getattr(Exchange, name), name
    for name in ("begin_step", "send", "recv", "close"):
        assert getattr(P2pAttentionExchange, name) is not getattr(Exchange, name), name


def test_zero_and_real_rows_exchanges() -> None:
    x = torch.randn(5, 4, dtype=torch.float64)  # [T, H]
    out = zero_exchange(0, x, None)
    assert isinstance(zero_exchange, Exchange) and out.shape == x.shape and out.dtype == x.dtype and not out.any()
    seen = []

    class Seeing(Doubling):
        def __call__(self, layer_idx, x, routing):
            seen.append((x.shape[0], None if routing is None else routing.topk_ids.shape[0]))
            return super().__call__(layer_idx, x, routing)

    routing = Routing(torch.zeros(5, 2, dtype=torch.long), torch.ones(5, 2))
    out = RealRowsExchange(Seeing(), 3)(1, x, routing)
    assert seen == [(3, 3)]
    assert torch.equal(out[:3], 2 * x[:3]) and not out[3:].any()


def test_local_and_shared_only_exchanges_answer_as_the_models_do() -> None:
    attn, ffn = load_attention_model("tiny", shared_experts=True), load_ffn_model("tiny")
    layer = attn.boundary_layers[0]
    x = torch.randn(4, attn.config.hidden_size)  # [T, H]
    routing = attn.layers[layer].gate(x)
    with torch.inference_mode():
        assert torch.equal(LocalExchange(ffn)(layer, x, routing), ffn(layer, x, routing))
        assert torch.equal(SharedExpertsOnly(attn)(layer, x, routing), attn.shared(layer, x))
