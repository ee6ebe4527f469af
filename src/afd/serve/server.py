"""The HTTP layer of `afd serve` (aiohttp): routes, the error object, the API key, health, and shutdown.

Handlers stay thin: `protocol` checks the body, `output.run_request` drives each prompt on a replica,
and the handlers only shape what comes back (`responses`). Every failure a client can cause is an
OpenAI error object with its status; an unexpected exception is a 500 with one line in the log, and the
server keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from afd import env
from afd.serve import metrics
from afd.serve.frontend import ReplicaPool
from afd.serve.protocol import APIError, parse_chat, parse_completion, parse_json
from afd.serve.responses import Call, chat_response, completion_response, stream_chat, stream_completion
from afd.serve.tokenizer import Tokenizer, TokenizerError

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20  # a 1M-token prompt as JSON ids is ~8 MB
DRAIN_S = 20.0  # SIGTERM: in-flight requests get this long to finish before they are ended with an error
HEALTH_POLL_S = 0.25


@dataclass
class ServeOptions:
    model_name: str  # what /v1/models lists and requests must name
    api_key: str | None = None
    max_waiting: int = 1024  # requests allowed to wait for a replica before new ones get 429


class ServerState:
    """What the handlers share: the replicas, the tokenizer, the options, and whether the server is healthy."""

    def __init__(
        self,
        pool: ReplicaPool,
        tokenizer: Tokenizer,
        options: ServeOptions,
        dead_ranks: Callable[[], list[str]] = list,
    ) -> None:
        self.pool, self.tokenizer, self.options = pool, tokenizer, options
        self.dead_ranks = dead_ranks  # names of ranks that stopped (the rank supervisor's `.dead()`)
        pool.cause_of_loss = lambda: rank_failure(dead) if (dead := self.dead_ranks()) else None
        self.draining = False
        self.failed_before_stop = False  # a rank or replica was gone when the stop came (the exit status says so)
        self.created = int(time.time())

    def problem(self) -> str | None:
        """Why the server cannot serve now, or None when every rank and replica is up."""
        dead = self.dead_ranks()
        if dead:
            return rank_failure(dead)
        lost = [r for r, ok in enumerate(self.pool.alive) if not ok]
        if lost:
            return f"replica {lost[0]} stopped; the server cannot generate"
        if self.draining:
            return "the server is shutting down"
        return None

    def admit(self, model: str | None) -> None:
        """Refuse a request for another model (404), while unhealthy or stopping (503), or when too many wait (429)."""
        if model is not None and model != self.options.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.options.model_name!r}",
                param="model",
            )
        problem = self.problem()
        if problem:
            raise APIError(503, problem)
        waiting = self.pool.waiting()
        if waiting >= self.options.max_waiting:
            raise APIError(
                429,
                f"{waiting} requests are already waiting for a replica (--max-waiting {self.options.max_waiting}); "
                "retry later",
                headers={"Retry-After": "1"},
            )

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        try:
            return self.tokenizer.encode(prompt)
        except TokenizerError as exc:
            raise APIError(400, str(exc), param="prompt") from None


def rank_failure(dead: list[str]) -> str:
    """One sentence for ranks that stopped (the supervisor's lines, e.g. 'ffn rank 0 ... exited with status -9')."""
    more = f" (and {len(dead) - 1} more)" if len(dead) > 1 else ""
    return f"{dead[0]}{more}; the server cannot generate until it is restarted"


STATE = web.AppKey("state", ServerState)


# ---------------------------------------------------------------- middlewares
def _error_response(err: APIError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers)


@web.middleware
async def errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error a client sees is the OpenAI error object, also aiohttp's own 404/405/413."""
    try:
        return await handler(request)
    except APIError as err:
        return _error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error_response(APIError(exc.status, exc.reason or "the request failed"))
    except (asyncio.CancelledError, ConnectionError):
        raise  # the client left
    except Exception:
        logger.exception("unexpected error in %s %s", request.method, request.path)
        return _error_response(APIError(500, "the server failed on this request; see its log"))


@web.middleware
async def api_key(request: web.Request, handler) -> web.StreamResponse:
    """With --api-key, every /v1 route needs `Authorization: Bearer KEY` (health and metrics stay open)."""
    key = request.app[STATE].options.api_key
    if key and request.path.startswith("/v1"):
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise APIError(401, "the API key is missing or wrong; send the header Authorization: Bearer KEY")
    return await handler(request)


# ---------------------------------------------------------------- routes
async def health(request: web.Request) -> web.Response:
    problem = request.app[STATE].problem()
    if problem:
        return _error_response(APIError(503, problem))
    return web.Response(status=200)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    card = {
        "id": state.options.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "afd",
        "root": state.options.model_name,
        "max_model_len": state.pool.max_model_len,
    }
    return web.json_response({"object": "list", "data": [card]})


async def metrics_page(request: web.Request) -> web.Response:
    state = request.app[STATE]
    text = metrics.render(state.pool.metrics, healthy=state.problem() is None, front_waiting=state.pool.waiting())
    return web.Response(body=text.encode(), headers={"Content-Type": metrics.CONTENT_TYPE})


async def completions(request: web.Request) -> web.StreamResponse:
    received_at = time.perf_counter()
    state = request.app[STATE]
    req = parse_completion(parse_json(await request.read()))
    state.admit(req.model)
    call = Call.build(state, "cmpl", [state.encode(p) for p in req.prompts], req.params, req.prompts, received_at)
    if req.params.stream:
        return await stream_completion(request, call)
    return web.json_response(await completion_response(call))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    received_at = time.perf_counter()
    state = request.app[STATE]
    req = parse_chat(parse_json(await request.read()))
    state.admit(req.model)
    try:
        prompt_ids = state.tokenizer.chat_prompt(req.messages)
    except TokenizerError as exc:
        raise APIError(400, str(exc), param="messages") from None
    call = Call.build(state, "chatcmpl", [prompt_ids], req.params, received_at=received_at)
    if req.params.stream:
        return await stream_chat(request, call)
    return web.json_response(await chat_response(call))


def build_app(state: ServerState) -> web.Application:
    # the key's check only when there is a key: one coroutine fewer between a request and its handler otherwise
    middlewares = [errors, api_key] if state.options.api_key else [errors]
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[STATE] = state
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_page)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app


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
    runner = web.AppRunner(build_app(state), handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
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
        await site.stop()  # no new connections; requests on open ones get 503
        deadline = time.monotonic() + DRAIN_S
        while state.pool.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if state.pool.requests:
            logger.warning("%d requests still running after %g s; ending them", len(state.pool.requests), DRAIN_S)
            state.pool.fail("the server is shutting down")
        await runner.cleanup()
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
