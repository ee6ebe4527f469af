"""`afd bench serve --chaos SECONDS`: its flags and its run (`afd.bench.chaos_run`), called by `afd.cli.serve`."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.parse
from pathlib import Path

from afd.cli.input import UsageError, positive_seconds

DEFAULT_INTERVAL_S = 5.0


def add_chaos_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--chaos",
        type=positive_seconds,
        metavar="SECONDS",
        help="for SECONDS under Poisson load at the first of --rates, kill -9 a random rank of the server every "
        "--chaos-interval seconds (each once the server is whole again); every answer is checked against the "
        "reference's greedy tokens (on --device cpu the single-process engine, else the server's own before the "
        "first kill); prints completed / failed / wrong / hung and the time to heal after each kill. A server it "
        "starts (the one --compare config) restarts a rank after every kill: its --restart-window is half the "
        "interval, so deliberate kills never look like a crash loop",
    )
    s.add_argument(
        "--chaos-interval",
        type=positive_seconds,
        default=DEFAULT_INTERVAL_S,
        help=f"seconds from the server being whole again to the next kill (default {DEFAULT_INTERVAL_S:g})",
    )
    s.add_argument(
        "--chaos-bound",
        type=positive_seconds,
        default=60.0,
        help="seconds a request may take before it counts as hung (default 60)",
    )


def cmd_bench_chaos(args: argparse.Namespace, workload, rates: list[float], server_argv: list[str],
                    vocab_size: int) -> int:  # fmt: skip
    """Run the chaos on the server of `--url` (on this host) or on one `afd serve server_argv + --compare`."""
    import math

    from afd import env
    from afd.bench.chaos import server_pid_of
    from afd.bench.chaos_run import chaos_server, format_chaos, run_chaos, server_reference
    from afd.serve.run import ServeError

    if args.overhead or args.plot or workload.timed:
        raise UsageError("--chaos takes neither --overhead, --plot nor a trace with its own arrival times")
    if len(args.compare) != 1 or len(rates) != 1 or math.isinf(rates[0]):
        raise UsageError("--chaos runs one server (one --compare config) at one finite --rates")
    prompts, max_tokens = workload.prompts(vocab_size), workload.max_tokens_of()
    chaos = dict(rate=rates[0], seconds=args.chaos, interval_s=args.chaos_interval, bound_s=args.chaos_bound,
                 heal_bound_s=max(60.0, args.chaos_bound), seed=args.bench_seed)  # fmt: skip
    engine = None
    if args.device == "cpu":
        engine = dict(model=args.model, dtype=args.dtype, seed=args.seed, quantization=args.quantization)
    try:
        if args.url:
            parts = urllib.parse.urlsplit(args.url)
            pid = server_pid_of(parts.port or 80) if parts.hostname in ("127.0.0.1", "localhost") else None
            if pid is None:
                raise UsageError(f"--chaos kills the ranks of a server on this host; none listens at {args.url}")
            url, key = args.url.rstrip("/"), args.api_key or env.api_key()
            if engine is not None:
                from afd.bench.chaos_run import engine_reference

                reference = engine_reference(prompts, max_tokens, **engine)
            else:
                reference = server_reference(url, prompts, max_tokens, args.chaos_bound, _auth(key))
            name, summary = args.url, run_chaos(url, pid, prompts, max_tokens, reference, api_key=key, **chaos)
        else:
            name, flags = args.compare[0]
            window = ["--restart-window", f"{args.chaos_interval / 2:g}"]
            argv = [*server_argv, *flags, *window]
            summary = chaos_server(argv, prompts, max_tokens, engine, startup_timeout_s=args.startup_timeout, **chaos)
    except (ServeError, RuntimeError, TimeoutError) as exc:
        print(f"afd: error: {exc}", file=sys.stderr)
        return 1
    print(format_chaos(name, summary))
    if args.json:
        raw = {"workload": workload.describe() | {"rate": rates[0]}, "chaos": {"name": name, **chaos}, **summary}
        Path(args.json).write_text(json.dumps(raw, indent=2))
    return 0


def _auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}
