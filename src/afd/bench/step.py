"""`afd bench step`: the reference engine's step time beside the memory-bound floor, measured in one run.

Decode: `batch` sequences of `context` cached tokens each take one step; timed eager and (CUDA) replayed
from CUDA graphs, two ways:
- `{eager,graph}_ms`, the figure held against the targets: steady state, what a serving loop sees — on CUDA
  the time between CUDA events recorded after the first and the last of `steps` + 1 consecutive
  `engine.step()` calls, divided by `steps` (device time plus every gap the host leaves; on CPU the wall
  time of `steps` calls). With overlapped steps (`Engine.overlap_steps`, on by default on CUDA) the host's
  work for the next step hides behind the GPU's work on this one, which a sync around every step would not
  let happen.
- `{eager,graph}_isolated_ms`: the median of `steps` steps with overlap off and the device drained around
  each (sync, step, sync): how `*_ms` was measured before overlapped steps, kept to compare old numbers.
The floor is the bytes a step must read at the bandwidth measured in the same run (a
large device-to-device copy): every non-expert weight (attention, norms, dense MLPs, shared experts, gate,
lm_head), the routed experts a batch touches in expectation under uniform top-k routing
(`E * (1 - (1 - K/E)^batch)` per MoE layer), and the latent cache the batch reads. Weights count at the bytes the
model holds them in: FP8 linears (`--quantization fp8`, or an FP8 checkpoint) at one byte per weight plus their
fp32 block scales, the router at fp32.

Ragged decode (`ragged`: a batch whose sequences alternate between the given contexts, e.g. 512 and 3584):
timed as the decode rows, beside a uniform batch at their mean context (the same total context, the same
floor). The MLA decode kernel walks each sequence's own length, so the two should take about the same time; a
ragged row far above its uniform one means the step pays for the longest context instead of the sum.

Mixed (`mixed`: D decodes beside a C-token prompt chunk, afd.bench.mixed_step): at each context, the mixed step
beside the D-decode step and the C-token prefill step timed alone, and their sum.

Prefill: `batch x context` prompt tokens in one step (on CUDA through the prefill graphs, as served steps run; the
eager decode rows use neither kind of graph), beside the larger of its compute floor (FLOPs at the
matmul rate measured in the same run) and its weight-read floor.

The decode sequences are admitted without running their prompts: their cache blocks are filled with
random latents (a step's time does not depend on the values), so a large batch at a long context costs
no prefill.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from afd.bench.mixed_step import format_mixed, mixed_fields, time_decodes_and_mixed, timed_prompt_steps
from afd.bench.offline import device_name
from afd.engine.engine import Engine, LocalExchange, Request
from afd.model.attention_side import AttentionModel, ModelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepBytes:
    """Bytes one decode step reads, by part."""

    dense_weights: int  # everything but the routed experts
    routed_experts: float  # expected, uniform top-k routing
    latent_cache: int

    @property
    def total(self) -> float:
        return self.dense_weights + self.routed_experts + self.latent_cache


def expected_experts_touched(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Distinct experts `num_tokens` tokens touch in expectation, each picking `top_k` of `num_experts`
    uniformly: an expert is missed by one token with probability `1 - top_k / num_experts`."""
    if num_experts == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def _bytes(module: torch.nn.Module | None) -> int:
    """Bytes of a module's parameters as held (FP8 weights one byte each, their scales and the router fp32)."""
    return 0 if module is None else sum(p.numel() * p.element_size() for p in module.parameters())


def expert_bytes(ffn: torch.nn.Module) -> float:
    """Bytes of one routed expert (gate, up and down, with their FP8 scales if any) as the FFN model holds it."""
    for layer in ffn.layers.values():
        if layer.experts is not None and layer.experts.w13.shape[0] > 0:
            return _bytes(layer.experts) / layer.experts.w13.shape[0]
    return 0.0


def decode_step_bytes(config: ModelConfig, attn: AttentionModel, ffn: torch.nn.Module, batch: int, context: int):
    """What one decode step of `batch` sequences, `context` cached tokens each, reads at the least."""
    item = attn.embed_tokens.weight.element_size()
    # attention side: everything but the embedding table (it reads `batch` rows of it)
    dense = _bytes(attn) - _bytes(attn.embed_tokens) + batch * config.hidden_size * item
    for layer in ffn.layers.values():
        dense += _bytes(layer.mlp) + _bytes(layer.gate) + _bytes(layer.shared_experts)
    touched = expected_experts_touched(config.n_routed_experts, config.num_experts_per_tok, batch)
    routed = len(config.moe_layers) * touched * expert_bytes(ffn)
    width = config.kv_lora_rank + config.qk_rope_head_dim
    cache = batch * (context + 1) * config.num_hidden_layers * width * item
    return StepBytes(dense_weights=dense, routed_experts=routed, latent_cache=cache)


def prefill_flops(config: ModelConfig, batch: int, context: int) -> float:
    """Matmul FLOPs of a prefill of `batch` prompts of `context` tokens (logits of the last token only)."""
    c = config
    H, nh = c.hidden_size, c.num_attention_heads
    q = H * nh * c.qk_head_dim if c.q_lora_rank is None else c.q_lora_rank * (H + nh * c.qk_head_dim)
    attn = q + H * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank * nh * (c.qk_nope_head_dim + c.v_head_dim)
    attn += nh * c.v_head_dim * H
    per_token = 0
    for i in range(c.num_hidden_layers):
        if c.is_moe_layer(i):
            mlp = 3 * H * c.moe_intermediate_size * (c.num_experts_per_tok + c.n_shared_experts)
            mlp += H * c.n_routed_experts
        else:
            mlp = 3 * H * c.intermediate_size
        per_token += attn + mlp
    linear = 2.0 * per_token * batch * context + 2.0 * batch * H * c.vocab_size
    # causal scores and values: half of context x context per head and layer
    scores = 2.0 * batch * nh * (c.qk_head_dim + c.v_head_dim) * context * context / 2 * c.num_hidden_layers
    return linear + scores


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device: torch.device, nbytes: int, iters: int = 10) -> float:
    """Bytes/s of a large copy on `device`, counting the read and the write (2 x nbytes per copy)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    _sync(device)
    return 2 * src.numel() * 4 * iters / (time.perf_counter() - start)


def measure_matmul(device: torch.device, dtype: torch.dtype, n: int, iters: int = 10) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` on `device`."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    _sync(device)
    return 2.0 * n**3 * iters / (time.perf_counter() - start)


def _timed_steps(engine: Engine, steps: int) -> float:
    """Median seconds of `steps` engine steps, the device drained around each."""
    times = []
    for _ in range(steps):
        _sync(engine.device)
        start = time.perf_counter()
        engine.step()
        _sync(engine.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _steady_steps(engine: Engine, steps: int) -> float:
    """Seconds per step of a serving loop. On CUDA: `steps + 1` consecutive engine steps, a CUDA event recorded
    on the stream after each call (so it fires when that call's launched step ends), and the time between the
    first and the last event over `steps`: the device time per step plus any idle gap the host leaves between
    steps, without the launch of the first step or a final drain (an overlapped step's host work hides behind
    the previous step; a one-off start-up launch would otherwise add ~1/steps of a launch to every step).
    On CPU (nothing runs ahead): the wall time of `steps` steps."""
    if engine.device.type != "cuda":
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        return (time.perf_counter() - start) / steps
    marks = []
    for _ in range(steps + 1):
        engine.step()
        mark = torch.cuda.Event(enable_timing=True)
        mark.record()
        marks.append(mark)
    marks[-1].synchronize()
    return marks[0].elapsed_time(marks[-1]) / 1e3 / steps


def ragged_contexts(batch: int, contexts: list[int]) -> list[int]:
    """Each sequence's context in a batch of `batch` that alternates between `contexts` (in order, repeating)."""
    return [contexts[i % len(contexts)] for i in range(batch)]


def _seed_decodes(engine: Engine, contexts: list[int], max_new_tokens: int, gen: torch.Generator) -> None:
    """Admit one sequence per entry of `contexts` as if its prompt of that many tokens had run: random cached
    latents, one sampled token each; the next step is a pure decode step."""
    vocab = engine.model.config.vocab_size
    batch = len(contexts)
    for context in contexts:
        prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
        engine.add(Request(prompt, max_new_tokens))
    budget = engine.max_num_batched_tokens
    engine.max_num_batched_tokens = sum(contexts)  # admit them all at once, without running them
    try:
        scheduled = engine.schedule()
    finally:
        engine.max_num_batched_tokens = budget
    if len(scheduled) != batch:
        raise RuntimeError(f"only {len(scheduled)} of {batch} sequences fit the cache")
    for s in scheduled:
        s.seq.num_cached = len(s.seq.request.prompt_ids)
        s.seq.token_ids.append(int(torch.randint(0, vocab, (1,), generator=gen)))
        s.seq.logprobs.append(0.0)


def _drop_all(engine: Engine) -> None:
    engine.drain()  # the step in flight, if any, before its sequences are dropped
    for seq in list(engine.running):
        engine.running.remove(seq)
        engine.free(seq)


@contextlib.contextmanager
def overlap_off(engine: Engine) -> Iterator[None]:
    """Every step inside finalized before it returns (`Engine.overlap_steps` off), restored after."""
    overlap, engine.overlap_steps = engine.overlap_steps, False
    try:
        yield
    finally:
        engine.overlap_steps = overlap


def mixed_row(
    engine: Engine, decodes: int, context: int, chunk: int, steps: int, gen: torch.Generator, max_new: int
) -> dict:
    """The mixed step of `decodes` decodes at `context` beside a `chunk`-token prompt, the decode step alone and the
    prefill step alone (afd.bench.mixed_step), overlapped steps off; the engine's budget holds decodes + chunk."""
    with overlap_off(engine):
        _seed_decodes(engine, [context] * decodes, max_new, gen)
        decode_ms, mixed_ms, host_ms = time_decodes_and_mixed(engine, chunk, steps, gen)
        _drop_all(engine)
        prefill_ms = timed_prompt_steps(engine, chunk, steps, gen, 0)[0] * 1e3
    return mixed_fields(decodes, context, chunk, decode_ms, mixed_ms, prefill_ms, host_ms)


def run_bench_step(
    *,
    model: str,
    dtype: str,
    device: str,
    batches: list[int],
    contexts: list[int],
    prefills: list[tuple[int, int]],
    ragged: list[int] | None = None,
    mixed: list[tuple[int, int]] | None = None,
    steps: int = 10,
    seed: int = 0,
    quantization: str | None = None,
    progress=None,
) -> dict:
    """Decode steps for every (batch, context), eager and graphed; with `ragged`, for every batch of at least
    `len(ragged)` sequences a batch alternating between those contexts beside a uniform one at their mean;
    with `mixed` ((decodes, chunk) pairs), a mixed step at every context beside its halves timed alone; prefills;
    floors; one result dict."""
    from afd.model.weights import load_attention_model, load_ffn_model

    say = progress or logger.info
    dev = torch.device(device)
    attn = load_attention_model(model, dtype=dtype, device=device, seed=seed, quantization=quantization)
    ffn = load_ffn_model(model, dtype=dtype, device=device, seed=seed, quantization=quantization)
    config = attn.config
    torch_dtype = attn.embed_tokens.weight.dtype
    cuda = dev.type == "cuda"
    say("measuring copy bandwidth and matmul rate ...")
    bandwidth = measure_bandwidth(dev, (2 << 30) if cuda else (256 << 20))
    matmul = measure_matmul(dev, torch_dtype, 8192 if cuda else 512)
    warmup = 2
    # the drained steps, then the steady ones: no sequence may end inside a timed run (an overlapped step is
    # launched only while every sequence goes on after the one in flight)
    max_new = warmup + 2 * steps + 4
    mixed = mixed or []
    max_batch = max([*batches, *(b for b, _ in prefills), *(d + 1 for d, _ in mixed), 1])
    contexts_all = [*contexts, *(ragged or [])]
    longest = max([*contexts_all, *(c for _, c in prefills), *(c for _, c in mixed), 1]) + max_new
    block_size = 16
    num_blocks = max(max(batches, default=1) * -(-(max(contexts_all, default=1) + max_new) // block_size), 1)
    num_blocks = max(num_blocks, max((b * -(-(c + 1) // block_size) for b, c in prefills), default=1))
    for d, c in mixed:  # the decodes at the longest context beside the chunk
        per_decode = -(-(max(contexts, default=1) + max_new) // block_size)
        num_blocks = max(num_blocks, d * per_decode + -(-(c + 1) // block_size))
    engine = Engine(
        attn,
        LocalExchange(ffn),
        max(
            max((b * c for b, c in prefills), default=1),
            max(contexts_all, default=1) + 1,
            max_batch,
            max((d + c for d, c in mixed), default=1),
        ),
        max_num_seqs=max_batch,
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=longest,
    )
    graphs = engine.cuda_graphs
    prefill_graphs = engine.prefill_graphs  # an eager decode row must not replay their pieces either
    pool = engine.kv_cache.cache
    gen = torch.Generator().manual_seed(seed)
    pool[:, block_size : pool.shape[1] - 1].normal_(0.0, 1.0)  # random latents; the null block stays zero
    result: dict = {
        "date": datetime.date.today().isoformat(),
        "device": device_name(device),
        "model": model,
        "dtype": dtype,
        "fp8_weights": config.fp8_block is not None,
        "torch": torch.__version__,
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "matmul_TFLOPs": matmul / 1e12,
        "steps": steps,
        "overlap_steps": engine.overlap_steps,
        "timing": (
            "*_ms: steady state, per step: on CUDA the time between CUDA events recorded after the first and the "
            "last of `steps` + 1 consecutive engine.step() calls, / steps (device time plus host gaps; overlap_steps "
            "as in that field); on CPU the wall time of `steps` calls / steps; *_isolated_ms: median of `steps` "
            "steps, overlap off, device synced around each"
        ),
        "decode": [],
        "ragged": [],
        "mixed": [],
        "prefill": [],
    }

    def decode_row(per_seq: list[int]) -> dict:
        """Time one decode batch whose sequences have the contexts `per_seq`, eager and graphed."""
        batch, context = len(per_seq), round(sum(per_seq) / len(per_seq))
        floor = decode_step_bytes(config, attn, ffn, batch, context)
        row = {
            "batch": batch,
            "context": context,
            "floor_bytes": floor.total,
            "floor_ms": floor.total / bandwidth * 1e3,
            "floor_parts_GB": {
                "weights": floor.dense_weights / 1e9,
                "routed_experts": floor.routed_experts / 1e9,
                "latent_cache": floor.latent_cache / 1e9,
            },
        }
        for mode in ("eager", "graph"):
            if mode == "graph" and graphs is None:
                row["graph_ms"] = row["graph_isolated_ms"] = None
                continue
            engine.cuda_graphs = graphs if mode == "graph" else None
            engine.prefill_graphs = prefill_graphs if mode == "graph" else []
            _seed_decodes(engine, per_seq, max_new, gen)
            if mode == "graph":  # capture before timing: the batch's bucket serves every length the steps reach
                graphs.capture_for(batch)
            with overlap_off(engine):
                for _ in range(warmup):
                    engine.step()
                row[f"{mode}_isolated_ms"] = _timed_steps(engine, steps) * 1e3
            overlap = engine.overlap_steps
            launched_ahead = engine.overlapped_steps
            row[f"{mode}_ms"] = _steady_steps(engine, steps) * 1e3
            launched_ahead = engine.overlapped_steps - launched_ahead
            calls = steps + 1 if cuda else steps  # `_steady_steps`
            if overlap and launched_ahead != calls - 1:  # the first step of the run is never launched ahead
                logger.warning("only %d of %d %s steps were launched ahead", launched_ahead, calls - 1, mode)
            row[f"{mode}_launched_ahead"] = launched_ahead
            _drop_all(engine)
        for mode in ("eager", "graph"):
            ms = row.get(f"{mode}_ms")
            row[f"{mode}_over_floor"] = ms / row["floor_ms"] if ms else None
        return row

    for context in contexts:
        for batch in batches:
            say(f"decode: batch {batch}, context {context} ...")
            result["decode"].append(decode_row([context] * batch))
    for batch in batches if ragged else []:
        if batch < len(ragged):
            continue  # too few sequences to alternate between every context
        per_seq = ragged_contexts(batch, ragged)
        say(f"ragged decode: batch {batch}, contexts {','.join(map(str, ragged))} (mean {sum(per_seq) / batch:g}) ...")
        row = decode_row(per_seq)
        uniform = decode_row([row["context"]] * batch)  # the mean context: the same total
        row.update(contexts=ragged, total_context=sum(per_seq), uniform_total_context=batch * row["context"])
        for mode in ("eager", "graph"):
            ms, base = row.get(f"{mode}_ms"), uniform.get(f"{mode}_ms")
            row[f"uniform_{mode}_ms"] = base
            row[f"{mode}_over_uniform"] = ms / base if ms and base else None
        result["ragged"].append(row)
    engine.cuda_graphs, engine.prefill_graphs = graphs, prefill_graphs
    for (decodes, chunk), context in ((m, c) for m in mixed for c in contexts):
        say(f"mixed: {decodes} decodes at context {context} beside a {chunk}-token chunk ...")
        result["mixed"].append(mixed_row(engine, decodes, context, chunk, steps, gen, max_new))
    for batch, context in prefills:
        say(f"prefill: {batch} x {context} tokens ...")
        times = []
        with overlap_off(engine):  # each step finalized before the next, as the mixed rows' halves are
            for _ in range(1 + max(1, steps // 4)):  # the first one warms up
                for _ in range(batch):
                    engine.add(Request(torch.randint(0, config.vocab_size, (context,), generator=gen).tolist(), 1))
                _sync(dev)
                start = time.perf_counter()
                engine.step()  # every prompt in one step; max_new_tokens=1 finishes them all
                _sync(dev)
                times.append(time.perf_counter() - start)
                if engine.has_work():
                    raise RuntimeError(f"a prefill of {batch} x {context} tokens did not finish in one step")
        flops = prefill_flops(config, batch, context)
        all_experts = len(config.moe_layers) * config.n_routed_experts * expert_bytes(ffn)
        weights = decode_step_bytes(config, attn, ffn, batch * context, 0).dense_weights + all_experts
        floor_ms = max(flops / matmul, weights / bandwidth) * 1e3
        ms = statistics.median(times[1:]) * 1e3
        result["prefill"].append(
            {
                "batch": batch,
                "context": context,
                "tokens": batch * context,
                "ms": ms,
                "flops": flops,
                "floor_ms": floor_ms,
                "over_floor": ms / floor_ms,
            }
        )
    if graphs is not None:
        result["graphs_captured"] = graphs.captured  # batch buckets
    if prefill_graphs:  # the prefill rows replay their row-wise pieces (afd.engine.graphs.prefill), as served steps do
        result["prefill_graph_buckets"] = prefill_graphs[0].captured
    return result


def ms_text(value: float | None) -> str:
    """A table cell of milliseconds, "-" where there is none."""
    return "-" if value is None else f"{value:.2f}"


def format_bench_step(result: dict) -> str:
    """The result as a table: one line per decode (batch, context), one per ragged batch beside its uniform
    batch at the mean context, one per mixed step beside its halves, then one per prefill."""
    lines = [
        f"{result['model']} {result['dtype']}{' (fp8 weights)' if result.get('fp8_weights') else ''} on "
        f"{result['device']} (torch {result['torch']}): copy "
        f"{result['copy_bandwidth_GBps']:.0f} GB/s, matmul {result['matmul_TFLOPs']:.3g} TFLOP/s",
        f"ms: steady state, per step over {result['steps']} consecutive steps, CUDA events (overlapped steps "
        f"{'on' if result['overlap_steps'] else 'off'}); iso: median of {result['steps']} steps, overlap off, "
        "synced around each",
        f"{'decode':<8} {'batch':>5} {'context':>7} {'eager ms':>9} {'graph ms':>9} {'eager iso':>9} "
        f"{'graph iso':>9} {'floor ms':>9} {'eager/floor':>11} {'graph/floor':>11}",
    ]
    for r in result["decode"]:
        ratio_e = "-" if r["eager_over_floor"] is None else f"{r['eager_over_floor']:.1f}x"
        ratio_g = "-" if r["graph_over_floor"] is None else f"{r['graph_over_floor']:.1f}x"
        lines.append(
            f"{'':<8} {r['batch']:>5} {r['context']:>7} {ms_text(r['eager_ms']):>9} {ms_text(r['graph_ms']):>9} "
            f"{ms_text(r['eager_isolated_ms']):>9} {ms_text(r['graph_isolated_ms']):>9} "
            f"{ms_text(r['floor_ms']):>9} {ratio_e:>11} {ratio_g:>11}"
        )
    if result.get("ragged"):
        lines.append(
            f"{'ragged':<8} {'batch':>5} {'contexts':>11} {'mean':>5} {'eager ms':>9} {'uniform':>9} "
            f"{'graph ms':>9} {'uniform':>9} {'graph/uniform':>13}"
        )
        for r in result["ragged"]:
            ratio = "-" if r["graph_over_uniform"] is None else f"{r['graph_over_uniform']:.2f}x"
            if r["graph_over_uniform"] is None and r["eager_over_uniform"] is not None:
                ratio = f"{r['eager_over_uniform']:.2f}x eager"
            lines.append(
                f"{'':<8} {r['batch']:>5} {','.join(map(str, r['contexts'])):>11} {r['context']:>5} "
                f"{ms_text(r['eager_ms']):>9} {ms_text(r['uniform_eager_ms']):>9} {ms_text(r['graph_ms']):>9} "
                f"{ms_text(r['uniform_graph_ms']):>9} {ratio:>13}"
            )
    lines += format_mixed(result.get("mixed", []))
    if result["prefill"]:
        lines.append(
            f"{'prefill':<8} {'batch':>5} {'context':>7} {'ms':>9} {'TFLOP':>9} {'floor ms':>9} {'ms/floor':>11}"
        )
        for r in result["prefill"]:
            lines.append(
                f"{'':<8} {r['batch']:>5} {r['context']:>7} {r['ms']:>9.2f} {r['flops'] / 1e12:>9.2f} "
                f"{r['floor_ms']:>9.2f} {r['over_floor']:>10.1f}x"
            )
    return "\n".join(lines)
