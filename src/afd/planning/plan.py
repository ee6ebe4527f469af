"""`afd plan`: the deployments of N GPUs that fit, narrowed by the closed-form ratio, scored by the simulator.

Kinds: whole replicas (`none`), AFD groups `xAyF` (p2p; async with 1–3 micro-batches) replicated over the GPUs,
and the non-AFD baseline `ep` (data-parallel attention + expert-parallel MoE on every GPU, with and without
two-batch overlap). A candidate's score is its SLO-compliant output tokens/s per GPU: the highest arrival rate
whose p90 TTFT and p50 TPOT meet the SLO (bisection over rates, one simulated group standing for all of them).
With `decode_only` (prompts prefilled elsewhere, as a prefill-decode disaggregated cluster's decode side runs) it
is the steady state instead: every replica at the largest batch its cache holds and whose decode step meets the
TPOT bound (`decode_score`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from afd.bench.workload import Workload
from afd.planning import ratio
from afd.planning.costs import Shapes
from afd.planning.deployment import Deployment, DeploymentError, StepCosts, StepLoad, memory_of
from afd.planning.profile import Profile
from afd.planning.simulator import simulate_rate

RATE_STEPS = 7  # bisection steps of the SLO-compliant rate
SHAPES_KEPT_PER_CONNECTOR = 3  # AFD shapes per connector and group size kept after the closed-form narrowing


@dataclass(frozen=True)
class Slo:
    ttft_p90_s: float = 5.0
    tpot_p50_s: float = 0.05


def _meets(summary: dict, slo: Slo) -> bool:
    tpot = summary["tpot_p50_s"]
    return (
        summary["errors"] == 0
        and summary["ttft_p90_s"] is not None
        and summary["ttft_p90_s"] <= slo.ttft_p90_s
        and (tpot is None or tpot <= slo.tpot_p50_s)
    )


def units(d: Deployment) -> int:
    """Independent units the router spreads the load over, each simulated alike (none: replicas; AFD: groups)."""
    return 1 if d.connector == "ep" else d.replicas


def score(d: Deployment, s: Shapes, p: Profile, workload: Workload, slo: Slo) -> dict:
    """The candidate's SLO-compliant output tokens/s per GPU and what was measured at that rate."""
    one = replace(d, replicas=1) if d.connector != "ep" else d
    lens = [len(x) for x in workload.prompts(2)]
    n = units(d)

    def run(rate: float) -> dict:
        return simulate_rate(one, s, p, workload, lens, rate)["summary"]

    top = run(math.inf)
    capacity = top["request_throughput"]
    best, at = 0.0, None
    if _meets(top, slo):
        best, at = capacity, top
    else:
        lo, hi = 0.0, capacity
        for _ in range(RATE_STEPS):
            mid = (lo + hi) / 2
            summary = run(mid)
            if _meets(summary, slo):
                lo, best, at = mid, mid, summary
            else:
                hi = mid
    out_tok = at["output_tok_s"] * n if at else 0.0
    shown = at or top
    return {
        **d.describe(),
        "name": d.name,
        "tokens_per_s_per_gpu": out_tok / d.gpus,
        "slo_rate": best * n,
        "capacity_req_s": capacity * n,
        "ttft_p90_s": shown["ttft_p90_s"],
        "tpot_p50_s": shown["tpot_p50_s"],
        "meets_slo": at is not None,
    }


def decode_step_s(d: Deployment, s: Shapes, p: Profile, batch: int, ctx: int) -> float:
    """Seconds of a decode step with every attention replica of a unit (a group, or every GPU of `ep`) at `batch`
    sequences of `ctx` tokens: each emits one token, so this is the TPOT of the steady state."""
    load = StepLoad(batch=batch, ctx=batch * ctx, prefill=0, pairs=0.0, seqs=batch, emitted=batch, held=batch)
    cost = StepCosts(d, s, p)
    if d.lockstep:
        return cost.wave([load] * d.attention)
    return cost.replica_step(load, d.attention * batch if d.connector == "async" else 0.0)


def decode_score(d: Deployment, s: Shapes, p: Profile, ctx: int, slo: Slo) -> dict:
    """The candidate's steady-state decode output tokens/s per GPU: each replica at the largest batch that its
    cache holds (blocks of `ctx` tokens per sequence), `max_num_seqs` allows and whose step meets the TPOT bound."""
    per_seq = -(-ctx // d.block_size) * d.block_size
    held = min(d.max_num_seqs, memory_of(d, s, p.gpu_memory_bytes).kv_tokens_per_replica // per_seq)
    lo, hi = 0, held
    while lo < hi:  # the step grows with the batch: the largest batch within the bound
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if decode_step_s(d, s, p, mid, ctx) <= slo.tpot_p50_s else (lo, mid - 1)
    batch = lo
    tpot = decode_step_s(d, s, p, max(batch, 1), ctx) if held else None
    replicas, gpus = (1, 1) if d.connector == "none" else (d.attention, d.group_ranks)
    out_tok = replicas * batch / tpot / gpus if batch else 0.0
    return {
        **d.describe(),
        "name": d.name,
        "tokens_per_s_per_gpu": out_tok,
        "batch": batch,
        "batch_held": held,
        "ttft_p90_s": None,
        "tpot_p50_s": tpot,
        "meets_slo": batch > 0,
    }


def candidates(
    num_gpus: int, s: Shapes, p: Profile, base: Deployment, ctx: int, decode_slo: Slo | None = None
) -> list[tuple[Deployment, str]]:
    """(deployment, closed-form bound) of every kind that fits, AFD shapes narrowed by the ratio rule; with
    `decode_slo`, by their steady decode output instead (exact and cheap, where the rule assumes a batch)."""
    out: list[tuple[Deployment, str]] = []

    def fits(d: Deployment) -> bool:
        try:
            memory_of(d, s, p.gpu_memory_bytes)
        except DeploymentError:
            return False
        return True

    none = replace(base, connector="none", replicas=num_gpus, attention=1, ffn=1, ubatches=1)
    if fits(none):
        out.append((none, ""))
    for m in (1, 2):
        ep = replace(base, connector="ep", attention=num_gpus, ffn=num_gpus, replicas=1, ubatches=m)
        if num_gpus > 1 and fits(ep):
            out.append((ep, ""))
    for group in (g for g in range(2, num_gpus + 1) if num_gpus % g == 0):
        # decode steps alone split into micro-batches only with ubatch_decode: without it more would score the same
        async_ms = (1,) if decode_slo is not None and not base.ubatch_decode else (1, 2, 3)
        for connector, ms in (("p2p", (1,)), ("async", async_ms)):
            for m in ms:
                shapes = []
                for ffn in range(1, group):
                    d = replace(base, connector=connector, attention=group - ffn, ffn=ffn, replicas=num_gpus // group)
                    d = replace(d, ubatches=m)
                    if not fits(d):
                        continue
                    if decode_slo is not None:  # the regime is taken at the batch it runs (`plan`)
                        steady = decode_score(d, s, p, ctx, decode_slo)["tokens_per_s_per_gpu"]
                        shapes.append((0.0, -steady, d, ""))
                        continue
                    r = d.attention / d.ffn
                    rule = ratio.optimal_ratio(p, s, connector, ffn, base.max_num_seqs, ctx, m)
                    phi = ratio.per_gpu(p, s, connector, ffn, base.max_num_seqs, ctx, r, m)
                    shapes.append((abs(math.log(r / max(rule.r_star, 1e-3))), -phi, d, rule.bound))
                shapes.sort(key=lambda x: (x[0], x[1]))
                out += [(d, bound) for _, _, d, bound in shapes[:SHAPES_KEPT_PER_CONNECTOR]]
    return out


def _fewest_gpus_hint(s: Shapes, p: Profile, base: Deployment, most: int = 4096) -> str:
    """The refusal's tail naming the smallest GPU count, up to `most`, whose `ep` layout holds the weights (spread
    over every GPU, it is the layout that needs the fewest); empty past `most`."""
    for n in range(2, most + 1):
        try:
            memory_of(replace(base, connector="ep", attention=n, ffn=n, replicas=1, ubatches=1), s, p.gpu_memory_bytes)
        except DeploymentError:
            continue
        return f"; the fewest that do: {n} (`--gpus {n}`)"
    return ""


def plan(
    num_gpus: int, s: Shapes, p: Profile, workload: Workload, slo: Slo, base: Deployment, decode_only: bool = False
) -> dict:
    """Every candidate scored; the best, the best of each kind and the best-AFD / best-non-AFD ratio. `decode_only`:
    each scored at its steady decode state, sequences holding the workload's mean prompt and half its output."""
    ctx = round(sum(len(x) for x in workload.prompts(2)) / workload.num_requests + workload.max_tokens / 2)
    scored = []
    for d, bound in candidates(num_gpus, s, p, base, ctx, slo if decode_only else None):
        row = decode_score(d, s, p, ctx, slo) if decode_only else score(d, s, p, workload, slo)
        if decode_only and d.connector in ("p2p", "async"):  # the regime at the batch it runs
            m = d.ubatches if d.ubatch_decode else 1
            batch = max(row["batch"], 1)
            bound = ratio.bound_at(p, s, d.connector, d.ffn, batch, ctx, d.attention / d.ffn, m)
        if not bound:
            bound = ratio.bound_at(p, s, "async", max(d.ffn, 1), base.max_num_seqs, ctx, 1.0, d.ubatches)
            bound = "attention" if d.connector == "none" else bound
        scored.append({**row, "bound": bound})
    if not scored:
        raise DeploymentError(
            f"no deployment of {num_gpus} GPUs holds the model's {s.total_weight_bytes() / 1e9:.0f} GB of weights"
            + _fewest_gpus_hint(s, p, base)
        )
    scored.sort(key=lambda r: -r["tokens_per_s_per_gpu"])
    kinds = {}
    for row in scored:
        kinds.setdefault(row["connector"], row)
    afd = max((r["tokens_per_s_per_gpu"] for r in scored if r["connector"] in ("p2p", "async")), default=None)
    base_best = max((r["tokens_per_s_per_gpu"] for r in scored if r["connector"] in ("none", "ep")), default=0.0)
    keys = ("connector", "attention", "ffn", "replicas", "ubatches", "tokens_per_s_per_gpu", "ttft_p90_s")
    keys += ("tpot_p50_s", "bound")
    return {
        "gpus": num_gpus,
        "decode_only": {"context": ctx} if decode_only else None,
        "slo": {"ttft_p90_s": slo.ttft_p90_s, "tpot_p50_s": slo.tpot_p50_s},
        "best": {k: scored[0][k] for k in keys} | {"name": scored[0]["name"]},
        "best_of_kind": kinds,
        "afd_over_non_afd": afd / base_best if afd is not None and base_best > 0 else None,  # None: one kind only
        "candidates": scored,
    }


def format_plan(result: dict) -> str:
    decode = result.get("decode_only")
    head = f"{'deployment':<22} {'GPUs':>4} {'tok/s/GPU':>10} {'TTFT p90':>9} {'TPOT p50':>9} {'SLO':>4} "
    lines = [head + ("batch (held) bound" if decode else "bound")]
    for r in result["candidates"]:
        ttft = "-" if r["ttft_p90_s"] is None else f"{r['ttft_p90_s']:.2f}s"
        tpot = "-" if r["tpot_p50_s"] is None else f"{r['tpot_p50_s'] * 1e3:.0f}ms"
        batch = f"{r['batch']} ({r['batch_held']}) " if decode else ""
        lines.append(
            f"{r['name']:<22} {r['gpus']:>4} {r['tokens_per_s_per_gpu']:>10.1f} {ttft:>9} {tpot:>9} "
            f"{'yes' if r['meets_slo'] else 'no':>4} {batch}{r['bound']}"
        )
    if decode:
        lines.append(
            f"decode only: every sequence at {decode['context']:,} tokens of context, prompts prefilled elsewhere"
        )
    b = result["best"]
    lines.append(f"best: {b['name']} ({b['tokens_per_s_per_gpu']:.1f} output tok/s per GPU, {b['bound']}-bound)")
    for kind, r in result["best_of_kind"].items():
        lines.append(f"best {kind}: {r['name']} ({r['tokens_per_s_per_gpu']:.1f} tok/s per GPU)")
    ratio_ = result["afd_over_non_afd"]
    lines.append("best AFD / best non-AFD: " + ("-" if ratio_ is None else f"{ratio_:.2f}x"))
    return "\n".join(lines)


def plot_plans(results: list[dict], path: str) -> None:
    """Output tokens/s per GPU against the GPU count, one colour per (model, weights) of `results` (`afd plan --json`
    files): the best AFD layout (solid) beside the best non-AFD one (dashed), each point labelled with its layout."""
    from afd.bench.report import pyplot

    plt = pyplot()
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(f"{r.get('model', '?')} {r.get('weights', '')}".strip(), []).append(r)
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (label, runs) in enumerate(sorted(groups.items())):
        runs.sort(key=lambda r: r["gpus"])
        for kinds, style, side in ((("async", "p2p"), "-", "AFD"), (("ep", "none"), "--", "non-AFD")):
            points = []
            for r in runs:
                best = [r["best_of_kind"][k] for k in kinds if k in r["best_of_kind"]]
                if best:
                    points.append((r["gpus"], max(best, key=lambda c: c["tokens_per_s_per_gpu"])))
            if not points:
                continue
            xs, ys = [g for g, _ in points], [c["tokens_per_s_per_gpu"] for _, c in points]
            ax.plot(xs, ys, style, marker="o", color=f"C{i % 10}", label=f"{label}, best {side}")
            for x, y, (_, c) in zip(xs, ys, points, strict=True):
                ax.annotate(c["name"], (x, y), fontsize=6, textcoords="offset points", xytext=(3, 3))
    ax.set_xscale("log", base=2)
    ticks = sorted({r["gpus"] for r in results})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("GPUs")
    ax.set_ylabel("SLO-compliant output tokens/s per GPU")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
