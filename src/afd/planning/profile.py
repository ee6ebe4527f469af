"""A machine profile: per part of a step, a small fitted model `fixed + bytes / bandwidth + flops / peak`.

JSON (`FORMAT`): `{"format", "machine": {...}, "source", "dtype", "gpu_memory_bytes", "front_end_s",
"link": {"intra_node_Bps", "inter_node_Bps", "inter_node_latency_s"}, "parts": {name: Part}}`. Parts (`PARTS`):
- `attention_decode`: one attention-side decode step of a replica (every layer but the routed and shared experts,
  lm_head and sampling included): bytes = attention-side weights + latents read, flops = decode flops, items =
  decode rows, context = cached tokens read (MLA's core, which runs below the rate the linears set).
- `prefill`: the flops of prefill tokens on the attention side (added to a step that has them).
- `routed_experts`, `shared_experts`: one MoE layer's pass on one rank: bytes = expert weights touched.
- `routed_experts_grouped` (optional): `routed_experts` past the (token, k) pairs afd's MoE kernels take
  (`afd.model.moe.FUSED_MOE_MAX_PAIRS`), where `torch._grouped_mm` runs instead; absent, `routed_experts` stands.
- `exchange_p2p`, `exchange_async`: one layer's round trip against the bytes both ways.
- `exchange_colocated` (optional): async's round trip with both ranks on one GPU, where the two processes take turns
  on the device (measured by `afd profile` on a one-GPU machine); co-located deployments take it, others never.
  Absent, `exchange_async` stands for it.
- `launch`: `fixed_s` is the host floor of one eagerly launched layer (micro-batched steps run eagerly).
- `host`: the serving loop's cost per step (`fixed_s`) and per scheduled sequence (`per_item_s`) beyond the step.
`calibration` (optional; absent = zeros): what a served trace spends beyond the parts, fitted by `afd profile`
against `afd serve` on this machine (`Calibration`). `measured` (optional): the rows both were fitted to.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

FORMAT = "afd-profile/1"
PARTS = (
    "attention_decode",
    "prefill",
    "routed_experts",
    "routed_experts_grouped",
    "shared_experts",
    "exchange_p2p",
    "exchange_async",
    "exchange_colocated",
    "launch",
    "host",
)
logger = logging.getLogger(__name__)
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
DEFAULT_PROFILE = "h200"


class ProfileError(ValueError):
    """A profile file that cannot be used, in one sentence."""


@dataclass(frozen=True)
class Part:
    """`time(bytes, flops, items, context) = fixed_s + bytes / bandwidth_Bps + flops / peak_flops + items *
    per_item_s + context * per_context_s`; a rate of None (JSON null) drops its term."""

    fixed_s: float = 0.0
    bandwidth_Bps: float | None = None
    peak_flops: float | None = None
    per_item_s: float = 0.0
    per_context_s: float = 0.0  # attention_decode: per cached token a step reads, beyond what bytes and FLOPs price

    def time(self, nbytes: float = 0.0, flops: float = 0.0, items: float = 0.0, context: float = 0.0) -> float:
        t = self.fixed_s + items * self.per_item_s + context * self.per_context_s
        if self.bandwidth_Bps:
            t += nbytes / self.bandwidth_Bps
        if self.peak_flops:
            t += flops / self.peak_flops
        return t


@dataclass(frozen=True)
class Link:
    """Where the exchange's bytes travel: NVLink inside a node (the profile's exchange fits), a NIC between."""

    intra_node_Bps: float = 450e9
    inter_node_Bps: float = 50e9  # 400 Gb/s per GPU
    inter_node_latency_s: float = 10e-6


@dataclass(frozen=True)
class Calibration:
    """What serving spends beyond the step's parts, fitted from a real served trace.

    Added to the engine step it happens in: per step (`step_s`), per token streamed out (`token_s`: detokenizing,
    the stream, the front end's share of the cores), per request admitted (`request_s`), per request held per step
    (`held_s`: every open stream and queued request the server tends while a step runs). Before the engine:
    `arrival_s`, the front end's own time per request (HTTP, tokenizing, routing) on its single loop, so requests
    reach the engine one at a time through a FIFO queue (`front_end_queue`); `front_end_s`, latency added to every
    time to first token without taking anyone's time. `prompt_step_s`: the shortest a step holding prompt tokens
    lasts, whatever its size (on a GPU such a step launches its graph pieces and eager attention cores from the host,
    which a small one waits on longer than its kernels run). `stream_s`: per sequence running when a request's
    first or last token comes out, the latency the front end's loop adds before writing it (it tends every open
    stream's tokens; measured, not searched: `afd.planning.calibrate.stream_cost`). `fit` records the trace and how
    well the simulator held it after the fit; zeros mean not calibrated (a field missing from an older profile
    loads as 0)."""

    step_s: float = 0.0
    token_s: float = 0.0
    request_s: float = 0.0
    front_end_s: float = 0.0
    held_s: float = 0.0
    arrival_s: float = 0.0
    prompt_step_s: float = 0.0
    stream_s: float = 0.0
    fit: dict = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self) if f.name != "fit")


def front_end_queue(arrivals: list[float], cost_s: float) -> list[float]:
    """When each request leaves a single-server FIFO front end that spends `cost_s` on each, in arrival order:
    `done_i = max(arrival_i, done_(i-1)) + cost_s` (arrivals taken as sorted; e.g. [0, 0, 0] → [c, 2c, 3c])."""
    out, free = [], -math.inf
    for a in arrivals:
        free = max(a, free) + cost_s
        out.append(free)
    return out


@dataclass(frozen=True)
class Profile:
    machine: dict
    parts: dict[str, Part]
    source: str = ""
    dtype: str = "bfloat16"
    gpu_memory_bytes: float = 141e9
    front_end_s: float = 0.0
    link: Link = field(default_factory=Link)
    calibration: Calibration = field(default_factory=Calibration)
    # what `afd profile` measured, to fit again (`afd profile --refit`): {"parts": afd.planning.fitting.Measured's
    # JSON, "calibration": {"runs": [{"rate", "summary"}], "max_num_seqs", "max_num_batched_tokens"}}; older: {}
    measured: dict = field(default_factory=dict)

    def part(self, name: str) -> Part:
        return self.parts.get(name, Part())

    @property
    def on_gpu(self) -> bool:
        """Whether the profile was measured on GPUs (where a whole replica launches each step ahead of the tokens
        of the one before it: `afd.engine.engine`'s overlapped steps)."""
        return not str(self.machine.get("device", "")).startswith("cpu")

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "machine": self.machine,
            "source": self.source,
            "dtype": self.dtype,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "front_end_s": self.front_end_s,
            "link": asdict(self.link),
            "parts": {k: asdict(v) for k, v in self.parts.items()},
            "calibration": asdict(self.calibration),
            **({"measured": self.measured} if self.measured else {}),
        }

    @classmethod
    def from_json(cls, d: dict, where: str = "profile") -> Profile:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ProfileError(f"{where} is not an afd profile (its format is not {FORMAT!r})")
        unknown = set(d.get("parts", {})) - set(PARTS)
        if unknown:
            raise ProfileError(f"{where} has unknown parts {sorted(unknown)}; known: {', '.join(PARTS)}")
        try:
            parts = {k: Part(**v) for k, v in d["parts"].items()}
            link = Link(**d.get("link", {}))
            calibration = Calibration(**d["calibration"]) if "calibration" in d else Calibration()
        except TypeError as exc:
            raise ProfileError(f"{where}: {exc}") from None
        return cls(
            machine=d.get("machine", {}),
            parts=parts,
            source=d.get("source", ""),
            dtype=d.get("dtype", "bfloat16"),
            gpu_memory_bytes=float(d.get("gpu_memory_bytes", 141e9)),
            front_end_s=float(d.get("front_end_s", 0.0)),
            link=link,
            calibration=calibration,
            measured=d.get("measured") or {},
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


def checkpoint_weights(model: str) -> str | None:
    """The weight format `model` (a preset or a checkpoint directory) ships in where it says so: "fp8" for a
    checkpoint with an FP8 `quantization_config`, else its `torch_dtype`; None where neither is known."""
    from afd.model.presets import PRESETS

    raw = PRESETS.get(model)
    if raw is None and Path(model, "config.json").is_file():
        raw = json.loads(Path(model, "config.json").read_text())
    raw = raw or {}
    if (raw.get("quantization_config") or {}).get("quant_method") == "fp8":
        return "fp8"
    return raw.get("torch_dtype")


def model_profile_name(model: str, weights: str) -> str:
    """The name a profile measured on `model`'s own layers in `weights` ships under: `h200-<model>` in the format
    the model ships in, `h200-<model>-<weights>` in another (a bf16 release quantized to FP8 at load)."""
    own = f"{DEFAULT_PROFILE}-{model}"
    return own if weights == checkpoint_weights(model) else f"{own}-{weights}"


def default_profile(model: str | None = None, weights: str | None = None) -> str:
    """The shipped profile a plan or simulation of `model` in `weights` takes without `--profile`: the one measured
    on that model's own layers in that format where afd ships it (its kernels run at rates that V2-Lite's small ones
    do not reach, and FP8's at other rates than bf16's), else the model's own in the format it ships in, else
    `DEFAULT_PROFILE`."""
    names = [model_profile_name(model, weights)] if model and weights else []
    names += [f"{DEFAULT_PROFILE}-{model}"] if model else []
    return next((name for name in names if (PROFILES_DIR / f"{name}.json").is_file()), DEFAULT_PROFILE)


def load_profile(name_or_path: str | Path | None = None) -> Profile:
    """A profile file, or a shipped one by name (`h200`); the default is `DEFAULT_PROFILE`."""
    name = str(name_or_path or DEFAULT_PROFILE)
    path = Path(name)
    if not path.is_file():
        shipped = PROFILES_DIR / f"{name}.json"
        if not shipped.is_file():
            known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.json")))
            raise ProfileError(f"profile {name!r} is neither a file nor a shipped profile ({known})")
        path = shipped
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ProfileError(f"cannot read profile {path}: {exc}") from None
    profile = Profile.from_json(data, str(path))
    if "calibration" not in data:
        logger.info("profile %s has no calibration (an older profile): serving costs beyond its parts count 0", path)
    return profile


def fit_part(
    rows: list[tuple[float, float, float]],
    *,
    fixed: bool = True,
    items: list[float] | None = None,
    context: list[float] | None = None,
    relative: bool = False,
) -> Part:
    """Least squares of `seconds ≈ fixed + bytes / bw + flops / peak (+ items · per_item + context · per_context)`
    over `(bytes, flops, seconds)` rows (`items`: one count per row, e.g. the batch, for a per-row cost the FLOPs do
    not explain; `context`: the cached tokens each row's decode step read, for a core slower than the linears), every
    coefficient kept non-negative (the most negative one is dropped and the rest refitted). `relative`: each row
    weighted by 1 / seconds, so a short step's error counts as much as a long one's (noisy CPU timings)."""
    import numpy as np

    names = ["fixed", "bytes", "flops", "items", "context"]
    given = {"fixed": fixed, "items": items is not None, "context": context is not None}
    active = [n for n in names if given.get(n, True)]
    cols = {
        "fixed": [1.0] * len(rows),
        "bytes": [r[0] for r in rows],
        "flops": [r[1] for r in rows],
        "items": list(items) if items is not None else [0.0] * len(rows),
        "context": list(context) if context is not None else [0.0] * len(rows),
    }
    w = np.array([1.0 / r[2] if relative and r[2] > 0 else 1.0 for r in rows], dtype=float)
    y = np.array([r[2] for r in rows], dtype=float) * w
    coef: dict[str, float] = {}
    while active:
        active = [n for n in active if any(cols[n])]
        if not active:
            break
        scale = np.array([max(abs(v) for v in cols[n]) for n in active])
        a = np.array([cols[n] for n in active], dtype=float).T / scale * w[:, None]
        sol, *_ = np.linalg.lstsq(a, y, rcond=None)
        sol = sol / scale
        if (sol >= 0).all():
            coef = dict(zip(active, sol.tolist(), strict=True))
            break
        active.pop(int(np.argmin(sol * scale)))
    inv = {n: coef.get(n, 0.0) for n in names}
    return Part(
        fixed_s=inv["fixed"],
        bandwidth_Bps=1.0 / inv["bytes"] if inv["bytes"] > 0 else None,
        peak_flops=1.0 / inv["flops"] if inv["flops"] > 0 else None,
        per_item_s=inv["items"],
        per_context_s=inv["context"],
    )


def relative_errors(
    part: Part,
    rows: list[tuple[float, float, float]],
    items: list[float] | None = None,
    context: list[float] | None = None,
) -> list[float]:
    """|fit - measured| / measured per row (how well a fit holds its own points)."""
    counts = items if items is not None else [0.0] * len(rows)
    tokens = context if context is not None else [0.0] * len(rows)
    return [
        abs(part.time(b, f, n, c) - s) / s if s > 0 else math.inf
        for (b, f, s), n, c in zip(rows, counts, tokens, strict=True)
    ]
