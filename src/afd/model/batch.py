"""`Batch`: where each sequence of a flattened step sits, the one description of a step that the engine fills
and every attention layer and the paged cache read."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch


@dataclass
class GraphedLayout:
    """A step's layout as device buffers of fixed shapes, read by an attention core captured in a CUDA graph
    (afd.engine.graphs.prefill): the step's single-token sequences on rows [0, Bd), attended in the absorbed form
    over `decode_tables` / `decode_lens` ([D, W], [D]: D >= Bd rows, the others padding: the null block, length
    1), then the prompts (fresh ones and chunks after cached context) by one tiled varlen launch: their keys are
    the cache rows `key_rows` ([K] int64: each prompt's positions up to its last new token, packed; the rest
    stale, never attended) or, None, the step's own rows (fresh prompts only), `cu_seqlens_q` / `cu_seqlens_k`
    ([S + 1] int32 each: absolute query rows, key rows; empty sequences past the step's) and `tiles` ([2, G]
    int32: program g's sequence, -1 for none, and query tile). A replay refills the buffers; nothing here is read
    on the host."""

    decode_tables: torch.Tensor
    decode_lens: torch.Tensor
    key_rows: torch.Tensor | None
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    tiles: torch.Tensor


@dataclass
class Batch:
    """Where each sequence of a flattened step sits: `query_lens[i]` consecutive rows, cache `slots[i]`,
    `context_lens[i]` tokens already cached before this step.

    The device fields are filled once per step by `PagedLatentCache.prepare` and read by every layer.
    """

    slots: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    slot_mapping: torch.Tensor | None = None  # [T] flat cache row of every token of the step
    decode_token_rows: torch.Tensor | None = None  # [Bd] rows of the step that `decode_seqs` sit at
    decode_tables: torch.Tensor | None = None  # [Bd, W] int64 block-table rows of their contexts
    decode_lens: torch.Tensor | None = None  # [Bd] int32 their context lengths (this step's token included)
    context_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # i -> [ctx + n] rows, other cached seqs
    # Batch even a lone decode token: a CUDA graph (graphs.decode) needs the fixed-shape batched path at size 1.
    batch_decodes: bool = False
    varlen_meta: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)  # prefill kernel's, built once
    graphed: GraphedLayout | None = None  # set: the attention core reads only these buffers (a captured step)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def starts(self) -> list[int]:
        """First row of each sequence in the flattened step."""
        return [0, *itertools.accumulate(self.query_lens)][:-1]

    @property
    def decode_seqs(self) -> list[int]:
        """Single-token sequences attended in one batched pass (absorbed MLA); only worth it for two or more
        (or one, when `batch_decodes` asks for the fixed-shape path)."""
        decode = [i for i, n in enumerate(self.query_lens) if n == 1]
        return decode if len(decode) > 1 or (self.batch_decodes and decode) else []
