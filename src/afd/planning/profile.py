"""A machine profile: per part of a step, a small fitted model `fixed + bytes / bandwidth + flops / peak`.

JSON (`FORMAT`): `{"format", "machine": {...}, "source", "dtype", "gpu_memory_bytes", "front_end_s",
"link": {"intra_node_Bps", "inter_node_Bps", "inter_node_latency_s"}, "parts": {name: Part}}`. Parts (`PARTS`):
- `attention_decode`: one attention-side decode step of a replica (every layer but the routed and shared experts,
  lm_head and sampling included): bytes = attention-side weights + latents read, flops = decode flops.
- `prefill`: the flops of prefill tokens on the attention side (added to a step that has them).
- `routed_experts`, `shared_experts`: one MoE layer's pass on one rank: bytes = expert weights touched.
- `exchange_p2p`, `exchange_async`: one layer's round trip against the bytes both ways.
- `launch`: `fixed_s` is the host floor of one eagerly launched layer (micro-batched steps run eagerly).
- `host`: the serving loop's cost per step (`fixed_s`) and per scheduled sequence (`per_item_s`) beyond the step.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT = "afd-profile/1"
PARTS = (
    "attention_decode",
    "prefill",
    "routed_experts",
    "shared_experts",
    "exchange_p2p",
    "exchange_async",
    "launch",
    "host",
)
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
DEFAULT_PROFILE = "h200"


class ProfileError(ValueError):
    """A profile file that cannot be used, in one sentence."""


@dataclass(frozen=True)
class Part:
    """`time(bytes, flops, items) = fixed_s + bytes / bandwidth_Bps + flops / peak_flops + items * per_item_s`;
    a rate of None (JSON null) drops its term."""

    fixed_s: float = 0.0
    bandwidth_Bps: float | None = None
    peak_flops: float | None = None
    per_item_s: float = 0.0

    def time(self, nbytes: float = 0.0, flops: float = 0.0, items: float = 0.0) -> float:
        t = self.fixed_s + items * self.per_item_s
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
class Profile:
    machine: dict
    parts: dict[str, Part]
    source: str = ""
    dtype: str = "bfloat16"
    gpu_memory_bytes: float = 141e9
    front_end_s: float = 0.0
    link: Link = field(default_factory=Link)

    def part(self, name: str) -> Part:
        return self.parts.get(name, Part())

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
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


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
    return Profile.from_json(data, str(path))


def fit_part(rows: list[tuple[float, float, float]], *, fixed: bool = True) -> Part:
    """Least squares of `seconds ≈ fixed + bytes / bw + flops / peak` over `(bytes, flops, seconds)` rows, every
    coefficient kept non-negative (a negative one is dropped and the rest refitted): pure, small, exact enough."""
    import numpy as np

    names = ["fixed", "bytes", "flops"]
    active = [n for n in names if (n != "fixed" or fixed)]
    cols = {"fixed": [1.0] * len(rows), "bytes": [r[0] for r in rows], "flops": [r[1] for r in rows]}
    y = np.array([r[2] for r in rows], dtype=float)
    coef: dict[str, float] = {}
    while active:
        active = [n for n in active if any(cols[n])]
        if not active:
            break
        scale = np.array([max(abs(v) for v in cols[n]) for n in active])
        a = np.array([cols[n] for n in active], dtype=float).T / scale
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
    )


def relative_errors(part: Part, rows: list[tuple[float, float, float]]) -> list[float]:
    """|fit - measured| / measured per row (how well a fit holds its own points)."""
    return [abs(part.time(b, f) - s) / s if s > 0 else math.inf for b, f, s in rows]
