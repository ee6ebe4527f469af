"""Online serving: an OpenAI-compatible HTTP front end over running engine replicas (`afd serve`).

This module stays free of the serving stack's packages, so that a command can say what is missing before it
imports them.
"""

from __future__ import annotations

from importlib.util import find_spec

DRAIN_S = 20.0  # a stop: in-flight requests get this long to finish before they are ended with an error
# one /v1/completions request's prompts at most: one replica's running batch at vLLM's default --max-num-seqs
MAX_PROMPTS_PER_REQUEST = 256
STACK = ("fastapi", "uvicorn", "httptools", "pydantic", "prometheus_client")  # the `afd[serve]` extra


def missing_packages(names: tuple[str, ...] = STACK) -> list[str]:
    """Those of `names` that cannot be imported here."""
    return [name for name in names if find_spec(name) is None]
