"""The AFD config: parsed in one place, strict, one sentence per error.

Accepted inputs: a dict, a JSON string, a path to a JSON file, each either canonical or wrapped
as `{"afd": {...}}`. Aliases `afd_role`, `afd_connector`, `afd_host`, `afd_port` fold into the
canonical keys; connector class names fold into `p2p` / `async`.
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

CONNECTOR_ALIASES = {
    "p2p": "p2p",
    "P2pNcclAFDConnector": "p2p",
    "async": "async",
    "GpuAsyncAFDConnector": "async",
}
KEY_ALIASES = {"afd_role": "role", "afd_connector": "connector", "afd_host": "host", "afd_port": "port"}
ROLES = ("attention", "ffn")
DEFAULT_PORT = 6239
# Far above any machine we can build (a rank is an OS process, and NVSHMEM / NCCL worlds of this size are
# untested), yet low enough that a typo such as 100000000000 fails at once instead of starting to fork.
MAX_RANKS_PER_ROLE = 1024
MAX_CONFIG_BYTES = 1 << 20  # a config is a few hundred bytes; anything this large is the wrong file


class InputError(ValueError):
    """A file or value given by the user that cannot be used; the message is one sentence."""


class ConfigError(InputError):
    """A config that cannot run; the message is one sentence naming the key and what is accepted."""


class DuplicateKeyError(InputError):
    """A JSON object names one key twice; `json` would silently keep the last value."""

    def __init__(self, key: str) -> None:
        super().__init__(f"key {key!r} is given twice")
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`object_pairs_hook` for `json.loads`: a dict, or DuplicateKeyError naming the repeated key."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(key)
        out[key] = value
    return out


def read_text_file(path: str | Path, what: str, max_bytes: int) -> str:
    """The UTF-8 text of a regular file of at most `max_bytes`, or InputError in one sentence.

    Opened non-blocking and checked with fstat before reading, so a FIFO or a device such as /dev/zero
    is refused at once instead of blocking forever or filling the memory.
    """
    name = f"{what} {str(path)!r}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InputError(f"{name} does not exist") from None
    except OSError as exc:
        raise InputError(f"{name} cannot be opened ({exc.strerror or type(exc).__name__})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size > max_bytes:
        os.close(fd)
        if stat.S_ISDIR(info.st_mode):
            raise InputError(f"{name} is a directory; pass a regular file")
        if not stat.S_ISREG(info.st_mode):
            raise InputError(f"{name} is not a regular file (a FIFO, socket or device); pass a regular file")
        raise InputError(f"{name} is larger than {max_bytes} bytes, the most afd reads as {what}")
    with os.fdopen(fd, "rb") as handle:
        try:
            data = handle.read(max_bytes + 1)  # bounded even if the file grows while it is read
        except OSError as exc:
            raise InputError(f"{name} cannot be read ({exc.strerror or type(exc).__name__})") from None
    if len(data) > max_bytes:
        raise InputError(f"{name} is larger than {max_bytes} bytes, the most afd reads as {what}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"{name} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


def _check_int(key: str, value: Any, *, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
        raise ConfigError(f"{key} must be {bound}, got {value}")
    return value


def _check_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    return value


def _check_float(key: str, value: Any, *, above: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if value <= above:
        raise ConfigError(f"{key} must be greater than {above:g}, got {value}")
    return float(value)


def _reject_unknown(where: str, given: dict, known: list[str]) -> None:
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]!r} in {where}; accepted keys are {', '.join(known)}")


MAX_UBATCHES = 16  # far above the 2-4 that ping-pong wants; each one is a ring stage of window memory (async)


@dataclass(frozen=True)
class P2pExtraConfig:
    """`connector_extra_config` of `p2p`.

    `p2p_ubatching` splits every eager step of two or more sequences into `p2p_num_ubatches` micro-batches in
    ping-pong; the FFN ranks then serve that many micro-batch slots per boundary layer in every step of the wave.
    """

    timeout_s: float = 120.0  # bound on every rendezvous and transfer wait
    p2p_ubatching: bool = False
    p2p_num_ubatches: int = 2

    @classmethod
    def from_dict(cls, raw: dict) -> P2pExtraConfig:
        _reject_unknown("connector_extra_config for p2p", raw, [f.name for f in fields(cls)])
        d, key = cls(), "connector_extra_config."
        return cls(
            timeout_s=_check_float(key + "timeout_s", raw.get("timeout_s", d.timeout_s), above=0),
            p2p_ubatching=_check_bool(key + "p2p_ubatching", raw.get("p2p_ubatching", d.p2p_ubatching)),
            p2p_num_ubatches=_check_int(
                key + "p2p_num_ubatches",
                raw.get("p2p_num_ubatches", d.p2p_num_ubatches),
                minimum=1,
                maximum=MAX_UBATCHES,
            ),
        )

    def __post_init__(self) -> None:
        if self.p2p_ubatching and self.p2p_num_ubatches < 2:
            raise ConfigError(
                "connector_extra_config.p2p_num_ubatches must be at least 2 when p2p_ubatching is true, "
                f"got {self.p2p_num_ubatches}"
            )

    @property
    def num_ubatches(self) -> int:
        """Micro-batch slots per step and boundary layer: `p2p_num_ubatches` when `p2p_ubatching`, else 1."""
        return self.p2p_num_ubatches if self.p2p_ubatching else 1


@dataclass(frozen=True)
class AsyncExtraConfig:
    """`connector_extra_config` of `async`.

    `ring_depth` is the number of messages in flight per peer: one per micro-batch. From a dict it defaults to
    `async_moe_num_ubatches` when `async_moe_ubatching` is on, else 1.
    """

    attn_ranks_per_dp: int = 1
    ring_depth: int = 1
    routed_cap_multiplier: float = 2.0
    recv_poll_timeout_ms: int = 500
    async_moe_ubatching: bool = False
    async_moe_num_ubatches: int = 2
    async_moe_split: str = "token"
    timeout_s: float = 120.0  # bound on every rendezvous and window wait, as p2p's
    # The shared experts run on the attention rank between send and recv (it would idle there), so the FFN ranks
    # only run routed experts and reply in fp32 (docs/architecture.md, "Shared experts").
    shared_experts_on_attention: bool = False
    # A 1A1F FFN rank on CPU runs the device-driven passes of CUDA (`asynchronous.ffn_chain`) eagerly from its host
    # loop: how tests exercise that logic without a GPU. CUDA decides by itself.
    cpu_device_passes: bool = False

    @property
    def num_ubatches(self) -> int:
        """Micro-batches a step is split into: `async_moe_num_ubatches` when `async_moe_ubatching`, else 1."""
        return self.async_moe_num_ubatches if self.async_moe_ubatching else 1

    @classmethod
    def from_dict(cls, raw: dict) -> AsyncExtraConfig:
        _reject_unknown("connector_extra_config for async", raw, [f.name for f in fields(cls)])
        d = cls()
        key = "connector_extra_config."
        ubatching = _check_bool(key + "async_moe_ubatching", raw.get("async_moe_ubatching", d.async_moe_ubatching))
        num_ubatches = _check_int(
            key + "async_moe_num_ubatches",
            raw.get("async_moe_num_ubatches", d.async_moe_num_ubatches),
            minimum=1,
            maximum=MAX_UBATCHES,
        )
        in_flight = num_ubatches if ubatching else 1  # what each peer's ring must hold
        cfg = cls(
            attn_ranks_per_dp=_check_int(key + "attn_ranks_per_dp", raw.get("attn_ranks_per_dp", 1), minimum=1),
            ring_depth=_check_int(key + "ring_depth", raw.get("ring_depth", in_flight), minimum=1),
            routed_cap_multiplier=_check_float(
                key + "routed_cap_multiplier", raw.get("routed_cap_multiplier", d.routed_cap_multiplier), above=0
            ),
            recv_poll_timeout_ms=_check_int(
                key + "recv_poll_timeout_ms", raw.get("recv_poll_timeout_ms", d.recv_poll_timeout_ms), minimum=1
            ),
            async_moe_ubatching=ubatching,
            async_moe_num_ubatches=num_ubatches,
            async_moe_split=raw.get("async_moe_split", d.async_moe_split),
            timeout_s=_check_float(key + "timeout_s", raw.get("timeout_s", d.timeout_s), above=0),
            shared_experts_on_attention=_check_bool(
                key + "shared_experts_on_attention",
                raw.get("shared_experts_on_attention", d.shared_experts_on_attention),
            ),
            cpu_device_passes=_check_bool(key + "cpu_device_passes", raw.get("cpu_device_passes", d.cpu_device_passes)),
        )
        if cfg.async_moe_split not in ("token",):
            raise ConfigError(f"{key}async_moe_split must be 'token', got {cfg.async_moe_split!r}")
        if cfg.attn_ranks_per_dp != 1:
            raise ConfigError(
                f"{key}attn_ranks_per_dp={cfg.attn_ranks_per_dp} is not supported yet; "
                "each attention rank is its own replica, so set it to 1"
            )
        return cfg

    def __post_init__(self) -> None:
        key = "connector_extra_config."
        if self.async_moe_ubatching and self.async_moe_num_ubatches < 2:
            raise ConfigError(
                f"{key}async_moe_num_ubatches must be at least 2 when async_moe_ubatching is true, "
                f"got {self.async_moe_num_ubatches}"
            )
        if self.async_moe_ubatching and self.ring_depth < self.async_moe_num_ubatches:
            raise ConfigError(
                f"{key}ring_depth={self.ring_depth} cannot hold async_moe_num_ubatches={self.async_moe_num_ubatches} "
                "micro-batches in flight to one peer; raise ring_depth to at least that or leave it out"
            )


@dataclass(frozen=True)
class AFDConfig:
    """One deployment: who this rank is and how the two roles meet."""

    role: str | None = None  # None: the launcher assigns each rank its role
    connector: str = "p2p"
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    num_attention_ranks: int = 1
    num_ffn_ranks: int = 1
    compute_gate_on_attention: bool = True
    connector_extra_config: P2pExtraConfig | AsyncExtraConfig = field(default_factory=P2pExtraConfig)

    @property
    def world_size(self) -> int:
        return self.num_attention_ranks + self.num_ffn_ranks

    def to_dict(self) -> dict:
        out = asdict(self)
        out["connector_extra_config"] = asdict(self.connector_extra_config)
        return out

    def replace(self, **changes: Any) -> AFDConfig:
        """A validated copy with some keys changed (the CLI's flags override a config file this way)."""
        return parse_config({**self.to_dict(), **changes})


CANONICAL_KEYS = [f.name for f in fields(AFDConfig)]


def ubatch_keys(connector: str, num_ubatches: int) -> dict:
    """`connector_extra_config` for `connector`'s micro-batching in `num_ubatches` (1: off)."""
    if num_ubatches == 1:
        return {}
    prefix = "async_moe" if connector == "async" else connector
    return {f"{prefix}_ubatching": True, f"{prefix}_num_ubatches": num_ubatches}


def _load_raw(source: dict | str | Path) -> dict:
    if isinstance(source, dict):
        return source
    if isinstance(source, Path):
        text = _read_file(source)
    else:
        stripped = source.strip()
        text = stripped if stripped.startswith("{") else _read_file(Path(source))
    try:
        raw = json.loads(text, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"the config is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
        ) from None
    except DuplicateKeyError as exc:
        raise ConfigError(f"key {exc.key!r} is given twice in the config; keep one") from None
    if not isinstance(raw, dict):
        raise ConfigError('the config must be a JSON object, such as {"connector": "p2p"}')
    return raw


def _read_file(path: Path) -> str:
    if not os.path.lexists(path):
        raise ConfigError(f"config file {str(path)!r} does not exist; pass a JSON file or a JSON object")
    try:
        return read_text_file(path, "config file", MAX_CONFIG_BYTES)
    except InputError as exc:
        raise ConfigError(str(exc)) from None


def _folded(source: dict | str | Path) -> dict[str, Any]:
    """The config's keys as given (unwrapped from {"afd": ...}, aliases folded to their canonical names)."""
    raw = _load_raw(source)
    if "afd" in raw:
        if len(raw) != 1 or not isinstance(raw["afd"], dict):
            raise ConfigError('a wrapped config must be exactly {"afd": {...}} with an object inside')
        raw = raw["afd"]
    folded: dict[str, Any] = {}
    for key, value in raw.items():
        name = KEY_ALIASES.get(key, key)
        if name in folded:
            raise ConfigError(f"key {name!r} is given twice (once through its alias {key!r}); keep one")
        folded[name] = value
    return folded


def given_extra_keys(source: dict | str | Path) -> set[str]:
    """The `connector_extra_config` keys a config sets itself (not by default): a CLI default must not override
    them."""
    extra = _folded(source).get("connector_extra_config")
    return set(extra) if isinstance(extra, dict) else set()


# Where a connector runs the shared experts when neither the config nor the command line says (`afd launch`,
# `generate`, `serve`, `bench`): async on its attention ranks, between each send and its recv (measured faster
# at 1A1F and 2A2F, docs/performance.md); p2p, none and the vLLM adapter on the FFN side.
CLI_SHARED_EXPERTS = {"async": "attention"}


def default_shared_experts(connector: str) -> str:
    """'attention' or 'ffn': where `connector` runs the shared experts by default on the command line."""
    return CLI_SHARED_EXPERTS.get(connector, "ffn")


def parse_config(source: dict | str | Path, *, default_connector: str = "p2p") -> AFDConfig:
    """Resolve a config from a dict, a JSON string or a JSON file; raise ConfigError on anything off.
    `default_connector`: the connector of a config that names none (a CLI's `--connector`), whose keys its
    `connector_extra_config` is checked against."""
    folded = _folded(source)
    _reject_unknown("the AFD config", folded, CANONICAL_KEYS + list(KEY_ALIASES))

    connector = folded.get("connector", default_connector)
    if connector not in CONNECTOR_ALIASES:
        raise ConfigError(f"connector must be one of {', '.join(CONNECTOR_ALIASES)}, got {connector!r}")
    connector = CONNECTOR_ALIASES[connector]
    role = folded.get("role")
    if role is not None and role not in ROLES:
        raise ConfigError(f"role must be 'attention' or 'ffn', got {role!r}")
    host = folded.get("host", "127.0.0.1")
    if not isinstance(host, str) or not host.strip():
        raise ConfigError(f"host must be a non-empty host name or IP address, got {host!r}")
    port = _check_int("port", folded.get("port", DEFAULT_PORT), minimum=1, maximum=65535)
    num_attn = _check_int(
        "num_attention_ranks", folded.get("num_attention_ranks", 1), minimum=1, maximum=MAX_RANKS_PER_ROLE
    )
    num_ffn = _check_int("num_ffn_ranks", folded.get("num_ffn_ranks", 1), minimum=1, maximum=MAX_RANKS_PER_ROLE)
    gate_on_attn = _check_bool("compute_gate_on_attention", folded.get("compute_gate_on_attention", True))
    extra_raw = folded.get("connector_extra_config") or {}
    if not isinstance(extra_raw, dict):
        raise ConfigError(f"connector_extra_config must be a JSON object, got {extra_raw!r}")
    extra = (AsyncExtraConfig if connector == "async" else P2pExtraConfig).from_dict(extra_raw)
    if connector == "async" and not gate_on_attn:
        raise ConfigError(
            "the async connector needs the gate on attention; set compute_gate_on_attention to true or use p2p"
        )
    return AFDConfig(
        role=role,
        connector=connector,
        host=host.strip(),
        port=port,
        num_attention_ranks=num_attn,
        num_ffn_ranks=num_ffn,
        compute_gate_on_attention=gate_on_attn,
        connector_extra_config=extra,
    )
