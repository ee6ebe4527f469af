"""CUDA graphs for steps with prompt tokens, in pieces around what depends on the step's layout.

Why: at a few thousand tokens per step the attention rank's host spends about as long enqueueing a layer's
kernels (norms, projections, rope, router: some twenty launches) as the GPU spends running them, so its
stream waits for the host (docs/performance.md). Decode steps already replay graphs
(afd.engine.graphs.decode), but a prefill step's layout (how many sequences, their lengths and cached context) varies
from step to step. Most of a layer does not care: everything but the attention core is row-wise, so it
depends on the token count alone.

So a step of T tokens (prompt chunks, and the decodes beside them in a mixed step) is padded to a token bucket Tp
(`token_buckets`) and replayed from one graph per piece of `AttentionModel.forward_segments(pause_at_attention=True)`.
Between pieces, on the step's T real rows only, the attention core (`MLAttention.attend`: varlen prefill, batched
decodes) runs eagerly, so the kernels that read the layout see exactly the step the engine scheduled. What happens
at a boundary layer's MoE is decided once, when the runner is built:

- MoE inside (`ffn_model` given: the in-process exchange, whose FFN model takes the fixed-shape, host-sync-free
  MoE path, `afd.engine.graphs.decode.capture_safe_moe`): each boundary layer's MoE (the gate on the FFN side if
  it is there, routed and shared experts) runs inside the pieces on all Tp rows, so the pieces pause only at the
  attention cores: one eager launch group per layer instead of the whole MoE's. Padding rows are routed to no
  expert: a static mask (`real`, refilled per step) turns their top-k ids into -1, which no expert holds, and
  their weights into 0, as `afd.engine.graphs.ffn.ExpertPassGraphs` does with its padding rows; their pairs sort
  after every expert group and cost no expert FLOPs. The shared experts and every other op are row-wise, so a
  padding row's result never reaches a real row, and the caller reads only the first T rows of the output.
- Exchange eager (no `ffn_model`: p2p, async, or experts without a fixed-shape path): the pieces also pause at
  every boundary layer and the exchange runs eagerly between them on the T real rows (yielded as a `Boundary`),
  so the FFN side sees exactly the step the engine announced; no padding row reaches the exchange.

Cores inside: a step of batched decodes (first, as the engine orders them) and prompt chunks needs no pause at its
attention cores: each bucket also has graphs whose cores read the bucket's fixed-shape layout buffers
(`afd.engine.graphs.layout`, `MLAttention._attend_graphed`), refilled per step by device copies, so such a step
replays whole (MoE inside) or pauses only at the exchange; one kind for fresh prompts (their own rows as keys), one
for chunks after cached context (keys gathered from the cache). A step whose cached context passes what the
layout's key rows hold (a long prompt's later chunks) takes the pieces that pause at the cores (PAUSED).

Every tensor that crosses a pause lives in one set of static buffers per runner, sized for the largest
bucket and shared by every bucket and layer (the pieces copy into them), so the graphs' memory does not
grow with layers x buckets; with the MoE inside, its temporaries at the largest bucket join the graphs' pool
(`graph_memory_estimate(..., moe_inside=True)`). Padding rows never touch real data: token id and position 0,
cache writes to the scratch row, a zero-or-stale (finite) attention output, and no expert. Two micro-batches in
flight at once need two runners (their buffers would collide). CPU never captures; `capture=False` runs the same
padded pieces eagerly (the CPU tests of this module).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Generator
from dataclasses import dataclass, field

import torch

from afd import kernels
from afd.buckets import token_buckets
from afd.engine.graphs.decode import resume
from afd.engine.graphs.layout import GATHERED_KEYS, OWN_KEYS, PAUSED, LayoutBuffers
from afd.model.attention_side import AttentionCore, AttentionModel, Boundary, Segments
from afd.model.batch import Batch
from afd.model.config import ModelConfig
from afd.model.ffn_side import FFNModel
from afd.model.fp8 import block_in_kernels
from afd.model.kv_cache import PagedLatentCache
from afd.routing import Routing

logger = logging.getLogger(__name__)


def graph_memory_estimate(config: ModelConfig, dtype: torch.dtype, max_tokens: int, *, moe_inside: bool = False) -> int:
    """An upper estimate of one runner's device memory (bytes), which the KV cache must leave free.

    Per token of the largest bucket: the static buffers (q, the latents, the attention output, the boundary rows,
    the answer, the routing, the inputs, the padding mask, the layout's prompt metadata), about eight hidden-size
    temporaries in the graphs' pool, each bucket's output (the buckets sum to under seven times the largest), and
    for the graphs that hold the attention cores their temporaries and outputs too. `moe_inside`: also the
    MoE's temporaries in the pool (`moe_graph_bytes_per_token`), which the eager step's own estimate does not cover
    (a graph pool is private), and for FP8 experts whose block the kernels do not take (b1 not a multiple of 32)
    one layer's dequantized copy, twice over: what they run on (afd.model.moe).
    """
    c = config
    nh = c.num_attention_heads
    rows = nh * (c.qk_head_dim + c.v_head_dim) + c.kv_lora_rank + c.qk_rope_head_dim
    # the graphs with the attention cores inside: their gathered and expanded keys (twice the bucket's rows),
    # output, the decode rows' latent queries and outputs, each bucket's output twice more (two kinds); the key rows
    latents = c.kv_lora_rank + c.qk_rope_head_dim
    keys = 2 * (nh * (c.qk_nope_head_dim + c.v_head_dim) + latents)
    cores = keys + nh * (c.v_head_dim + 2 * c.kv_lora_rank) + 14 * c.hidden_size
    per_token = dtype.itemsize * (rows + cores + 18 * c.hidden_size) + 12 * c.num_experts_per_tok + 25 + 40
    if not moe_inside:
        return max_tokens * per_token
    kernels_take = c.fp8_block is None or block_in_kernels(c.fp8_block)
    dequantized = 0 if kernels_take else 2 * c.n_routed_experts * 3 * c.hidden_size * c.moe_intermediate_size
    return max_tokens * (per_token + moe_graph_bytes_per_token(config, dtype)) + dequantized * dtype.itemsize


def moe_graph_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes per row of one MoE layer's temporaries on the fixed-shape path (afd.model.moe), as a piece holds them:
    the K gathered rows, their gate/up, activation and expert outputs, and (without the combine kernel) their fp32
    weighted copies in sorted and (t, k) order; the shared experts' intermediates; the fp32 sums and the answer;
    the masked routing and the sort's indices."""
    c = config
    K, H, inter = c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size
    model_dtype = K * (2 * H + 3 * inter) + 3 * c.n_shared_experts * inter + H
    fp32 = 2 * K * H + 3 * H
    return dtype.itemsize * model_dtype + 4 * fp32 + 40 * K


@dataclass
class _Buffers:
    """The static tensors around the pauses, [Tmax, ...]: views [:Tp] go into the graphs of bucket Tp."""

    input_ids: torch.Tensor  # [Tmax] int64
    positions: torch.Tensor  # [Tmax] int64
    slot_mapping: torch.Tensor  # [Tmax] int64, padding rows: the cache's scratch row
    q: torch.Tensor  # [Tmax, nh, D]
    kv_c: torch.Tensor  # [Tmax, C]
    k_pe: torch.Tensor  # [Tmax, R]
    attention: torch.Tensor  # [Tmax, nh, Dv] what each core wrote
    hidden: torch.Tensor  # [Tmax, H] what each boundary hands over
    topk_ids: torch.Tensor | None  # [Tmax, K] int64 (None: the gate is on the FFN side)
    topk_weights: torch.Tensor | None  # [Tmax, K] fp32
    answer: torch.Tensor  # [Tmax, H] the exchange's answer
    real: torch.Tensor  # [Tmax] bool: the step's real rows (MoE inside: the others are routed to no expert)


@dataclass
class _Graph:
    """The pieces of one token bucket: graph i runs up to pause i (the last one to the output)."""

    tokens: int
    graphs: list[torch.cuda.CUDAGraph]  # empty with capture=False
    cores: str = PAUSED  # how the attention cores run: paused at (eager between pieces), or inside from a layout
    pauses: list[tuple[str, int]] = field(default_factory=list)  # ("core" | "boundary", layer)
    output: torch.Tensor | None = None  # [Tp, H]


class PrefillGraphRunner:
    """Replays steps of up to `max_tokens` tokens from graphs, per token bucket one set for each way the attention
    cores run (PAUSED, OWN_KEYS, GATHERED_KEYS; captured lazily or by `capture_all`, into one memory pool); the
    caller drives `segments` as it drives `AttentionModel.forward_segments`. `ffn_model`: the in-process exchange's
    FFN model, whose MoE then runs inside the pieces (it must take the fixed-shape path to be captured); None:
    boundaries are yielded to the caller's exchange, on the real rows. `max_seqs`: the most sequences a step holds
    (the engine's `max_num_seqs`), which sizes the layouts' decode rows and prompt slots."""

    def __init__(
        self,
        model: AttentionModel,
        kv_cache: PagedLatentCache,
        max_tokens: int,
        *,
        capture: bool = True,
        ffn_model: FFNModel | None = None,
        max_seqs: int | None = None,
    ) -> None:
        self.model, self.kv_cache, self.ffn_model = model, kv_cache, ffn_model
        self.buckets = token_buckets(max_tokens)
        self.capture = capture
        self.disabled = False
        # cores inside the graphs (afd.engine.graphs.layout) for steps of decodes and prompt chunks: where the
        # kernels run (a capture needs them), and on CPU's padded eager pieces
        self.cores_inside = kernels.enabled(kv_cache.device) or not capture
        self._layout = LayoutBuffers(
            max_tokens, max_seqs or max_tokens, kv_cache.block_tables.shape[1], model.embed_tokens.weight.dtype,
            kv_cache.device,
        )  # fmt: skip
        self._graphs: dict[tuple[int, str], _Graph] = {}  # (bucket, how its cores run) -> its graphs
        self.steps_by_cores: Counter[str] = Counter()  # replayed steps by how their attention cores ran
        self.captured_while_serving = 0  # graphs captured on a miss inside a step, not by `capture_all`
        self._buffers: _Buffers | None = None
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    @property
    def captured(self) -> list[int]:
        """The buckets captured, either way."""
        return sorted({tokens for tokens, _ in self._graphs})

    @property
    def steps_cores_inside(self) -> int:
        """Steps replayed with their attention cores inside the graphs."""
        return self.steps_by_cores[OWN_KEYS] + self.steps_by_cores[GATHERED_KEYS]

    @property
    def captured_cores_inside(self) -> list[int]:
        """The buckets whose graphs hold the attention cores too."""
        return sorted({tokens for tokens, cores in self._graphs if cores != PAUSED})

    def handles(self, num_tokens: int) -> bool:
        return not self.disabled and 0 < num_tokens <= self.max_tokens

    def bucket(self, num_tokens: int) -> int:
        bucket = next((b for b in self.buckets if b >= num_tokens), None)
        if bucket is None or num_tokens < 1:
            raise ValueError(f"a step of {num_tokens} tokens has no prefill graph bucket (largest {self.max_tokens})")
        return bucket

    def capture_all(self) -> None:
        """Capture every bucket now (the warm-up), each way its cores can run, largest first: later buckets reuse
        its pool's memory."""
        for tokens in reversed(self.buckets):
            for cores in (PAUSED, OWN_KEYS, GATHERED_KEYS):
                if self.disabled or (cores != PAUSED and not self.cores_inside):
                    break
                if (tokens, cores) not in self._graphs:
                    self._capture(tokens, cores)

    # --- capture ---

    def _allocate(self, pauses: list[AttentionCore | Boundary]) -> _Buffers:
        """Static buffers shaped after one eager pass's pauses, for `max_tokens` rows."""
        n, device = self.max_tokens, self.kv_cache.device
        core = next(p for p in pauses if isinstance(p, AttentionCore))
        boundary = next((p for p in pauses if isinstance(p, Boundary)), None)
        routing = boundary.routing if boundary is not None else None
        hidden_size = self.model.config.hidden_size
        attention_shape = (n, core.q.shape[1], self.model.config.v_head_dim)

        def like(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros((n, *t.shape[1:]), dtype=t.dtype, device=device)

        return _Buffers(
            input_ids=torch.zeros(n, dtype=torch.long, device=device),
            positions=torch.zeros(n, dtype=torch.long, device=device),
            slot_mapping=torch.full((n,), self.kv_cache.scratch_row, dtype=torch.long, device=device),
            q=like(core.q),
            kv_c=like(core.kv_c),
            k_pe=like(core.k_pe),
            attention=torch.zeros(attention_shape, dtype=core.q.dtype, device=device),
            hidden=torch.zeros(n, hidden_size, dtype=core.q.dtype, device=device),
            topk_ids=None if routing is None else like(routing.topk_ids),
            topk_weights=None if routing is None else like(routing.topk_weights),
            answer=torch.zeros(n, hidden_size, dtype=core.q.dtype, device=device),
            real=torch.ones(n, dtype=torch.bool, device=device),
        )

    def _pieces(self, tokens: int, cores: str) -> Segments:
        """The forward over the static buffers; its cores read the bucket's `GraphedLayout` of kind `cores`, or
        (PAUSED) it pauses at each (the row-wise pieces read nothing of the batch but its slot mapping)."""
        buf = self._buffers
        layout = None if cores == PAUSED else self._layout.layout(tokens, cores)
        batch = Batch(slot_mapping=buf.slot_mapping[:tokens], graphed=layout)
        segments = self.model.forward_segments(
            buf.input_ids[:tokens], buf.positions[:tokens], batch, self.kv_cache, pause_at_attention=layout is None
        )
        return segments if self.ffn_model is None else self._moe_inside(segments, tokens)

    def _moe_inside(self, segments: Segments, tokens: int) -> Segments:
        """`segments` with every boundary answered in place by the local MoE on all `tokens` rows: what is left
        pauses only at the attention cores."""
        answer = None
        while True:
            pause, output = resume(segments, answer)
            if pause is None:
                return output
            answer = self._moe(pause, tokens) if isinstance(pause, Boundary) else (yield pause)

    def _moe(self, boundary: Boundary, tokens: int) -> torch.Tensor:
        """A boundary layer's MLP on the FFN model, its padding rows routed to no expert (id -1, weight 0): the
        fixed-shape path sorts their pairs after every expert group, so they add nothing and cost no expert FLOPs.
        Device work only: the mask is a static buffer, never read on the host."""
        ffn, layer_idx, x = self.ffn_model, boundary.layer_idx, boundary.hidden
        routing = boundary.routing
        if routing is None and ffn.config.is_moe_layer(layer_idx):  # the gate on the FFN side
            routing = ffn.route(layer_idx, x)
        if routing is not None:
            real = self._buffers.real[:tokens, None]  # [Tp, 1]
            routing = Routing(
                torch.where(real, routing.topk_ids, -1), torch.where(real, routing.topk_weights, 0.0)
            )  # [Tp, K] each
        return ffn(layer_idx, x, routing)  # [Tp, H]

    def _stash(self, pause: AttentionCore | Boundary, tokens: int) -> tuple[str, int]:
        """Copy what crosses `pause` into the static buffers (recorded into the piece being captured)."""
        buf = self._buffers
        if isinstance(pause, AttentionCore):
            buf.q[:tokens].copy_(pause.q)
            buf.kv_c[:tokens].copy_(pause.kv_c)
            buf.k_pe[:tokens].copy_(pause.k_pe)
            return "core", pause.layer_idx
        buf.hidden[:tokens].copy_(pause.hidden)
        if pause.routing is not None:
            buf.topk_ids[:tokens].copy_(pause.routing.topk_ids)
            buf.topk_weights[:tokens].copy_(pause.routing.topk_weights)
        return "boundary", pause.layer_idx

    def _resume_value(self, kind: str, tokens: int) -> torch.Tensor:
        return self._buffers.attention[:tokens] if kind == "core" else self._buffers.answer[:tokens]

    def _eager_pass(self, tokens: int, cores: str) -> list[AttentionCore | Boundary]:
        """One pass of the pieces at `tokens` rows, pauses answered with the static buffers (lazy initialisation,
        autotuning, the fused weights); returns its pauses."""
        if self._buffers is None:  # shapes from a pass that answers with fresh zeros
            pauses, pieces = (
                [],
                self.model.forward_segments(
                    torch.zeros(tokens, dtype=torch.long, device=self.kv_cache.device),
                    torch.zeros(tokens, dtype=torch.long, device=self.kv_cache.device),
                    Batch(slot_mapping=torch.full((tokens,), self.kv_cache.scratch_row, device=self.kv_cache.device)),
                    self.kv_cache,
                    pause_at_attention=True,
                ),
            )
            pause, _ = resume(pieces, None)
            while pause is not None:
                pauses.append(pause)
                answer = (
                    pause.q.new_zeros(tokens, pause.q.shape[1], self.model.config.v_head_dim)
                    if isinstance(pause, AttentionCore)
                    else torch.zeros_like(pause.hidden)
                )
                pause, _ = resume(pieces, answer)
            self._buffers = self._allocate(pauses)
        pauses, pieces = [], self._pieces(tokens, cores)
        pause, _ = resume(pieces, None)
        while pause is not None:
            pauses.append(pause)
            pause, _ = resume(pieces, self._resume_value(self._stash(pause, tokens)[0], tokens))
        return pauses

    def _capture(self, tokens: int, cores: str) -> _Graph | None:
        start = time.perf_counter()
        key = (tokens, cores)
        if self._buffers is not None:  # the passes below write the cache: only ever the scratch row
            self._buffers.input_ids.zero_()
            self._buffers.positions.zero_()
            self._buffers.slot_mapping.fill_(self.kv_cache.scratch_row)
            self._buffers.real.fill_(True)  # warm-ups route every row, so expert kernels compile and tune
        if cores != PAUSED:  # no decode, no prompt: the cores attend to nothing real
            self._layout.fill(Batch(), tokens, cores)
        try:
            if not self.capture:
                self._eager_pass(tokens, cores)
                self._graphs[key] = _Graph(tokens, [], cores)
                return self._graphs[key]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._eager_pass(tokens, cores)
            torch.cuda.current_stream().wait_stream(side)
            graph = _Graph(tokens, [], cores)
            pieces, answer = self._pieces(tokens, cores), None
            while True:
                piece = torch.cuda.CUDAGraph()
                with torch.cuda.graph(piece, pool=self._pool):
                    pause, graph.output = resume(pieces, answer)
                    if pause is not None:
                        kind = self._stash(pause, tokens)
                        del pause  # its tensors go back to the pool once the generator moves on
                graph.graphs.append(piece)
                if graph.output is not None:
                    break
                graph.pauses.append(kind)
                answer = self._resume_value(kind[0], tokens)
            torch.cuda.synchronize()
        except RuntimeError:
            if cores != PAUSED:
                logger.exception("capturing the attention cores in the prefill graphs of %d tokens failed", tokens)
                self.cores_inside = False  # the pieces that pause at them still serve every step
            else:
                logger.exception(
                    "capturing the prefill CUDA graphs of %d tokens failed; prompt steps run eager", tokens
                )
                self.disabled = True
            return None
        self._graphs[key] = graph
        logger.info(
            "captured the prefill CUDA graphs (%d pieces%s) of %d tokens in %.0f ms (%d graphs)",
            len(graph.graphs),
            "" if cores == PAUSED else f", attention cores inside, {cores}",
            tokens,
            (time.perf_counter() - start) * 1e3,
            len(self._graphs),
        )
        return graph

    # --- replay ---

    def segments(self, batch: Batch, input_ids: torch.Tensor, positions: torch.Tensor) -> Segments | None:
        """The step's forward as `forward_segments` gives it (boundaries of its T rows, answers [T, H], output
        [T, H]), replayed from the graphs of its bucket; None when they could not be captured (run it eagerly).
        `batch` is prepared (`PagedLatentCache.prepare`): its slot mapping and decode rows are read here."""
        tokens = input_ids.shape[0]
        bucket = self.bucket(tokens)
        cores = self._layout.kind(batch, bucket) if self.cores_inside else PAUSED
        graph = self._graphs.get((bucket, cores)) or self._capture_on_miss(bucket, cores)
        if graph is None and cores != PAUSED:  # the cores could not be captured: the pieces that pause at them
            cores = PAUSED
            graph = self._graphs.get((bucket, cores)) or self._capture_on_miss(bucket, cores)
        if graph is None:
            return None
        if cores != PAUSED:
            self._layout.fill(batch, bucket, cores, self.kv_cache)
        self.steps_by_cores[cores] += 1
        buf = self._buffers
        buf.input_ids[:tokens].copy_(input_ids)
        buf.positions[:tokens].copy_(positions)
        buf.slot_mapping[:tokens].copy_(batch.slot_mapping)
        padded = graph.tokens
        if self.ffn_model is not None:
            buf.real[:tokens].fill_(True)
            buf.real[tokens:padded].fill_(False)  # routed to no expert
        if padded > tokens:  # rows a larger step left: token 0 at position 0, written to the scratch row
            buf.input_ids[tokens:padded].zero_()
            buf.positions[tokens:padded].zero_()
            buf.slot_mapping[tokens:padded].fill_(self.kv_cache.scratch_row)
        return self._replay(graph, batch, tokens)

    def _capture_on_miss(self, tokens: int, cores: str) -> _Graph | None:
        """A capture inside a step (what the warm-up did not capture), counted in `captured_while_serving`."""
        graph = self._capture(tokens, cores)
        self.captured_while_serving += graph is not None
        return graph

    def _replay(self, graph: _Graph, batch: Batch, tokens: int) -> Generator[Boundary, torch.Tensor, torch.Tensor]:
        if not graph.graphs:  # capture=False: the same padded pieces, eagerly
            pieces = self._pieces(graph.tokens, graph.cores)
            pause, output = resume(pieces, None)
            while pause is not None:
                kind, layer_idx = self._stash(pause, graph.tokens)
                yield from self._between(kind, layer_idx, batch, tokens)
                pause, output = resume(pieces, self._resume_value(kind, graph.tokens))
            return output[:tokens]
        for piece, (kind, layer_idx) in zip(graph.graphs, graph.pauses, strict=False):
            piece.replay()
            yield from self._between(kind, layer_idx, batch, tokens)
        graph.graphs[-1].replay()
        return graph.output[:tokens]

    def _between(self, kind: str, layer_idx: int, batch: Batch, tokens: int) -> Generator[Boundary, torch.Tensor, None]:
        """What runs eagerly at a pause, on the real rows: the attention core, or the exchange (yielded)."""
        buf = self._buffers
        if kind == "core":
            self.model.layers[layer_idx].self_attn.attend(
                buf.q[:tokens], buf.kv_c[:tokens], buf.k_pe[:tokens], batch, self.kv_cache, out=buf.attention[:tokens]
            )
            return
        routing = None if buf.topk_ids is None else Routing(buf.topk_ids[:tokens], buf.topk_weights[:tokens])
        answer = yield Boundary(layer_idx, buf.hidden[:tokens], routing)
        buf.answer[:tokens].copy_(answer)
