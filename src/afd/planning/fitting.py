"""`afd profile`'s fits, pure: the rows it measured on a machine → the profile's parts.

Why apart from the measuring (`afd.planning.measure`): a profile keeps its rows (`Profile.measured`), so when a
part's model changes, `afd profile --refit P.json` fits them again without the device that measured them; and the
fits are tested without processes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from afd.buckets import path_rows
from afd.planning import costs
from afd.planning.profile import Part, Profile, fit_part, relative_errors

logger = logging.getLogger(__name__)
STEP_BUDGET, STEP_SEQS = 8192, 1024  # the largest step `afd bench step` builds graphs for (its buckets below them)


@dataclass(frozen=True)
class Measured:
    """What `afd profile` measured: one MoE layer's routed passes `(bytes, flops, seconds, tokens)` with every
    expert and with half, the shared experts' `(bytes, flops, seconds)`, whole steps (decode: batch, context,
    seconds; prefill: batch, context, tokens, seconds; mixed: decodes, context, chunk, seconds) and each connector's
    exchange round trips `(bytes, seconds)`, on `device` ("cuda" or "cpu")."""

    device: str
    routed: list[list[float]] = field(default_factory=list)
    shared: list[list[float]] = field(default_factory=list)
    decode: list[dict] = field(default_factory=list)
    prefill: list[dict] = field(default_factory=list)
    mixed: list[dict] = field(default_factory=list)
    exchange: dict[str, list[list[float]]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Measured:
        return cls(**d)


def format_residuals(
    name: str, labels: list[str], part: Part, rows, items: list[float] | None = None, context: list[float] | None = None
) -> str:
    """The fit and, per row, measured against fitted time and the relative error."""
    errs = relative_errors(part, rows, items, context)
    counts = items if items is not None else [0.0] * len(rows)
    tokens = context if context is not None else [0.0] * len(rows)
    lines = [f"{name} fit: {part}"]
    for label, (b, f, sec), n, c, e in zip(labels, rows, counts, tokens, errs, strict=True):
        fit = part.time(b, f, n, c)
        lines.append(f"  {label:<24} measured {sec * 1e3:9.3f} ms  fit {fit * 1e3:9.3f} ms  {e:6.1%}")
    lines.append(f"  worst {max(errs, default=0.0):.1%}")
    return "\n".join(lines)


def routed_parts(rows: list[list[float]], s: costs.Shapes, device: str) -> dict[str, Part]:
    """The routed experts' fit from `(bytes, flops, seconds, tokens)` rows: on a GPU one per side of the kernels'
    bound, whose paths cost differently (on an H200 the grouped GEMM's fixed cost lifts a 320-token step's experts
    by ~4.5 ms over the kernels'); on a CPU one (the exact loop runs at every size)."""
    bound = costs.kernel_max_pairs()
    within = [tuple(r[:3]) for r in rows if device != "cuda" or path_rows(int(r[3])) * s.topk <= bound]
    past = [tuple(r[:3]) for r in rows if device == "cuda" and path_rows(int(r[3])) * s.topk > bound]
    parts = {"routed_experts": fit_part(within)}
    if len(past) >= 2:
        parts["routed_experts_grouped"] = fit_part(past)
    return parts


def fit_parts(
    m: Measured, s: costs.Shapes, say: Callable[[str], None] = logger.info
) -> tuple[dict[str, Part], dict[str, str]]:
    """(parts, assumed) fitted from `m`: the experts, the attention side of a decode step (the step less its experts
    at the same shapes), the prefill part (what prompt tokens add beyond the experts and a decode step's attention
    side), each measured connector's round trip; p2p's taken from async's where only async was measured (named in
    `assumed`). `say` gets every fit with its rows' residuals."""
    shared = fit_part([tuple(r) for r in m.shared]) if m.shared else Part()
    parts = {"shared_experts": shared, **routed_parts(m.routed, s, m.device)}
    p = Profile({}, parts)
    say("routed experts fit: " + ", ".join(f"{k}: {v}" for k, v in parts.items() if k.startswith("routed")))
    for nbytes, flops, sec, t in m.routed:
        fit = p.part(costs.routed_part(p, s, t)).time(nbytes, flops)
        label = f"{int(t)} tokens, {nbytes / s.expert_params / s.weight_bytes:.1f} experts touched"
        say(f"  {label:<36} measured {sec * 1e3:8.3f} ms  fit {fit * 1e3:8.3f} ms")

    def experts_s(tokens: int, prompt: bool = True) -> float:
        """Every MoE layer's routed and shared experts for a step of `tokens` tokens (a whole replica's), inside its
        graph's bucket (the step rows came from `afd bench step`'s graphs: 8,192 tokens, 1,024 sequences at most)."""
        rows = costs.graph_tokens(tokens, prompt, STEP_BUDGET, STEP_SEQS)
        routed = costs.routed_pass_s(p, s, tokens, s.num_experts, rows)
        return s.moe_layers * (routed + costs.shared_pass_s(p, s, tokens))

    attn_rows, batches, contexts, labels = [], [], [], []
    for row in m.decode:
        b, ctx = row["batch"], row["batch"] * (row["context"] + 1)
        sec = row["seconds"] - experts_s(b, prompt=False)
        attn_rows.append((costs.decode_bytes(s, ctx), costs.decode_flops(s, b, ctx), max(sec, 1e-6)))
        batches.append(float(b))
        contexts.append(float(ctx))
        labels.append(f"batch {b} context {row['context']}")
    # against batch and total context: the per-row cost (python, sampling) and the core's per cached token (one
    # peak for the linears' and the core's FLOPs put V3's layers 13-18% short at 4K context) beside bytes and FLOPs
    attention = fit_part(attn_rows, items=batches, context=contexts, relative=True)
    say(format_residuals("attention_decode", labels, attention, attn_rows, batches, contexts))
    prefill_rows, labels = [], []
    for row in m.prefill:
        t, pairs = row["tokens"], row["batch"] * costs.chunk_pairs(0, row["context"])
        left = row["seconds"] - experts_s(t) - attention.time(costs.decode_bytes(s, 0), 0.0)
        prefill_rows.append((0.0, costs.prefill_flops(s, t, pairs), max(left, 1e-6)))
        labels.append(f"prefill {row['batch']} x {row['context']}")
    # a prompt chunk beside decodes (the steps serving is full of): what it adds beyond the decodes' attention side
    # and every token's experts is the prefill part too, as the simulator composes such a step
    for row in m.mixed:
        b, chunk = row["decodes"], row["chunk"]
        ctx = b * (row["context"] + 1)
        decodes = attention.time(costs.decode_bytes(s, ctx), costs.decode_flops(s, b, ctx), b, ctx)
        left = row["seconds"] - experts_s(b + chunk) - decodes
        prefill_rows.append((0.0, costs.prefill_flops(s, chunk, costs.chunk_pairs(0, chunk)), max(left, 1e-6)))
        labels.append(f"{chunk} beside {b} at {row['context']}")
    # a fixed cost too: on an H200 a lone 512-token prompt left 5.8 ms beyond its experts, which no per-token
    # rate fitting 2,048 and 8 x 1,024 tokens explains (the fit without it was 64% short there). Against FLOPs, not
    # tokens: a per-token cost of this model would carry unchanged to a larger one's shapes (afd plan's V2 and V3)
    prefill = fit_part(prefill_rows, relative=True)
    say(format_residuals("prefill", labels, prefill, prefill_rows))
    parts.update({"attention_decode": attention, "prefill": prefill})
    assumed = {}
    for connector, rows in m.exchange.items():
        parts[f"exchange_{connector}"] = fit_part([(b, 0.0, sec) for b, sec in rows])
    if "async" in m.exchange and "p2p" not in m.exchange:
        parts["exchange_p2p"] = parts["exchange_async"]
        assumed["exchange_p2p"] = "not measured (one GPU; p2p needs two): async's round trip stands in"
        if m.device == "cuda":  # async's two ranks took turns on the one GPU: what co-located deployments pay
            parts["exchange_colocated"] = parts["exchange_async"]
    parts["launch"], parts["host"] = Part(), Part()
    return parts, assumed


def refit_profile(profile: Profile, say: Callable[[str], None] = logger.info) -> Profile:
    """`profile` with its parts fitted again from the rows it keeps (`Profile.measured`), by this code's models, and
    its calibration fitted again to the served trace it keeps, on those parts. The parts it did not measure (an
    exchange put in from elsewhere, `machine.assumed`) are fitted from its own rows too. ValueError when it keeps
    no rows (a profile written before it did, or by hand)."""
    from dataclasses import replace

    from afd.bench.workload import Workload
    from afd.model.weights import load_model_config
    from afd.planning import calibrate
    from afd.planning.deployment import Deployment

    if "parts" not in profile.measured:
        raise ValueError("it keeps no measured rows (written before afd profile kept them): measure it again")
    measured = Measured.from_json(profile.measured["parts"])
    config = load_model_config(profile.machine.get("model", "deepseek-v2-lite"))
    s = costs.shapes_of(config, profile.dtype)
    parts, assumed = fit_parts(measured, s, say)
    machine = {k: v for k, v in profile.machine.items() if k != "assumed"}
    out = replace(profile, parts=parts, machine={**machine, **({"assumed": assumed} if assumed else {})})
    kept = profile.measured.get("calibration")
    if not kept or not profile.calibration.fit:
        return out
    described = dict(profile.calibration.fit["trace"])  # the workload as served, whatever the trace is now
    rates = tuple(float(r) for r in described.pop("rates"))
    trace = calibrate.Trace(Workload(**described), rates)
    d = Deployment("none", max_num_seqs=kept["max_num_seqs"], max_num_batched_tokens=kept["max_num_batched_tokens"])
    runs = [{"rate": float(r["rate"]), "summary": r["summary"]} for r in kept["runs"]]
    cal = calibrate.fit_calibration(out, s, d, trace, runs, config.vocab_size)
    say(calibrate.format_calibration(cal))
    return replace(out, calibration=cal)
