"""The HTTP layer of `afd serve` (on `afd.serve.http_server`): routes, the error object, the API key, health,
and shutdown.

Handlers stay thin: `protocol` checks the body, `output.run_request` drives each prompt on a replica,
and the handlers only shape what comes back (`responses`). Every failure a client can cause is an
OpenAI error object with its status; an unexpected exception is a 500 with one line in the log, and the
server keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import time
from collections.abc import Callable

from afd import env
from afd.serve import metrics
from afd.serve.http_server import Handler, HTTPError, HTTPServer, Request, Response
from afd.serve.protocol import APIError, parse_chat, parse_completion, parse_json
from afd.serve.responses import Call, chat_response, completion_response, stream_chat, stream_completion
from afd.serve.state import ServerState, rank_failure
from afd.serve.tokenizer import TokenizerError

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20  # a 1M-token prompt as JSON ids is ~8 MB
DRAIN_S = 20.0  # SIGTERM: in-flight requests get this long to finish before they are ended with an error
HEALTH_POLL_S = 0.25


def json_response(obj: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(status, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})


def _error_response(err: APIError) -> Response:
    return json_response(err.body(), err.status, err.headers)


def error_response(exc: Exception, request: Request | None) -> Response:
    """Every error a client sees is the OpenAI error object: ours, the HTTP layer's own refusals (400, 404, 405,
    408, 413, 431, 501), and an unexpected exception (500, with one line in the log)."""
    if isinstance(exc, APIError):
        return _error_response(exc)
    if isinstance(exc, HTTPError):
        return _error_response(APIError(exc.status, exc.message, headers=exc.headers))
    where = f" in {request.method} {request.path}" if request is not None else ""
    logger.exception("unexpected error%s", where, exc_info=exc)
    return _error_response(APIError(500, "the server failed on this request; see its log"))


def keyed(handler: Handler, key: str) -> Handler:
    """With --api-key, the /v1 routes need `Authorization: Bearer KEY` (health and metrics stay open)."""
    expected = f"Bearer {key}".encode()

    async def guarded(request: Request) -> Response | None:
        if not hmac.compare_digest(request.headers.get("authorization", "").encode(), expected):
            raise APIError(401, "the API key is missing or wrong; send the header Authorization: Bearer KEY")
        return await handler(request)

    return guarded


# ---------------------------------------------------------------- routes
def build_routes(state: ServerState) -> dict[tuple[str, str], Handler]:
    async def health(request: Request) -> Response:
        problem = state.problem()
        return _error_response(APIError(503, problem)) if problem else Response(200)

    async def models(request: Request) -> Response:
        card = {
            "id": state.options.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "afd",
            "root": state.options.model_name,
            "max_model_len": state.pool.max_model_len,
        }
        return json_response({"object": "list", "data": [card]})

    async def metrics_page(request: Request) -> Response:
        text = metrics.render(state.pool.metrics, healthy=state.problem() is None, front_waiting=state.pool.waiting())
        return Response(200, text.encode(), {"Content-Type": metrics.CONTENT_TYPE})

    async def completions(request: Request) -> Response | None:
        stamps = {"arrived": request.arrived_at, "handler": time.perf_counter()}
        req = parse_completion(parse_json(request.body))
        state.admit(req.model)
        call = Call.build(state, "cmpl", [state.encode(p) for p in req.prompts], req.params, req.prompts, stamps)
        if req.params.stream:
            return await stream_completion(request, call)
        return json_response(await completion_response(call))

    async def chat_completions(request: Request) -> Response | None:
        stamps = {"arrived": request.arrived_at, "handler": time.perf_counter()}
        req = parse_chat(parse_json(request.body))
        state.admit(req.model)
        try:
            prompt_ids = state.tokenizer.chat_prompt(req.messages)
        except TokenizerError as exc:
            raise APIError(400, str(exc), param="messages") from None
        call = Call.build(state, "chatcmpl", [prompt_ids], req.params, http_stamps=stamps)
        if req.params.stream:
            return await stream_chat(request, call)
        return json_response(await chat_response(call))

    key = state.options.api_key
    guard = (lambda h: keyed(h, key)) if key else (lambda h: h)
    return {
        ("GET", "/health"): health,
        ("GET", "/metrics"): metrics_page,
        ("GET", "/v1/models"): guard(models),
        ("POST", "/v1/completions"): guard(completions),
        ("POST", "/v1/chat/completions"): guard(chat_completions),
    }


# ---------------------------------------------------------------- running it
async def serve(
    state: ServerState,
    sock: socket.socket,
    stop: asyncio.Event,
    on_ready: Callable[[], None],
    replica_bye_s: float = 5.0,
) -> None:
    """Serve on a bound socket until `stop` is set, then shut down in order: stop accepting, let in-flight
    requests finish (at most `DRAIN_S`), end the rest with an error, say `shutdown` to every replica.
    A rank that dies meanwhile makes /health answer 503 and ends every in-flight request with an error."""
    state.pool.start()
    server = HTTPServer(build_routes(state), error_response, max_body_bytes=MAX_BODY_BYTES)
    await server.start(sock)
    watcher = asyncio.create_task(_watch_ranks(state))
    spinner = asyncio.create_task(spin()) if env.busy_poll() else None
    on_ready()
    try:
        await stop.wait()
    finally:
        watcher.cancel()
        if spinner is not None:
            spinner.cancel()
        state.failed_before_stop = state.problem() is not None
        state.draining = True
        server.stop_accepting()  # no new connections; requests on open ones get 503
        deadline = time.monotonic() + DRAIN_S
        while state.pool.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if state.pool.requests:
            logger.warning("%d requests still running after %g s; ending them", len(state.pool.requests), DRAIN_S)
            state.pool.fail("the server is shutting down")
        await server.close(2.0)
        # a replica whose world lost a rank cannot finish a step: do not wait long for its bye
        wait_s = min(replica_bye_s, 0.5) if state.failed_before_stop else replica_bye_s
        silent = await asyncio.to_thread(state.pool.shutdown, wait_s)
        state.pool.close()
        if silent:
            logger.warning("replicas %s did not answer the shutdown; their ranks are stopped", silent)


async def spin() -> None:
    """`AFD_BUSY_POLL=1`: a task that is always ready keeps the event loop out of a sleeping select, so a request
    or a replica's tokens are taken up on the next turn of the loop, not after a wake-up from idle (the server's
    front end; `afd bench serve`'s client too, so that its own wake-ups stay out of what it measures)."""
    logger.info("busy polling: the event loop never sleeps (AFD_BUSY_POLL=1)")
    while True:
        await asyncio.sleep(0)


async def _watch_ranks(state: ServerState) -> None:
    """A rank that stops ends every in-flight request with an error at once (never a hang)."""
    failed = False
    while True:
        await asyncio.sleep(HEALTH_POLL_S)
        dead = state.dead_ranks()
        if dead and not failed:
            failed = True
            why = rank_failure(dead)
            logger.error("%s", why)
            state.pool.fail(why)
