"""A deployment to simulate or plan, and the seconds of one step of it (`StepCosts`), from shapes and a profile.

Kinds (`connector`):
- `none`: `replicas` whole-model replicas, one GPU each, independent.
- `p2p`: `replicas` groups of `attention`A`ffn`F, one rank per GPU; each group's replicas step in lockstep waves
  (the FFN ranks wait for every replica's rows of a layer); no micro-batches (afd's p2p has none).
- `async`: the same groups, replicas free-running; an FFN rank batches the rows of every replica waiting at once
  (cross-replica batching); `ubatches` micro-batches ping-pong on eager (prefill or mixed) steps, as afd does, and on
  decode steps too with `ubatch_decode` (a prediction: afd replays decode steps whole from CUDA graphs).
- `ep`: the non-AFD baseline, data-parallel attention with expert-parallel MoE on every one of `attention` GPUs
  (an expert all-to-all per layer, lockstep); `ubatches` 2 is two-batch overlap of compute and communication.
"""

from __future__ import annotations

from dataclasses import dataclass

from afd.planning import costs
from afd.planning.costs import Shapes
from afd.planning.profile import Profile
from afd.runtime.limits import DEFAULT_MAX_NUM_SEQS, SMALL_BUDGET

CONNECTORS = ("none", "p2p", "async", "ep")


class DeploymentError(ValueError):
    """A deployment that cannot run (does not fit, or an unsupported combination), in one sentence."""


@dataclass(frozen=True)
class Deployment:
    connector: str
    attention: int = 1
    ffn: int = 1
    replicas: int = 1
    ubatches: int = 1
    gpus_per_node: int = 8
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = SMALL_BUDGET
    block_size: int = 16
    colocated: bool = False  # AFD ranks of a group share its GPUs (A + F ranks on max(A, F) GPUs): work serializes
    ubatch_decode: bool = False

    def __post_init__(self) -> None:
        if self.connector not in CONNECTORS:
            raise DeploymentError(f"connector {self.connector!r} is not one of {', '.join(CONNECTORS)}")
        if min(self.attention, self.ffn, self.replicas, self.ubatches) < 1:
            raise DeploymentError("attention, ffn, replicas and ubatches must be at least 1")
        if self.connector == "p2p" and self.ubatches > 1:
            raise DeploymentError("p2p has no micro-batches in afd; use --connector async for --ubatches > 1")

    @property
    def num_replicas(self) -> int:
        """Attention replicas (engines) in the whole deployment."""
        if self.connector == "none":
            return self.replicas
        return self.replicas * self.attention

    @property
    def group_ranks(self) -> int:
        if self.connector in ("p2p", "async"):
            return max(self.attention, self.ffn) if self.colocated else self.attention + self.ffn
        return self.attention if self.connector == "ep" else 1

    @property
    def gpus(self) -> int:
        return self.group_ranks * (1 if self.connector == "ep" else self.replicas)

    @property
    def lockstep(self) -> bool:
        return self.connector in ("p2p", "ep")

    @property
    def name(self) -> str:
        if self.connector == "none":
            return f"none R={self.replicas}"
        if self.connector == "ep":
            return f"ep DP{self.attention}" + (f" m={self.ubatches}" if self.ubatches > 1 else "")
        groups = f"{self.replicas}x " if self.replicas > 1 else ""
        m = f" m={self.ubatches}" if self.ubatches > 1 else ""
        return f"{self.connector} {groups}{self.attention}A{self.ffn}F{m}"

    def describe(self) -> dict:
        return {
            "connector": self.connector,
            "attention": self.attention,
            "ffn": self.ffn if self.connector in ("p2p", "async") else 0,
            "replicas": self.replicas,
            "ubatches": self.ubatches,
            "gpus": self.gpus,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
        }


@dataclass(frozen=True)
class Memory:
    """Weights per rank and the latent-cache tokens of one attention replica."""

    attention_weight_bytes: float
    ffn_weight_bytes: float  # the largest FFN rank's (ep: the per-GPU expert share)
    kv_tokens_per_replica: int


def memory_of(d: Deployment, s: Shapes, gpu_bytes: float) -> Memory:
    """What each rank holds, and the cache left to a replica; DeploymentError when a rank's weights do not fit."""
    budget = d.max_num_batched_tokens
    if d.connector == "none":
        w = s.total_weight_bytes()
        kv = costs.kv_capacity_tokens(s, gpu_bytes, w, budget)
        if kv < 0:
            raise DeploymentError(
                f"a whole replica's {w / 1e9:.0f} GB of weights do not fit one {gpu_bytes / 1e9:.0f} GB GPU"
            )
        return Memory(w, 0.0, kv)
    if d.connector == "ep":
        local = -(-s.num_experts // d.attention)
        w = s.attention_weight_bytes() + s.ffn_weight_bytes(local)
        kv = costs.kv_capacity_tokens(s, gpu_bytes, w, budget)
        if kv < 0:
            raise DeploymentError(
                f"{d.attention} GPUs of attention + {local} experts each ({w / 1e9:.0f} GB) do not fit"
            )
        return Memory(s.attention_weight_bytes(), s.ffn_weight_bytes(local), kv)
    local = -(-s.num_experts // d.ffn)
    ffn_w, attn_w = s.ffn_weight_bytes(local), s.attention_weight_bytes()
    if d.colocated:  # an attention rank and an FFN rank on one GPU: the cache gets what both leave
        kv = costs.kv_capacity_tokens(s, gpu_bytes, attn_w + ffn_w + costs.DEVICE_OVERHEAD_BYTES, budget)
    else:
        if not costs.fits(gpu_bytes, ffn_w):
            raise DeploymentError(f"an FFN rank's {local} experts ({ffn_w / 1e9:.0f} GB) do not fit one GPU; raise F")
        kv = costs.kv_capacity_tokens(s, gpu_bytes, attn_w, budget)
    if kv < 0:
        raise DeploymentError(f"an attention rank's weights ({attn_w / 1e9:.0f} GB) leave no room for a cache")
    return Memory(attn_w, ffn_w, kv)


@dataclass(frozen=True)
class StepLoad:
    """What one replica's step holds: decode rows over `ctx` cached latents, prompt tokens with attended pairs."""

    batch: int
    ctx: float
    prefill: int
    pairs: float
    seqs: int
    emitted: int = 0  # tokens the step streams out (decodes, and prompts it completes)
    admitted: int = 0  # requests the step admits
    held: int = 0  # requests the replica holds while the step runs (running and waiting)

    @property
    def tokens(self) -> int:
        return self.batch + self.prefill


class StepCosts:
    """Seconds of a step of `deployment` on `profile`'s machine: `replica_step(load, group_tokens)` for free-running
    replicas (none, async), `wave(loads)` for lockstep ones (p2p, ep)."""

    def __init__(self, d: Deployment, s: Shapes, p: Profile, ep_scale: float = 1.0) -> None:
        self.d, self.s, self.p = d, s, p
        self.ep_scale = ep_scale  # ep: the simulated replicas stand for ep_scale times as many
        self.layers = max(s.moe_layers, 1)
        host = p.part("host")
        self._host_fixed, self._host_item = host.fixed_s, host.per_item_s
        self._launch = p.part("launch").fixed_s
        span = d.attention if d.connector == "ep" else d.group_ranks
        self.cross_node = span > d.gpus_per_node

    def _host(self, load: StepLoad) -> float:
        serving = costs.serving_s(self.p.calibration, load.emitted, load.admitted, load.held)
        return self._host_fixed + self._host_item * load.seqs + serving

    def _attention(self, load: StepLoad) -> float:
        return costs.attention_step_s(self.p, self.s, load.batch, load.ctx, load.prefill, load.pairs)

    def _ffn_layer(self, tokens: float, num_ranks: int, graph_tokens: float | None = None) -> float:
        """One MoE layer's pass on one of `num_ranks` FFN ranks for `tokens` tokens of every replica together
        (`graph_tokens`: the graph's rows, padding included, where the step replays one: `costs.routed_pass_s`)."""
        local = -(-self.s.num_experts // num_ranks)
        return costs.routed_pass_s(self.p, self.s, tokens, local, graph_tokens) + costs.shared_pass_s(
            self.p, self.s, tokens / num_ranks
        )

    def _ubatches(self, load: StepLoad) -> int:
        m = self.d.ubatches
        if m > 1 and load.prefill == 0 and not self.d.ubatch_decode:
            return 1  # a pure decode step replays its graphs whole
        return max(1, min(m, load.seqs))

    def replica_step(self, load: StepLoad, group_tokens: float = 0.0) -> float:
        """A free-running replica's step; `group_tokens`: tokens of every replica of its group in flight (async)."""
        if load.tokens == 0:
            return 0.0
        attn = self._attention(load)
        if self.d.connector == "none":
            d = self.d  # the experts run inside the replica's graphs, padded to its bucket
            rows = costs.graph_tokens(load.tokens, load.prefill > 0, d.max_num_batched_tokens, d.max_num_seqs)
            return self._floor(load, attn + self.layers * self._ffn_layer(load.tokens, 1, rows) + self._host(load))
        m = self._ubatches(load)
        group = max(group_tokens, load.tokens)
        a = attn / self.layers / m + (self._launch if m > 1 else 0.0)
        f = self._ffn_layer(group / m, self.d.ffn)
        c = self._wire(load.tokens / m, group / m)
        if self.d.colocated:
            return self._floor(load, self.layers * m * (a + f) + self.layers * c + self._host(load))
        return self._floor(load, self.layers * costs.layer_cycle_s(a, f, c, m) + self._host(load))

    def _floor(self, load: StepLoad, seconds: float) -> float:
        """A step holding prompt tokens lasts at least the calibration's `prompt_step_s`."""
        return max(seconds, self.p.calibration.prompt_step_s) if load.prefill else seconds

    def _wire(self, tokens: float, group_tokens: float) -> float:
        """One layer's round trip of a replica's `tokens`, the FFN rank's link carrying `group_tokens`' rows."""
        d, s = self.d, self.s
        part = self.p.part("exchange_p2p" if d.connector == "p2p" else "exchange_async")
        if d.colocated and "exchange_colocated" in self.p.parts:
            part = self.p.parts["exchange_colocated"]
        nbytes = max(
            costs.exchange_bytes(s, d.connector, tokens, d.ffn),
            costs.exchange_bytes(s, d.connector, group_tokens, d.ffn) / d.ffn,
        )
        t = costs.wire_s(part, nbytes, cross_node=self.cross_node, link=self.p.link)
        if d.connector == "p2p" and d.ffn > 1:  # the FFN ranks' expert all-to-all
            t += costs.wire_s(
                part,
                costs.all_to_all_bytes(s, group_tokens / d.ffn, d.ffn),
                cross_node=self.cross_node,
                link=self.p.link,
            )
        return t

    def wave(self, loads: list[StepLoad]) -> float:
        """A lockstep wave of one group's replicas (p2p) or of every GPU (ep): each layer waits for the slowest."""
        active = [x for x in loads if x.tokens]
        if not active:
            return 0.0
        with_prompt = max(active, key=lambda x: x.prefill)
        return self._floor(with_prompt, self._wave(active))

    def _wave(self, active: list[StepLoad]) -> float:
        slowest = max(active, key=self._attention)
        tokens = sum(x.tokens for x in active)
        host = max(self._host(x) for x in active)
        if self.d.connector == "p2p":
            a = self._attention(slowest) / self.layers
            return self.layers * (a + self._wire(slowest.tokens, tokens) + self._ffn_layer(tokens, self.d.ffn)) + host
        # ep: every GPU runs its replica's attention, then its experts over every GPU's rows, around an all-to-all
        n, m = self.d.attention, max(1, min(self.d.ubatches, slowest.seqs))
        a = self._attention(slowest) / self.layers / m + (self._launch if m > 1 else 0.0)
        f = self._ffn_layer(tokens * self.ep_scale / m, n)
        part = self.p.part("exchange_async")
        c = costs.wire_s(
            part, costs.all_to_all_bytes(self.s, slowest.tokens / m, n), cross_node=self.cross_node, link=self.p.link
        )
        if m == 1:
            return self.layers * (a + c + f) + host
        return self.layers * max(m * (a + f), m * c, a + c + f) + host
