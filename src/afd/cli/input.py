"""What the `afd` command line accepts: value types for argparse, and prompts from a flag or a file.

Each refuses bad input with one sentence (argparse types raise `ArgumentTypeError`, the rest
`UsageError`), which the CLI prints with exit status 2. Pure apart from reading the prompts file and a
model's config.json.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable

from afd.config import MAX_RANKS_PER_ROLE, DuplicateKeyError, InputError, read_text_file, unique_keys

MAX_PROMPTS_FILE_BYTES = 256 << 20  # ~40 M token ids of JSON; more is the wrong file, not a workload
MAX_BATCHED_TOKENS = 1 << 20  # the async window is sized by it: a typo must not ask for terabytes
MAX_TOKEN_ID_DIGITS = 18  # no vocabulary comes near; longer digit strings are refused before int()


class UsageError(Exception):
    """Bad input from the user: printed as one sentence, exit status 2."""


def int_in_range(minimum: int, maximum: int | None, what: str) -> Callable[[str], int]:
    """An argparse type: an integer in [minimum, maximum], or one sentence saying what was expected."""

    def parse(text: str) -> int:
        stripped = text.strip()
        digits = stripped[1:] if stripped[:1] == "-" else stripped
        value = int(stripped) if digits.isascii() and digits.isdigit() and len(digits) <= 30 else None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"expected a {what} integer of at most {maximum}, got {text!r}")
        return value

    return parse


def int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    return int_in_range(minimum, None, what)


positive_int = int_at_least(1, "positive")
non_negative_int = int_at_least(0, "non-negative")
rank_count = int_in_range(1, MAX_RANKS_PER_ROLE, "positive")
port_number = int_in_range(1, 65535, "port (1-65535)")
batched_tokens = int_in_range(1, MAX_BATCHED_TOKENS, "positive")


block_size = int_in_range(1, 1024, "positive")
max_num_seqs = int_in_range(1, 1 << 16, "positive")


def memory_fraction(text: str) -> float:
    """An argparse type: a fraction in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction greater than 0 and at most 1, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds greater than 0 (`nan` would disable the bound)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds greater than 0, got {text!r}")
    return value


def sampling_value(field: str, parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse type for one field of `SamplingParams`, checked by its own validation (one sentence)."""

    def convert(text: str) -> object:
        try:
            value = parse(text.strip())
        except ValueError:
            value = text  # not a number: let the validation name what it expected
        try:
            from afd.engine.sampling import SamplingParams

            SamplingParams(**{field: value})
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    return convert


def strict_int(text: str) -> int:
    """An integer in ASCII digits with an optional sign (no `1_0`, `+3`, non-ASCII digits or 400-digit strings)."""
    digits = text[1:] if text[:1] == "-" else text
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 30):
        raise ValueError(text)
    return int(text)


CONNECTOR_NAMES = ("p2p", "async")


PROMPT_IDS_GRAMMAR = (
    "token ids in ASCII digits, ',' between the ids of a prompt and ';' between prompts "
    '(spaces allowed around them), e.g. "1,2,3;4,5"'
)


def parse_prompt_ids(text: str) -> list[list[int]]:
    """`"1,2,3;4,5"` -> `[[1, 2, 3], [4, 5]]`: the one grammar for prompt ids on a command line.

    prompts := prompt (';' prompt)*, prompt := id (',' id)*, id := [0-9]+, spaces around any of them.
    Strict on purpose: `int()` would also take `+3`, `1_0` and non-ASCII digits, and a skipped empty
    item (`1,,2`) silently changes the prompt.
    """
    if not text.strip(" "):
        raise UsageError(f"--prompt-ids is empty; give {PROMPT_IDS_GRAMMAR}")
    prompts = []
    for i, chunk in enumerate(text.split(";")):
        if not chunk.strip(" "):
            raise UsageError(f"prompt {i} in --prompt-ids is empty; every prompt needs at least one token id")
        ids = []
        for item in chunk.split(","):
            token = item.strip(" ")
            if not token:
                raise UsageError(
                    f"prompt {i} in --prompt-ids has an empty token id (',' twice in a row or at an end); "
                    f"--prompt-ids takes {PROMPT_IDS_GRAMMAR}"
                )
            if not (token.isascii() and token.isdigit()):
                raise UsageError(f"--prompt-ids must be integers, got {token!r}; it takes {PROMPT_IDS_GRAMMAR}")
            if len(token) > MAX_TOKEN_ID_DIGITS:
                raise UsageError(f"token id {token[:MAX_TOKEN_ID_DIGITS]}... in --prompt-ids is far too large")
            ids.append(int(token))
        prompts.append(ids)
    return prompts


def _prompt_line(line: str, n: int, path: str) -> list[int]:
    """One line of a prompts file: a JSON object whose `prompt_ids` is a non-empty list of integers."""
    what = f"line {n} of {path!r}"
    try:
        obj = json.loads(line, object_pairs_hook=unique_keys)
    except json.JSONDecodeError:
        raise UsageError(f'{what} is not JSON; each line must be an object such as {{"prompt_ids": [1, 2]}}') from None
    except DuplicateKeyError as exc:
        raise UsageError(f"{what} gives the key {exc.key!r} twice; keep one") from None
    ids = obj.get("prompt_ids") if isinstance(obj, dict) else None
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise UsageError(f"{what} is not a JSON object with a list of integer prompt_ids")
    if not ids:
        raise UsageError(f"{what} has an empty prompt; every prompt needs at least one token id")
    return ids


def read_prompts_file(path: str, *, allow_empty: bool = False) -> list[list[int]]:
    """One `{"prompt_ids": [...]}` per line; blank lines are skipped. A regular UTF-8 file of bounded size."""
    try:
        text = read_text_file(path, "prompts file", MAX_PROMPTS_FILE_BYTES)
    except InputError as exc:
        raise UsageError(str(exc)) from None
    prompts = [_prompt_line(line, n, path) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not prompts and not allow_empty:
        raise UsageError(f"prompts file {path!r} holds no prompt")
    return prompts


def read_prompts(args: argparse.Namespace, *, allow_empty: bool = False) -> list[list[int]]:
    """The prompts of --prompt-ids or --prompts-file (an empty string is a value, not a missing flag)."""
    if args.prompt_ids is not None:
        return parse_prompt_ids(args.prompt_ids)
    if args.prompts_file is not None:
        return read_prompts_file(args.prompts_file, allow_empty=allow_empty)
    return []


def check_prompts(model: str, prompts: list[list[int]], device: str, max_new_tokens: int = 0):
    """Fail before anything starts: unknown model, prompts beyond the model's positions, ids outside the
    vocabulary, no CUDA. Returns the model's config."""
    from afd.model.weights import load_model_config

    try:
        config = load_model_config(model)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except KeyError as exc:
        raise UsageError(f"the config.json of {model!r} lacks the key {exc.args[0]!r}") from None
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UsageError(f"the config.json of {model!r} cannot be read ({reason})") from None
    limit = config.max_position_embeddings
    for i, prompt in enumerate(prompts):
        if len(prompt) > limit:
            raise UsageError(
                f"prompt {i} has {len(prompt)} tokens, more than the {limit} positions of {model!r}; shorten it"
            )
        if len(prompt) + max_new_tokens > limit:
            raise UsageError(
                f"prompt {i} has {len(prompt)} tokens and --max-new-tokens is {max_new_tokens}: "
                f"{len(prompt) + max_new_tokens} positions, more than the {limit} of {model!r}; "
                f"lower --max-new-tokens to {limit - len(prompt)} or shorten the prompt"
            )
    for prompt in prompts:
        bad = [t for t in prompt if not 0 <= t < config.vocab_size]
        if bad:
            raise UsageError(f"token id {bad[0]} is outside the vocabulary [0, {config.vocab_size}) of {model!r}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda was given but no CUDA device is visible; use --device cpu")
    return config


def check_cache_fits(args: argparse.Namespace, prompts: list[list[int]]) -> None:
    """With a fixed pool (`--num-gpu-blocks-override`), a request that can never fit is refused before start."""
    from afd.model.kv_cache import blocks_needed

    pool = getattr(args, "num_gpu_blocks_override", None)
    if pool is None:
        return
    for i, prompt in enumerate(prompts):
        tokens = len(prompt) + max(args.max_new_tokens - 1, 0)
        need = blocks_needed(tokens, args.block_size)
        if need > pool:
            raise UsageError(
                f"prompt {i} needs {need} KV-cache blocks of {args.block_size} tokens ({tokens} tokens) but "
                f"--num-gpu-blocks-override gives each engine {pool}; raise it or lower --max-new-tokens"
            )


def size_list(flag: str) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated positive integers, or one sentence saying what was expected."""

    def parse(text: str) -> list[int]:
        items = [t.strip() for t in text.split(",")]
        if not all(t.isascii() and t.isdigit() and 0 < len(t) <= 9 and int(t) > 0 for t in items):
            raise argparse.ArgumentTypeError(
                f"{flag} takes positive integers separated by ',' (e.g. 1,8), got {text!r}"
            )
        return [int(t) for t in items]

    return parse


def choice_list(flag: str, choices: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: a comma-separated list of `choices`, in the order given, without repeats."""

    def parse(text: str) -> tuple[str, ...]:
        names = [n.strip() for n in text.split(",")]
        bad = [n for n in names if n not in choices]
        if bad:
            raise argparse.ArgumentTypeError(
                f"{flag} takes {' and/or '.join(choices)} separated by ',', got {bad[0]!r} in {text!r}"
            )
        return tuple(dict.fromkeys(names))

    return parse


connector_list = choice_list("--connectors", CONNECTOR_NAMES)  # p2p and/or async, in the order given


def prefill_list(text: str) -> list[tuple[int, int]]:
    """An argparse type: comma-separated BxC pairs (e.g. 8x1024), or '' for none."""
    if not text.strip():
        return []
    out = []
    for item in text.split(","):
        b, _, c = item.strip().lower().partition("x")
        parsed = size_list("--prefill")(f"{b},{c}") if b and c else None
        if parsed is None:
            raise argparse.ArgumentTypeError(f"--prefill takes BxC pairs separated by ',' (e.g. 8x1024), got {text!r}")
        out.append((parsed[0], parsed[1]))
    return out


# ---------------------------------------------------------------- afd bench serve
def rate_list(text: str) -> list[float]:
    """An argparse type: request rates per second, comma-separated (`inf`: every request at once)."""
    rates = []
    for item in text.split(","):
        try:
            rate = float(item)
        except ValueError:
            rate = math.nan
        if not rate > 0:  # also nan
            raise argparse.ArgumentTypeError(f"positive request rates per second or inf, comma-separated; got {text!r}")
        rates.append(rate)
    return rates


SERVER_KEYS = {"R": "--replicas", "A": "--attention", "F": "--ffn", "U": "--ubatches"}
# async servers by where their shared experts run: the default (attention), +sa on the attention ranks, +sf on the
# FFN ranks
ASYNC_PLACEMENTS = {"async": None, "async+sa": "attention", "async+sf": "ffn"}


def compare_list(text: str) -> list[tuple[str, list[str]]]:
    """`none:R=2,async:A=2,F=2` -> [("none R=2", [flags]), ("async A=2,F=2", [flags])]: server configs to compare."""
    configs: list[tuple[str, dict[str, int]]] = []
    for item in (t.strip() for t in text.split(",")):
        name, sep, rest = item.partition(":")
        if name in ("none", "p2p", *ASYNC_PLACEMENTS):
            configs.append((name, {}))
            item = rest if sep else ""
        if not item:
            continue
        key, eq, value = item.partition("=")
        if not configs or key not in SERVER_KEYS or not eq or not value.isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(
                "--compare takes connector:KEY=N items with KEY one of R, A, F, U "
                f"(e.g. none:R=2,async:A=2,F=2,U=2), got {text!r}"
            )
        configs[-1][1][key] = int(value)
    out = []
    for connector, keys in configs:
        if connector == "none" and ({"A", "F", "U"} & set(keys)) or connector != "none" and "R" in keys:
            raise argparse.ArgumentTypeError(
                f"--compare: connector none takes R=N, p2p and async take A=N,F=N and U=N micro-batches ({text!r})"
            )
        flags = ["--connector", connector.partition("+")[0]]
        where = ASYNC_PLACEMENTS.get(connector)
        flags += ["--shared-experts", where] if where else []
        flags += [f for k, v in keys.items() for f in (SERVER_KEYS[k], str(v))]
        label = connector + (" " + ",".join(f"{k}={v}" for k, v in keys.items()) if keys else "")
        out.append((label, flags))
    return out
