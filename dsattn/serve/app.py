"""OpenAI's /v1/completions and /v1/models over a Runner (FastAPI; the `serve` extra), plus
/health and /metrics. Prompt text goes through the run's tokenizer; `stop` strings are
matched on the decoded text (the request is cancelled at the first, which is not returned, as
OpenAI does); `stream` sends server-sent events. Every refusal is one message in OpenAI's
error shape, and a bad request never reaches the batch.

The body is read up to a limit (413 past it) and parsed, checked and tokenized on a worker
thread, so a big request never stalls the event loop the others are answered from. A client
that disconnects has its request cancelled (its row freed), streamed or not. A request
without `seed` gets a fresh one, reported in the response (`seed`) so it can be redrawn.
`n` choices are n requests, choice i seeded seed + i, all admitted or none. A response's
`usage.prompt_tokens_details.cached_tokens` counts the prompt tokens the prefix cache
supplied (choice 0's, as the prompt is counted once); streams carry no usage.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import hmac
import json
import secrets
import time
import uuid

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from dsattn.errors import InputError
from dsattn.serve.request import Finish, Request
from dsattn.serve.runner import Busy, Down, Runner

DEFAULT_MAX_BODY_BYTES = 4 << 20  # a prompt past any cache here, even JSON-escaped
ENDPOINTS = ("POST /v1/completions", "GET /v1/models", "GET /v1/models/{model}",
             "GET /health", "GET /metrics")
MAX_STOPS = 4  # OpenAI's limit (each is searched for after every token)
# OpenAI's fields this server does not implement: accepted (or null) at the value that
# changes nothing, since clients send them by default; refused otherwise.
NO_OPS = {"best_of": 1, "echo": False, "presence_penalty": 0, "frequency_penalty": 0,
          "logit_bias": {}, "suffix": ""}


class CompletionBody(BaseModel):
    """The fields of OpenAI's completions request this server honours; any other field is
    refused (a client relying on it would silently get something else). Strict: a bool is
    not a number, nor "3" an integer. Null stands for the default, as in OpenAI's API."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str
    max_tokens: int | None = Field(None, ge=0)  # default 16
    temperature: float | None = Field(None, ge=0, le=2)  # OpenAI's range; default 1
    top_p: float | None = Field(None, gt=0, le=1)  # default 1
    stop: str | list[str] | None = None
    stream: bool | None = None
    seed: int | None = Field(None, ge=0, lt=2 ** 31)  # default: a fresh one
    logprobs: int | None = None  # null only: no log probabilities are returned
    user: str | None = None  # ignored
    n: int | None = Field(None, ge=1)  # choices, each its own row and seed (seed + index)
    best_of: int | None = None
    echo: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None


class _Refused(Exception):
    """A request answered with an error in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, param=None, code=None,
                 kind="invalid_request_error", headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind, self.headers = kind, headers

    def content(self) -> dict:
        return _content(self.message, param=self.param, code=self.code, kind=self.kind)

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, headers=self.headers,
                            content=self.content())


def _content(message: str, *, param=None, code=None, kind="invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error(status: int, message: str, *, param=None, code=None, kind="invalid_request_error",
           headers=None) -> JSONResponse:
    return JSONResponse(status_code=status, headers=headers,
                        content=_content(message, param=param, code=code, kind=kind))


def _one_message(exc: RequestValidationError | ValidationError) -> tuple[str, str | None]:
    """The first validation problem as a sentence (pydantic lists them as dicts), and the
    field it is about."""
    e = exc.errors()[0]
    loc = [p for p in e.get("loc", ()) if p != "body"]
    field = str(loc[0]) if loc else None
    if e.get("type") == "extra_forbidden":
        return f"unknown field {field!r}: this server does not support it", field
    if field == "stop" and len(loc) > 1 and isinstance(loc[1], str):  # a union's member
        return f"stop: must be a string or a list of strings, got {_shown(e['input'])}", field
    where = field + "".join(f"[{p}]" for p in loc[1:] if isinstance(p, int)) if loc else "body"
    got = f", got {_shown(e['input'])}" if e.get("type", "").endswith("_type") else ""
    return f"{where}: {e.get('msg', 'invalid')}{got}", field


def _shown(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _json_object(raw: bytes) -> dict:
    """The body as a JSON object (strict JSON: no NaN or Infinity)."""
    try:
        obj = json.loads(raw, parse_constant=_no_constant)
    except UnicodeDecodeError as e:
        raise _Refused(400, f"the body is not UTF-8: {e.reason} at byte {e.start}")
    except (ValueError, RecursionError) as e:
        raise _Refused(400, f"the body is not valid JSON: {e}")
    if not isinstance(obj, dict):
        raise _Refused(400, f"the body must be a JSON object, got {type(obj).__name__}")
    return obj


def _unicode(field: str, text: str) -> None:
    """Refuse a lone surrogate (JSON can escape one; no encoding can hold it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _Refused(400, f"{field}: a lone surrogate (\\u{ord(text[e.start]):04x}) at "
                            f"character {e.start} is not Unicode text", param=field)


class _Text:
    """A request's output as text: tokens through the tokenizer's byte streamer and an
    incremental UTF-8 decoder, with `stop` strings cut off. While streaming, the tail that
    could still begin a stop string is held back."""

    def __init__(self, tokenizer, stop: list[str]):
        self.stream, self.stop = tokenizer.streamer(), [s for s in stop if s]
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text, self.sent, self.stopped = "", 0, False
        self.ends: list[int] = []  # len(text) after each token, before any cut

    def push(self, token: int | None) -> None:
        if self.stopped:  # tokens drawn before the cancel took effect
            return
        raw = self.stream.push(token) if token is not None else self.stream.flush()
        self.text += self.utf8.decode(raw, final=token is None)
        if token is not None:
            self.ends.append(len(self.text))
        hits = [self.text.find(s) for s in self.stop if s in self.text]
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True

    @property
    def tokens(self) -> int:
        """Output tokens of the text returned: after a stop string, the fewest whose text
        holds it (not the stop string's tokens, nor those drawn before the cancel)."""
        if not self.stopped:
            return len(self.ends)
        if not self.text:
            return 0
        return next((k + 1 for k, end in enumerate(self.ends) if end >= len(self.text)), 0)

    def fresh(self, final: bool) -> str:
        """Text not sent yet (all of it when final)."""
        hold = 0 if final or self.stopped else max((len(s) - 1 for s in self.stop), default=0)
        end = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent: end], end
        return out


class _Guard:
    """ASGI middleware before every route: the API key (every path but /health), then the
    body read as it arrives up to `max_body_bytes` (413 past it, at once if its declared
    length is), then replayed to the app, whose later receive() still sees a disconnect."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes
        self.key = f"bearer {api_key}".encode() if api_key else None

    def _authorized(self, scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, key = given.partition(b" ")
        return hmac.compare_digest(scheme.lower() + b" " + key.strip(), self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = None
        if self.key is not None and scope["path"] != "/health" and not self._authorized(scope):
            refusal = _error(401, "a missing or incorrect API key: send the header "
                                  "'Authorization: Bearer KEY' with this server's key",
                             code="invalid_api_key", headers={"connection": "close"})
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if refusal is None and declared.isdigit() and int(declared) > self.max_body_bytes:
            refusal = self._too_big()
        chunks, size = [], 0
        while refusal is None:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # gone before its body arrived: nobody to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                refusal = self._too_big()
            elif not message.get("more_body", False):
                break
        if refusal is not None:
            return await refusal(scope, receive, send)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _too_big(self) -> JSONResponse:
        # Connection: close (as for a 401), so the rest of the body is never read
        return _error(413, f"the request body is over this server's limit of "
                           f"{self.max_body_bytes} bytes", headers={"connection": "close"})


def make_app(runner: Runner, tokenizer, model_name: str, on_ready=None, *,
             api_key: str | None = None, max_body_bytes: int | None = None) -> FastAPI:
    """The app; `on_ready()` runs once it accepts requests. With `api_key`, every route but
    /health needs 'Authorization: Bearer API_KEY' (401 otherwise); a body past
    `max_body_bytes` (default DEFAULT_MAX_BODY_BYTES) gets 413."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        if on_ready is not None:
            on_ready()
        yield

    app = FastAPI(title="dsattn", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.add_middleware(_Guard, api_key=api_key,
                       max_body_bytes=max_body_bytes or DEFAULT_MAX_BODY_BYTES)
    created = int(time.time())
    served = ", ".join(ENDPOINTS)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        message, field = _one_message(exc)
        return _error(400, message, param=field)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        what = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            return _error(404, f"no endpoint {what}: this server serves {served}")
        if exc.status_code == 405:
            return _error(405, f"{what} is not allowed: this server serves {served}")
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def bug(_request, _exc):
        return _error(500, "the server failed on this request: see its log",
                      kind="server_error")

    def down() -> _Refused:
        return _Refused(503, runner.error or "the scheduler is not running",
                        kind="server_error")

    @app.get("/health")
    async def health():
        if not runner.alive:
            return JSONResponse(status_code=503, content={
                "status": "down", "error": runner.error or "the scheduler is not running"})
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return runner.metrics()

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "dsattn"}

    def unknown_model(name) -> _Refused:
        return _Refused(404, f"the model {name!r} does not exist: this server serves "
                             f"{model_name!r}", param="model", code="model_not_found")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != model_name:
            return unknown_model(name).response()
        return model_card()

    def accept(raw: bytes, on_event):
        """(body, stop strings, tickets, prompt tokens, seed) of a request, submitted: one
        request per choice (n), choice i seeded seed + i, each reporting through
        on_event(i, event); on a worker thread: parsing, checking and tokenizing cost time
        in proportion to the body."""
        try:
            body = CompletionBody.model_validate(_json_object(raw))
        except ValidationError as e:
            message, field = _one_message(e)
            raise _Refused(400, message, param=field)
        if body.model is not None and body.model != model_name:
            raise unknown_model(body.model)
        for field, value in NO_OPS.items():
            if getattr(body, field) not in (None, value):
                raise _Refused(400, f"{field}: this server supports only {json.dumps(value)} "
                                    f"(or null), got {_shown(getattr(body, field))}",
                               param=field)
        if body.logprobs is not None:
            raise _Refused(400, "logprobs: this server returns no log probabilities (only "
                                "null)", param="logprobs")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > MAX_STOPS:
            raise _Refused(400, f"stop: at most {MAX_STOPS} sequences, got {len(stop)}",
                           param="stop")
        for field, text in [("prompt", body.prompt)] + [("stop", s) for s in stop]:
            _unicode(field, text)
        if not body.prompt:
            raise _Refused(400, "prompt: empty; the model needs text to continue",
                           param="prompt")
        prompt = tokenizer.encode(body.prompt)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        need, limit = len(prompt) + max_tokens, runner.scheduler.max_len
        if need > limit:  # before the request is built: a long prompt is refused cheaply
            raise _Refused(400, f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) "
                                f"= {need} exceeds this model's {limit} tokens per request",
                           param="max_tokens", code="context_length_exceeded")
        n, rows = body.n or 1, runner.scheduler.rows
        if n > rows:  # the choices run side by side, a row each
            raise _Refused(400, f"n: at most {rows} (this server's rows), got {n}", param="n")
        seed = secrets.randbelow(2 ** 31) if body.seed is None else body.seed
        reqs = [Request(prompt, max_tokens, 1.0 if body.temperature is None else body.temperature,
                        1.0 if body.top_p is None else body.top_p, (seed + i) % 2 ** 31,
                        eos_id=tokenizer.eos_id) for i in range(n)]
        try:
            tickets = runner.submit_all(reqs, on_event)  # all choices or none
        except InputError as e:
            raise _Refused(400, str(e))
        except Busy as e:
            raise _Refused(429, f"the server is full: {e}; retry later", kind="requests",
                           code="rate_limit_exceeded", headers={"retry-after": "1"})
        except Down:
            raise down()
        return body, stop, tickets, len(prompt), seed

    async def cancel_on_disconnect(http: HTTPRequest, tickets: list) -> None:
        """Cancel the request once its client disconnects (its rows are freed for others)."""
        while (await http.receive())["type"] != "http.disconnect":
            pass
        for t in tickets:
            runner.cancel(t)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        if not runner.alive:  # fail fast: nothing would ever answer it
            return down().response()
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def on_event(i, ev):  # from the runner's thread: choice i's event
            with contextlib.suppress(RuntimeError):  # a closed loop: the server has stopped
                loop.call_soon_threadsafe(events.put_nowait, (i, ev))

        try:
            body, stop, tickets, n_prompt, seed = await run_in_threadpool(
                accept, await http.body(), on_event)
        except _Refused as e:
            return e.response()
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        texts = [_Text(tokenizer, stop) for _ in tickets]
        cached = [0] * len(tickets)  # prompt tokens each choice reused from the prefix cache
        open_choices = set(range(len(tickets)))

        def cancel_all():
            for t in tickets:
                runner.cancel(t)

        async def next_piece():
            """(choice, text to send, finish reason or None) once something arrives."""
            i, ev = await events.get()
            if ev is None:
                raise down()
            if ev.cached_tokens is not None:  # on a request's first event only
                cached[i] = ev.cached_tokens
            text = texts[i]
            text.push(ev.token)
            if ev.finish is None and text.stopped:
                runner.cancel(tickets[i])  # its CANCELLED event ends the choice below
            final = ev.finish is not None
            reason = None
            if final:
                text.push(None)
                open_choices.discard(i)
                reason = ("length" if ev.finish is Finish.LENGTH and not text.stopped
                          else "stop")
            return i, text.fresh(final), reason

        def chunk(pieces: list):
            return {"id": cid, "object": "text_completion", "created": created,
                    "model": model_name, "seed": seed,
                    "choices": [{"text": piece, "index": i, "logprobs": None,
                                 "finish_reason": reason} for i, piece, reason in pieces]}

        if body.stream:
            async def sse():
                try:
                    while open_choices:
                        try:
                            i, piece, reason = await next_piece()
                        except _Refused as e:  # the scheduler died mid-stream
                            yield f"data: {json.dumps(e.content())}\n\n"
                            return
                        if piece or reason:
                            yield f"data: {json.dumps(chunk([(i, piece, reason)]))}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    cancel_all()  # a client gone mid-stream frees its rows

            return StreamingResponse(sse(), media_type="text/event-stream")
        watch = asyncio.ensure_future(cancel_on_disconnect(http, tickets))
        out, reasons = [[] for _ in tickets], [None] * len(tickets)
        try:
            while open_choices:
                i, piece, reasons[i] = await next_piece()
                out[i].append(piece)
        except _Refused as e:
            cancel_all()
            return e.response()
        finally:
            watch.cancel()
        body_out = chunk([(i, "".join(pieces), reasons[i]) for i, pieces in enumerate(out)])
        completion = sum(t.tokens for t in texts)
        # The prompt is counted once (prompt_tokens, as OpenAI does for n choices), and so
        # are its cached tokens: choice 0's, what the prompt found cached on arrival. The
        # other choices mostly reuse the prefix choice 0 computes; summing theirs could
        # report more cached tokens than the prompt has.
        body_out["usage"] = {"prompt_tokens": n_prompt, "completion_tokens": completion,
                             "total_tokens": n_prompt + completion,
                             "prompt_tokens_details": {"cached_tokens": cached[0]}}
        return body_out

    return app
