"""OpenAI's /v1/completions over a Runner (FastAPI; the `serve` extra), plus /health and
/metrics. Prompt text goes through the run's tokenizer; `stop` strings are matched on the
decoded text (the request is cancelled at the first, which is not returned, as OpenAI
does); `stream` sends server-sent events. A bad request gets a 400 with one message in
OpenAI's error shape and never reaches the batch."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import time
import uuid

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from dsattn.errors import InputError
from dsattn.serve.request import Finish, Request
from dsattn.serve.runner import Runner


class CompletionBody(BaseModel):
    """The fields of OpenAI's completions request this server honours; any other field is
    refused (a client relying on it would silently get something else)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str
    max_tokens: int = Field(16, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    stream: bool = False
    seed: int | None = None


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": "invalid_request_error", "param": None, "code": None}})


def _one_message(exc: RequestValidationError) -> str:
    """The first validation problem as a sentence (FastAPI lists them as dicts)."""
    e = exc.errors()[0]
    where = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body"
    if e.get("type") == "extra_forbidden":
        return f"unknown field {where!r}: this server does not support it"
    return f"{where}: {e.get('msg', 'invalid')}"


class _Text:
    """A request's output as text: tokens through the tokenizer's byte streamer and an
    incremental UTF-8 decoder, with `stop` strings cut off. While streaming, the tail that
    could still begin a stop string is held back."""

    def __init__(self, tokenizer, stop: list[str]):
        self.stream, self.stop = tokenizer.streamer(), [s for s in stop if s]
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text, self.sent, self.stopped = "", 0, False

    def push(self, token: int | None) -> None:
        if self.stopped:  # tokens drawn before the cancel took effect
            return
        raw = self.stream.push(token) if token is not None else self.stream.flush()
        self.text += self.utf8.decode(raw, final=token is None)
        hits = [self.text.find(s) for s in self.stop if s in self.text]
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True

    def fresh(self, final: bool) -> str:
        """Text not sent yet (all of it when final)."""
        hold = 0 if final or self.stopped else max((len(s) - 1 for s in self.stop), default=0)
        end = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent: end], end
        return out


def make_app(runner: Runner, tokenizer, model_name: str, on_ready=None) -> FastAPI:
    """The app; `on_ready()` runs once it accepts requests."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        if on_ready is not None:
            on_ready()
        yield

    app = FastAPI(title="dsattn", docs_url=None, redoc_url=None, lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        return _error(400, _one_message(exc))

    @app.get("/health")
    async def health():
        if not runner.alive:
            return JSONResponse(status_code=503, content={"status": "down",
                                                          "error": runner.error})
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return runner.metrics()

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HTTPRequest):
        prompt = tokenizer.encode(body.prompt)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        req = Request(prompt, body.max_tokens, body.temperature, body.top_p,
                      0 if body.seed is None else body.seed, eos_id=tokenizer.eos_id)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        try:
            ticket = runner.submit(req, lambda ev: loop.call_soon_threadsafe(events.put_nowait,
                                                                              ev))
        except InputError as e:
            return _error(400, str(e))
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        text = _Text(tokenizer, stop)

        async def next_piece():
            """(text to send, finish reason or None) once something arrives."""
            ev = await events.get()
            if ev is None:
                raise RuntimeError("the scheduler stopped: see /health")
            text.push(ev.token)
            if ev.finish is None and text.stopped:
                runner.cancel(ticket)  # its CANCELLED event ends the loop below
            final = ev.finish is not None
            if final:
                text.push(None)
            reason = None
            if final:
                reason = ("length" if ev.finish is Finish.LENGTH and not text.stopped
                          else "stop")
            return text.fresh(final), reason, ev

        def chunk(piece: str, reason):
            return {"id": cid, "object": "text_completion", "created": created,
                    "model": model_name, "choices": [{"text": piece, "index": 0,
                                                      "logprobs": None,
                                                      "finish_reason": reason}]}

        if body.stream:
            async def sse():
                try:
                    while True:
                        piece, reason, _ = await next_piece()
                        if piece or reason:
                            yield f"data: {json.dumps(chunk(piece, reason))}\n\n"
                        if reason:
                            break
                    yield "data: [DONE]\n\n"
                finally:
                    runner.cancel(ticket)  # a client gone mid-stream frees its row

            return StreamingResponse(sse(), media_type="text/event-stream")
        out, n = [], 0
        while True:
            piece, reason, ev = await next_piece()
            out.append(piece)
            n += ev.token is not None
            if reason:
                break
        body_out = chunk("".join(out), reason)
        body_out["usage"] = {"prompt_tokens": len(prompt), "completion_tokens": n,
                             "total_tokens": len(prompt) + n}
        return body_out

    return app
