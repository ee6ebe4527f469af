"""An exchange that checks the padded decode steps of a graph send only their real rows."""

from __future__ import annotations

from afd.connectors.base import Exchange
from afd.engine.engine import LocalExchange


class RealRowsOnly(Exchange):
    """A disaggregated exchange's view: records the rows it was asked for, answers as the local one does."""

    def __init__(self, local: LocalExchange) -> None:
        self.local, self.rows_seen = local, []

    def __call__(self, layer_idx, x, routing):
        self.rows_seen.append(x.shape[0])
        return self.local(layer_idx, x, routing)
