"""The FastAPI app: OpenAI-compatible completions and chat completions (SSE streaming or not), models,
health, Prometheus metrics, and the admin router.

Handlers validate and tokenize, then hand a :class:`~serving.engine.GenRequest` to the engine thread and
await its :class:`~serving.engine.Event` chunks on an asyncio queue (the engine hops onto this loop with
``call_soon_threadsafe``). A client that goes away cancels its request in the engine, which frees its
batch slot at the next step boundary.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark_core.data.prompts import chat_prompt_text
from dspark_core.engine.inputs import encode_messages
from dspark_core.engine.sampling import SamplingParams

from . import protocol as P
from .admin import router as admin_router
from .engine import Event, GenRequest
from .metrics import CONTENT_TYPE
from .router import base_model, resolve_domain
from .server import ServerState

log = logging.getLogger("dspark.serving.app")
DISCONNECT_POLL_S = 0.25


class BodyLimit:
    """ASGI middleware: a request body above ``max_bytes`` is answered 413 (OpenAI's error shape) from its
    ``Content-Length`` before a byte is read, or as soon as a chunked body passes the limit (the framework
    re-raises an HTTP error met while reading the body); the rest of it is never buffered."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _error(self) -> StarletteHTTPException:
        return StarletteHTTPException(413, f"the request body is larger than {self.max_bytes} bytes")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            exc = self._error()
            body = json.dumps(P.APIError(413, exc.detail, code="request_too_large").body()).encode()
            await send({"type": "http.response.start", "status": 413,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._error()
            return message

        await self.app(scope, limited_receive, send)


def create_app(state: ServerState, manage_lifecycle: bool = True) -> FastAPI:
    """The app for one server. With ``manage_lifecycle`` the lifespan starts and stops the engine, the
    trace writer and the registry poller."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_lifecycle:
            state.start()
        try:
            yield
        finally:
            if manage_lifecycle:
                await asyncio.to_thread(state.stop)

    app = FastAPI(title="dspark", version="1", lifespan=lifespan,
                  description="OpenAI-compatible DSpark speculative-decoding server with per-domain drafters")
    app.state.server = state
    app.include_router(admin_router)
    app.add_middleware(BodyLimit, max_bytes=state.settings.max_request_bytes)

    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, exc: P.APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        # routing and framework errors (unknown path, wrong method, ...) in the same shape as ours
        kind = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}.get(
            exc.status_code, "invalid_request_error" if exc.status_code < 500 else "server_error")
        msg = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404 and msg == "Not Found":
            msg = f"no route {request.method} {request.url.path}"
        code = "request_too_large" if exc.status_code == 413 else None
        return JSONResponse(P.APIError(exc.status_code, msg, type_=kind, code=code).body(),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse(P.APIError(500, "internal server error; the server log has the details",
                                       type_="server_error", code="internal_error").body(), status_code=500)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            msg = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
            return JSONResponse(P.APIError(400, msg, code="invalid_json").body(), status_code=400)
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msgs = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}"
                         for e in errs[:5])
        return JSONResponse(P.APIError(400, msgs or "invalid request", param=loc or None).body(), status_code=400)

    @app.get("/health")
    async def health():
        ok = state.engine.alive
        body = {"status": "ok" if ok else "engine stopped", **state.engine.load(), "model": state.model_name}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        created = P.now()
        ids = [state.model_name] + [f"{state.model_name}:{d}" for d in state.domains]
        return {"object": "list", "data": [{"id": i, "object": "model", "created": created, "owned_by": "dspark"}
                                           for i in ids]}

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request):
        body.check_supported()
        prompt = body.prompt_input()
        if isinstance(prompt, list):
            ids = _check_ids(state, prompt)
            text = await asyncio.to_thread(_decode, state, prompt)
        else:       # tokenising runs off the event loop: a long prompt never stalls other requests
            ids, text = await asyncio.to_thread(_encode, state, prompt, False), prompt
        explicit = body.max_tokens if "max_tokens" in body.model_fields_set else None
        return await _generate(state, request, body, ids, text, text, chat=False, default_max=explicit,
                               unset_max=COMPLETIONS_DEFAULT_MAX_TOKENS)

    @app.post("/v1/chat/completions")
    async def chat(body: P.ChatCompletionRequest, request: Request):
        body.check_supported()
        msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
        users = [m["content"] for m in msgs if m["role"] == "user"]
        prompt_text = chat_prompt_text(msgs)
        ids = await asyncio.to_thread(_encode, state, msgs, True)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await _generate(state, request, body, ids, prompt_text, users[-1] if users else prompt_text,
                               chat=True, default_max=max_tokens)

    return app


# ---------------------------------------------------------------------------------------------- helpers
def _encode(state: ServerState, prompt, chat: bool) -> list[int]:
    tok = state.target.tokenizer
    if chat:
        try:
            return encode_messages(tok, prompt)
        except ValueError:
            raise P.APIError(400, "this model's tokenizer has no chat template: use /v1/completions") from None
    return list(tok(prompt).input_ids)


COMPLETIONS_DEFAULT_MAX_TOKENS = 16      # OpenAI's default for /v1/completions


def _decode(state: ServerState, ids: list[int]) -> str:
    return state.target.tokenizer.decode(ids, skip_special_tokens=True)


def _check_ids(state: ServerState, ids: list[int]) -> list[int]:
    vocab = state.target.runner.arch.vocab_size
    if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
        raise P.APIError(400, f"prompt token ids must be integers in [0, {vocab})", param="prompt")
    return ids


def _budget(state: ServerState, n_prompt: int, max_tokens: int | None, unset_max: int | None = None) -> int:
    """max_tokens after the context check: a prompt at or past the limit, or an explicit max_tokens that
    does not fit, is a 400 naming the limit; an unset max_tokens (``unset_max``, else the server's
    default) is clipped to what fits."""
    ctx = state.context_length
    if n_prompt >= ctx:
        raise P.APIError(400, f"this model's maximum context length is {ctx} tokens, but the prompt has {n_prompt} "
                         f"tokens; shorten the prompt", param="prompt", code="context_length_exceeded")
    room = ctx - n_prompt
    if max_tokens is None:
        return min(unset_max if unset_max is not None else state.settings.max_tokens_default, room)
    if max_tokens > room:
        raise P.APIError(400, f"this model's maximum context length is {ctx} tokens; the prompt has {n_prompt} "
                         f"tokens and max_tokens is {max_tokens}, so at most {room} new tokens fit",
                         param="max_tokens", code="context_length_exceeded")
    return max_tokens


async def _generate(state: ServerState, request: Request, body, ids: list[int], prompt_text: str,
                    route_text: str, chat: bool, default_max: int | None, unset_max: int | None = None):
    if base_model(body.model) not in (state.model_name, "dspark"):
        raise P.APIError(404, f"the model {body.model!r} does not exist; available: {state.model_name} "
                         f"(optionally with a ':<domain>' suffix)", type_="not_found_error", param="model",
                         code="model_not_found")
    if not ids:
        raise P.APIError(400, "the prompt encodes to no tokens", param="prompt")
    max_new = _budget(state, len(ids), default_max, unset_max)
    domain, how = resolve_domain(body.model, body.domain, route_text, state.domains, state.default_domain)
    stops = body.stop_list()
    try:
        params = SamplingParams(temperature=body.temperature, top_k=max(0, body.top_k), top_p=body.top_p,
                                max_new_tokens=max_new,
                                stop_token_ids=() if body.ignore_eos else tuple(state.target.stop_token_ids))
    except ValueError as e:
        raise P.APIError(400, str(e)) from None
    if state.engine.queued() >= state.settings.max_queued:
        raise P.APIError(429, f"the server is at capacity ({state.settings.max_queued} requests waiting); retry "
                         f"shortly", type_="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Event] = asyncio.Queue()
    seed = body.seed if body.seed is not None else secrets.randbits(63)
    greq = GenRequest(rid, domain, ids, prompt_text, params, seed,
                      emit=lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev), stop=stops)
    state.engine.submit(greq)
    reply = _Reply(rid, body.model, P.now(), chat, {"routed_by": how}, body.return_token_ids)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(state, request, queue, reply, include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    text, ids_out, last = [], [], None
    async for ev in _events(state, request, queue, rid):
        if ev.error:
            raise P.APIError(500, ev.error, type_="server_error", code="engine_error")
        text.append(ev.text)
        ids_out.extend(ev.token_ids)
        last = ev
    if last is None:                 # the client went away; nobody reads this
        return Response(status_code=499)
    info = {**(last.info or {}), **reply.extra}
    if reply.return_ids:
        info["completion_token_ids"] = ids_out
    make = P.chat_body if chat else P.completion_body
    return make(rid, reply.model, reply.created, "".join(text), P.finish_reason(last.finish_reason), last.usage,
                info)


@dataclass(frozen=True)
class _Reply:
    """What every chunk or body of one reply repeats."""

    rid: str
    model: str                 # the model name as the client asked for it
    created: int
    chat: bool
    extra: dict                # merged into the final chunk's / body's "dspark" object
    return_ids: bool           # include token ids (dspark extension)


async def _events(state: ServerState, request: Request, queue: asyncio.Queue, rid: str) -> AsyncIterator[Event]:
    """The request's events up to the final one; a disconnected client cancels the request."""
    finished = False
    loop = asyncio.get_running_loop()
    next_check = loop.time() + DISCONNECT_POLL_S
    try:
        while True:
            try:
                ev = await asyncio.wait_for(queue.get(), timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                ev = None
            if loop.time() >= next_check:          # events may arrive every step: check by the clock
                next_check = loop.time() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    return
            if ev is None:
                continue
            yield ev
            if ev.final:
                finished = True
                return
    finally:
        if not finished:
            state.engine.cancel(rid)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _stream(state: ServerState, request: Request, queue: asyncio.Queue, reply: _Reply,
                  include_usage: bool) -> AsyncIterator[str]:
    rid, model, created, chat, return_ids = reply.rid, reply.model, reply.created, reply.chat, reply.return_ids
    ids_out: list[int] = []
    if chat:
        yield _sse(P.chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, None))
    async for ev in _events(state, request, queue, rid):
        if ev.error:
            yield _sse(P.APIError(500, ev.error, type_="server_error", code="engine_error").body())
            return
        finish = P.finish_reason(ev.finish_reason)
        ids_out.extend(ev.token_ids)
        if ev.text or (return_ids and ev.token_ids):
            chunk = P.chat_chunk(rid, model, created, {"content": ev.text}, None) if chat \
                else P.completion_chunk(rid, model, created, ev.text, None)
            if return_ids:
                chunk["choices"][0]["token_ids"] = ev.token_ids
            yield _sse(chunk)
        if ev.final:
            last = P.chat_chunk(rid, model, created, {}, finish) if chat \
                else P.completion_chunk(rid, model, created, "", finish)
            last["dspark"] = {**(ev.info or {}), **reply.extra}
            if return_ids:
                last["dspark"]["completion_token_ids"] = ids_out
            yield _sse(last)
            if include_usage:
                yield _sse(P.usage_chunk(rid, model, created, "chat.completion.chunk" if chat else "text_completion",
                                         ev.usage))
    yield "data: [DONE]\n\n"
