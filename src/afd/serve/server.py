"""The HTTP layer of `afd serve`: a FastAPI application served by uvicorn (httptools), and its shutdown.

Routes stay thin: FastAPI checks the body against `protocol`'s models, `state.admit` refuses what cannot be taken,
`responses` runs the prompts and shapes the answer. Every failure a client can cause is an OpenAI error object
with its status; an unexpected exception is a 500 with one line in the log, and the server keeps serving. What
must happen before a body is read (the API key, the `Host` rule) is `gate.Gate`'s.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import socket
import time
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from afd.serve import DRAIN_S
from afd.serve.busy_poll import spin
from afd.serve.gate import ARRIVED, Gate, body_too_large
from afd.serve.metrics import CONTENT_TYPE
from afd.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    validation_error,
)
from afd.serve.responses import Call, chat_response, completion_response, stream_chat, stream_completion
from afd.serve.state import ServerState
from afd.serve.streaming import ClientGone, EventStream, unless_disconnected
from afd.serve.tokenizer import TokenizerError

logger = logging.getLogger(__name__)

KEEP_ALIVE_S = 75.0  # an idle kept-alive connection is closed after this long
CLOSE_S = 2.0  # after the drain: how long open connections get to finish before their tasks are cancelled
BODY_BYTES_PER_TOKEN = 64  # a token of text as JSON, escaped character by character, with room to spare
BODY_SLACK_BYTES = 1 << 20  # the other fields, and a batch of short prompts


def body_limit(max_model_len: int) -> int:
    """The largest request body taken (413 beyond, refused before it is read whole: `Gate`): a full context of text
    even when every character is escaped, plus 1 MiB (4,096 tokens: 1.25 MiB; a body of token ids holds ~150k)."""
    return BODY_BYTES_PER_TOKEN * max_model_len + BODY_SLACK_BYTES


def json_response(model, status: int = 200) -> Response:
    """A model's JSON as the response (serialized once: FastAPI would validate a returned model again)."""
    return Response(model.model_dump_json(), status, media_type="application/json")


def error_response(err: APIError, *, close: bool = False) -> Response:
    headers = {**err.headers, **({"Connection": "close"} if close else {})}
    return Response(json.dumps(err.body()), err.status, headers, media_type="application/json")


# ---------------------------------------------------------------- the application
def build_app(state: ServerState) -> FastAPI:
    """The FastAPI application of one server (routes, their error objects, the body limit)."""
    errors = {400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}, 429: {"model": ErrorResponse}}
    app = FastAPI(title="afd serve", summary="OpenAI-compatible API over afd replicas")

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        return error_response(validation_error(list(exc.errors())))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            return error_response(APIError(404, f"there is no route {request.url.path}"))
        if exc.status_code == 405:
            return error_response(APIError(405, f"{request.url.path} does not take {request.method}"))
        if exc.status_code == 413:  # a chunked body past the limit (`Gate`): the rest of it stays unread
            return error_response(body_too_large(body_limit(state.pool.max_model_len)), close=True)
        return error_response(APIError(exc.status_code, str(exc.detail)), close=exc.status_code >= 500)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:  # logged by the gate
        return error_response(APIError(500, "the server failed on this request; see its log"), close=True)

    @app.get("/health")
    async def health() -> Response:
        """200 while some replica serves (status ok or degraded), 503 when none does (down)."""
        body = state.health()
        return Response(json.dumps(body), 503 if body["status"] == "down" else 200, media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        pool = state.pool
        text = pool.metrics.render(
            healthy=state.status() == "ok", front_waiting=pool.waiting(), replicas_alive=sum(pool.alive)
        )
        return Response(text, media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> Response:
        name = state.options.model_name
        card = ModelCard(id=name, created=state.created, root=name, max_model_len=state.pool.max_model_len)
        return json_response(ModelList(data=[card]))

    @app.post("/v1/completions", response_model=CompletionResponse, responses=errors)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        stamps = {"arrived": request.scope[ARRIVED], "handler": time.perf_counter()}
        prompts, params = body.prompts(), body.generation()
        state.admit(body.model, len(prompts))
        call = Call.build(state, "cmpl", [state.encode(p) for p in prompts], params, prompts, stamps)
        if params.stream:
            call.start()
            return EventStream(stream_completion(call), call.abort, call.id)
        return await _answer(request, call, completion_response)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=errors)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        stamps = {"arrived": request.scope[ARRIVED], "handler": time.perf_counter()}
        params = body.generation()
        state.admit(body.model, 1)
        try:
            prompt_ids = state.tokenizer.chat_prompt(body.chat())
        except TokenizerError as exc:
            raise APIError(400, str(exc), param="messages") from None
        call = Call.build(state, "chatcmpl", [prompt_ids], params, http_stamps=stamps)
        if params.stream:
            call.start()
            return EventStream(stream_chat(call), call.abort, call.id)
        return await _answer(request, call, chat_response)

    return app


async def _answer(request: Request, call: Call, respond) -> Response:
    """A whole answer; a client that leaves first has its prompts aborted on their replicas."""
    try:
        return json_response(await unless_disconnected(request.receive, respond(call)))
    except ClientGone:
        return Response(status_code=204)  # nobody reads it


# ---------------------------------------------------------------- running it
def uvicorn_server(app, *, keep_alive_s: float = KEEP_ALIVE_S) -> uvicorn.Server:
    """uvicorn over `app`, on the running loop, with httptools as the parser; logging and signals stay ours."""
    config = uvicorn.Config(
        app,
        http="httptools",
        ws="none",
        lifespan="off",
        loop="none",
        interface="asgi3",
        log_config=None,
        access_log=False,
        proxy_headers=False,
        server_header=False,
        timeout_keep_alive=keep_alive_s,
        timeout_graceful_shutdown=CLOSE_S,
    )
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    return server


async def serve(
    state: ServerState,
    sock: socket.socket,
    stop: asyncio.Event,
    on_ready: Callable[[], None],
    replica_bye_s: float = 5.0,
) -> None:
    """Serve on a bound socket until `stop` is set, then shut down in order: stop accepting, let in-flight
    requests finish (at most `DRAIN_S`), end the rest with an error, close the connections, say `shutdown` to
    every replica. Meanwhile a rank that dies ends the requests of the replicas it served, and the healer
    (`afd.serve.healing`) restarts it. uvicorn's own `serve` is not used: it would take the signals, which are
    the caller's."""
    state.pool.start()
    gate = Gate(build_app(state), state.options.api_key, body_limit(state.pool.max_model_len))
    server = uvicorn_server(gate)
    await server.startup(sockets=[sock])
    # What start-up made lives as long as the server: frozen, no collection walks it again. While serving, the heap is
    # mostly the live requests' state and collections find next to nothing (a 1,024-stream run freed 56 objects in
    # ~650 collections; its 4 full ones took 70 ms each), so they run once per 50,000 allocations, full ones rarely.
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    watcher = asyncio.create_task(state.healer.run()) if state.healer is not None else None
    spinner = asyncio.create_task(spin()) if state.options.busy_poll else None
    on_ready()
    try:
        await stop.wait()
    finally:
        if watcher is not None:
            watcher.cancel()
        if spinner is not None:
            spinner.cancel()
        state.failed_before_stop = state.status() != "ok"
        state.draining = True  # requests on open connections get 503
        for listener in server.servers:
            listener.close()  # no new connections
        deadline = time.monotonic() + DRAIN_S
        while state.pool.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if state.pool.requests:
            logger.warning("%d requests still running after %g s; ending them", len(state.pool.requests), DRAIN_S)
            state.pool.fail("the server is shutting down")
        await server.shutdown()
        # a replica whose world lost a rank cannot finish a step: do not wait long for its bye
        wait_s = min(replica_bye_s, 0.5) if state.failed_before_stop else replica_bye_s
        silent = await asyncio.to_thread(state.pool.shutdown, wait_s)
        state.pool.close()
        if silent:
            logger.warning("replicas %s did not answer the shutdown; their ranks are stopped", silent)
