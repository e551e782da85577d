"""FastAPI app: routes, error handlers and middleware only; the work is in serving.py."""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException

import tokenmill
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.metrics.prometheus import PrometheusStatLogger
from tokenmill.server.errors import APIError, invalid
from tokenmill.server.middleware import GateMiddleware, GateOptions
from tokenmill.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                       DetokenizeRequest, ModelCard, ModelList, TokenizeRequest)
from tokenmill.server.serving import OpenAIServing

logger = logging.getLogger(__name__)

_TYPE_TAG = re.compile(r"(str|int|float|bool|list|dict)(\[.*\])?|[A-Z]\w*")


@dataclass
class ServerOptions:
    served_model_name: str | None = None
    api_key: str | None = None
    max_num_waiting: int | None = None
    max_request_bytes: int = 4 * 1024 * 1024


def build_app(engine: AsyncLLM, options: ServerOptions) -> FastAPI:
    model_name = options.served_model_name or engine.engine.model_name
    metrics = PrometheusStatLogger(model_name)
    engine.stat_loggers.append(metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="tokenmill", version=tokenmill.__version__, lifespan=lifespan)
    app.state.draining = False
    app.state.engine = engine
    app.state.serving = OpenAIServing(engine, model_name, options.max_num_waiting)
    app.state.registry = metrics.registry
    app.add_middleware(GateMiddleware, options=GateOptions(
        options.api_key, options.max_request_bytes, lambda: app.state.draining))
    _add_error_handlers(app)
    _add_routes(app, model_name)
    return app


def _respond(result: Any) -> Response:
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump())
    return StreamingResponse(result, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _add_routes(app: FastAPI, model_name: str) -> None:
    serving: OpenAIServing = app.state.serving
    engine: AsyncLLM = app.state.engine

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return _respond(await serving.completions(req, request))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return _respond(await serving.chat(req, request))

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=engine.engine.max_model_len)])

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        serving.check_model(req.model)
        try:
            if req.messages is not None:
                _, ids = engine.engine.processor.chat_prompt([m.model_dump() for m in req.messages])
            elif req.prompt is not None:
                ids = engine.engine.tokenizer.encode(req.prompt, req.add_special_tokens)
            else:
                raise APIError(400, "prompt: give a prompt or messages", param="prompt")
        except ValueError as exc:
            raise invalid(exc) from None
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        serving.check_model(req.model)
        vocab = engine.engine.tokenizer.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: token id {bad[0]} is outside the vocabulary",
                           param="tokens")
        return {"prompt": engine.engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/version")
    async def version() -> dict:
        return {"version": tokenmill.__version__}

    @app.get("/health")
    async def health() -> Response:
        ok = engine.is_healthy() and not app.state.draining
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(app.state.registry), media_type=CONTENT_TYPE_LATEST)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _validation_error(exc.errors()).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error")
        return APIError(500, f"internal error: {type(exc).__name__}").response()


def _validation_error(errors: list[dict]) -> APIError:
    """pydantic's first complaint, with `param` naming the field (e.g. "messages.0.role")."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON: {first.get('ctx', {}).get('error', '')}".strip())
    # Union members show up in the location as type tags ("str", "list[int]"); drop them.
    loc = [str(part) for part in first.get("loc", ())
           if part != "body" and not _TYPE_TAG.fullmatch(str(part))]
    if not loc:
        return APIError(400, "the request body must be a JSON object")
    param = ".".join(loc)
    return APIError(400, f"{param}: {first.get('msg', 'invalid value')}", param=param)
