"""The HTTP server: an OpenAI-compatible and SGLang-native FastAPI app over the PD cluster.

    app = build_app(cluster, tokenizer, config)    # a PDCluster, a PDClient or a ServingBackend
    uvicorn.run(app, host=config.server.host, port=config.server.port)

==========================  =======================================================
POST /v1/completions        OpenAI completions (stream, n, stop, logprobs, seed, ...)
POST /v1/chat/completions   OpenAI chat completions (the tokenizer's chat template)
POST /v1/responses          OpenAI Responses, over the chat path (see cluster.openai_responses)
POST /v1/embeddings         OpenAI embeddings: last-token pooling (see cluster.openai_embeddings)
POST /score, /v1/score      vLLM's: text_1 against text_2 (1→N, N→N), by embeddings' cosine or, with
                            ``server.classifier_from_token``, a reranker's two tokens (see cluster.openai_score)
POST /rerank, /v1/rerank,   Jina's and Cohere's rerank (vLLM's): a query against documents, best
     /v2/rerank             first (top_n, return_documents); scored as /score
GET  /v1/responses/{id}     a stored response (DELETE: drop it; GET .../input_items: its
                            input items, OpenAI's list pages); 404 unknown or evicted
GET  /v1/models             the served model and its LoRA adapters
GET  /v1/models/{id}        one of their cards (404 for any other id)
POST /generate              SGLang native: text or input_ids, sampling_params, stream, lora_path
POST /tokenize              vLLM's: a prompt's or messages' token ids (as the endpoints above encode them)
POST /detokenize            vLLM's: token ids' text
GET  /health                200 when every worker in the rotation answers, else 503
GET  /version               {"version": raydix's} (vLLM's)
GET  /metrics               Prometheus text format (see cluster.metrics)
GET  /workers               id, role, node, alive, load of each worker in the rotation
                            (``?include_dead=true``: also those that died, to DELETE them), and
                            each autoscaled side's state (see cluster.autoscaler)
POST /workers               {"role": "prefill" | "decode"}: start one more worker
DELETE /workers/{id}        drain a worker, free its pools, stop it
POST /flush_cache           drop every worker's prefix cache (idle cluster only)
POST /v1/load_lora_adapter  vLLM's {"lora_name", "lora_path"}: every worker serves the adapter
                            (with ``server.allow_runtime_lora_updating``); POST
                            /v1/unload_lora_adapter {"lora_name"}: every worker drops it once
                            its requests in flight have finished
POST /abort_request, ...    SGLang's and vLLM's operator endpoints: aborts, pause and continue, model
                            and server info, a generating health check (see cluster.admin_routes)
GET  /get_weight_version    {"weight_version": ...} (SGLang's; "default" before any update);
                            POST /update_weights_from_disk (SGLang's {"model_path",
                            "weight_version", "abort_all_requests", "flush_cache"}, with
                            ``server.allow_weight_updates``): every worker serves the checkpoint;
                            one that does not fit is a 400 (see actors.engine.weight_updates);
                            POST /update_weights_from_tensor (SGLang's, its
                            ``serialized_named_tensors`` the base64 of a safetensors blob):
                            every worker copies the tensors in
POST /sleep, /wake_up, ...  vLLM's and SGLang's sleep mode (with ``server.enable_sleep_mode``):
                            every worker's memory released and resumed (see cluster.sleep_routes)
==========================  =======================================================

Errors are OpenAI-style bodies (see ``cluster.api_errors``). With
``server.api_key`` set, every route but the health checks (/health, /ping,
/health_generate), /version, /metrics and /load needs ``Authorization: Bearer
<key>``. Every response carries ``X-Request-Id``: the client's own, echoed, or
a new one (vLLM's request-id headers; the openai client reads it as
``_request_id``); it is the base of the response ``id`` and of the request ids
the router and workers see (see ``cluster.openai_serving``). A client's id that
could not name a request (see :func:`~cluster.http_guard.request_id_of`) is
replaced by a new one, as if none was sent. Bodies over
``server.max_request_body_bytes`` get 413 before they are read to the end.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable, Literal, Optional, Type, Union

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.admin_routes import add_admin_routes
from cluster.admission import Admission
from cluster.api_errors import APIError
from cluster.autoscaler import Autoscaler
from cluster.backend import ServingBackend, UnknownWorkerError, WorkerNotAddedError, as_backend, refresh_loads_briefly
from cluster.http_guard import RequestGuard
from cluster.chat_protocol import ChatCompletionRequest
from cluster.completion_protocol import CompletionRequest, GenerateRequest
from cluster.media_fetch import ServerMediaFetcher
from cluster.metrics import ServerMetrics
from cluster.openai_embeddings import EmbeddingRequest, create_embeddings
from cluster.openai_protocol import (AddWorkerRequest, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest,
                                     UpdateWeightsFromDiskRequest, UpdateWeightsFromTensorRequest,
                                     describe_validation_error)
from cluster.openai_responses import ResponsesRequest, ResponsesService
from cluster.openai_score import RerankRequest, Scorer, ScoreRequest, create_rerank, create_score
from cluster.openai_serving import GenerationService
from cluster.sleep_routes import add_sleep_routes
from cluster.openai_tokenization import DetokenizeRequest, detokenize, tokenize, tokenize_request_model


def _version() -> str:
    """raydix's installed version; "unknown" when it runs from a source tree never installed (a
    ``ray job submit`` working directory)."""
    try:
        return version("raydix")
    except PackageNotFoundError:
        return "unknown"


async def parse_body(request: Request, model: Union[Type[BaseModel], Callable[[dict], Type[BaseModel]]]) -> BaseModel:
    """The JSON body as ``model`` (or as the model ``model(body)`` picks); 400 naming the bad field
    (or saying the JSON is malformed)."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"malformed JSON body: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, not {type(data).__name__}", code="invalid_json")
    if not isinstance(model, type):
        model = model(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = describe_validation_error(exc)
        raise APIError(400, message, param=param) from None


CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client gone before its answer: what the request counter shows


async def _until_disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: nothing else can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, handler) -> Any:
    """Await ``handler`` (a coroutine) unless the client disconnects first: then cancel it, so a
    request whose client gave up (a timeout, a retry) is aborted on its workers and gives back its
    admission slot instead of generating to the end (vLLM's ``with_cancellation``). Watches until
    the handler answers; a streamed answer then watches for itself."""
    task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this endpoint is cancelled itself (server shutdown)
        watcher.cancel()
        if not task.done():
            task.cancel()
            # its cleanup: abort, slot back (``wait``, not ``gather``: a second cancel of this
            # endpoint — anyio repeats one at every await — must not cancel the cleanup too)
            await asyncio.wait((task,))
    if task.cancelled():
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return task.result()


def _server_config(config):
    """A ClusterConfig's ``server`` section, a ServerConfig, or the defaults."""
    from cluster.config import ServerConfig

    if config is None:
        return ServerConfig()
    return getattr(config, "server", config)


def build_app(cluster_or_client: Any, tokenizer=None, config=None, client=None,
              drain_timeout_s: float = 120.0) -> FastAPI:
    """The FastAPI app over a ``PDCluster`` / ``PDClient`` / ``ServingBackend``; ``config``: the
    ClusterConfig (or its ServerConfig); ``client``: the PDClient to run a cluster's requests through
    (default: a new one, with a router actor when the cluster can start one). Heartbeats run while
    the app is up; shutdown drains."""
    server = _server_config(config)
    backend: ServingBackend = as_backend(cluster_or_client, tokenizer, client)
    metrics = ServerMetrics(backend.model_name)
    admission = Admission(server.max_concurrent_requests, server.max_queue_size, server.queue_timeout_s)
    service = GenerationService(backend, tokenizer, metrics, admission, server.reasoning_parser,
                                server.tool_call_parser, ServerMediaFetcher.from_config(
                                    server, video_num_frames=server.video_num_frames, video_fps=server.video_fps))
    responses = ResponsesService(service, server.responses_store_size)
    scorer = Scorer.from_config(service, server)

    autoscaler = Autoscaler.from_config(backend, config, metrics, service)

    @asynccontextmanager
    async def lifespan(app):
        backend.start()
        if autoscaler is not None:
            autoscaler.start()
        try:
            yield
        finally:
            if autoscaler is not None:  # (no worker started or stopped under the drain)
                await autoscaler.stop()
            await backend.drain(drain_timeout_s)
            backend.stop()
            await service.media_fetcher.aclose()

    app = FastAPI(title="raydix", lifespan=lifespan)
    app.state.backend, app.state.metrics, app.state.admission = backend, metrics, admission
    app.state.autoscaler = autoscaler
    api_key = server.api_key.get_secret_value() if server.api_key is not None else None
    installed_version = _version()  # (package metadata: read once, not at every GET /version)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid_params(request, exc: RequestValidationError):  # a query / path parameter
        message, param = describe_validation_error(exc, skip=1)
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind).response()

    @app.exception_handler(Exception)
    async def _any_error(request, exc):
        return APIError.from_exception(exc).response()

    async def _call(coro):
        try:
            return await coro
        except APIError:
            raise
        except Exception as exc:  # mapped to its status; the server keeps serving
            raise APIError.from_exception(exc) from None

    async def _generation(request: Request, model, handler):
        """A generation endpoint: the body as ``model``, then ``handler`` (cancelled if the client goes)."""
        arrival = time.perf_counter()
        body = await parse_body(request, model)
        return await _call(cancel_on_disconnect(request, handler(body, arrival, request.state.request_id)))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generation(request, CompletionRequest, service.completions)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generation(request, ChatCompletionRequest, service.chat)

    @app.post("/v1/responses")
    async def create_response(request: Request):
        return await _generation(request, ResponsesRequest, responses.create)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        return await _generation(request, EmbeddingRequest, partial(create_embeddings, service))

    @app.post("/score")
    @app.post("/v1/score")
    async def score(request: Request):
        return await _generation(request, ScoreRequest, partial(create_score, scorer))

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(request: Request):
        return await _generation(request, RerankRequest, partial(create_rerank, scorer))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return responses.retrieve(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(request: Request, response_id: str, limit: int = Query(20, ge=1, le=100),
                               order: Literal["asc", "desc"] = "desc", after: Optional[str] = None):
        params = request.query_params  # (include: the openai client sends include[]=...)
        include = params.getlist("include") + params.getlist("include[]")
        return responses.input_items(response_id, limit, order, after, include)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return responses.delete(response_id)

    @app.post("/generate")
    async def generate(request: Request):
        return await _generation(request, GenerateRequest, service.generate)

    @app.post("/tokenize")
    async def tokenize_prompt(request: Request):
        return tokenize(service, await parse_body(request, tokenize_request_model))

    @app.post("/detokenize")
    async def detokenize_tokens(request: Request):
        return detokenize(service, await parse_body(request, DetokenizeRequest))

    created = int(time.time())  # when the model came up (OpenAI's and vLLM's cards carry a Unix time, not 0)

    def model_card(name: str):
        """vLLM's card: a LoRA adapter's names its directory (``root``) and the base model (``parent``)."""
        card = {"id": name, "object": "model", "created": created, "owned_by": "raydix",
                "max_model_len": backend.context_len}
        if name in backend.lora_modules:
            card.update(root=backend.lora_modules[name], parent=backend.model_name)
        return card

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name) for name in [backend.model_name, *backend.lora_modules]]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        return model_card(service.check_model(model))

    @app.get("/health")
    async def health():
        status = await backend.health()
        return JSONResponse(status, status_code=200 if status["ready"] else 503)

    @app.get("/version")
    async def raydix_version():
        return {"version": installed_version}

    @app.get("/metrics")
    async def prometheus_metrics():
        await refresh_loads_briefly(backend)
        # (workers out of the rotation too: they scrape as raydix_worker_up 0 until removed)
        metrics.set_workers(backend.workers(include_dead=True), admission.running, admission.waiting)
        metrics.set_retries(getattr(backend, "num_retries", 0))  # (a backend without a PD client has none)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/workers")
    async def list_workers(include_dead: bool = False):
        return {"workers": backend.workers(include_dead),
                "policies": {role: backend.routing_policy(role) for role in ("prefill", "decode")},
                "autoscaler": autoscaler.state() if autoscaler is not None else None}

    @app.post("/workers")
    async def add_worker(request: Request):
        req = await parse_body(request, AddWorkerRequest)
        try:
            worker = await backend.add_worker(req.role)
        except WorkerNotAddedError as exc:
            raise APIError(409, str(exc), code=exc.code) from None
        except NotImplementedError as exc:
            raise APIError(501, str(exc), "server_error", code="not_supported") from None
        if autoscaler is not None:
            autoscaler.worker_added(req.role)
        return worker

    @app.delete("/workers/{worker_id}")
    async def remove_worker(worker_id: str):
        try:
            return await backend.remove_worker(worker_id)
        except UnknownWorkerError:
            raise APIError(404, f"no worker {worker_id!r} in the rotation", "not_found_error", "worker_id",
                           "worker_not_found") from None
        except NotImplementedError as exc:
            raise APIError(501, str(exc), "server_error", code="not_supported") from None

    @app.post("/flush_cache")
    async def flush_cache():
        try:
            await backend.flush_cache()
        except RuntimeError as exc:
            raise APIError(409, str(exc), code="busy") from None
        return {"flushed": True}

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": backend.weight_version}

    served_config = config.model_dump(mode="json") if isinstance(config, BaseModel) else {}  # (api_key: masked)
    add_admin_routes(app, service, server, parse_body, health, flush_cache, served_config, installed_version,
                     autoscaler)
    if server.allow_runtime_lora_updating:
        add_lora_routes(app, backend)
    if server.allow_weight_updates:
        add_weights_route(app, service)
    if server.enable_sleep_mode:
        add_sleep_routes(app, backend, parse_body)
    app.add_middleware(RequestGuard, api_key=api_key, max_body=server.max_request_body_bytes, metrics=metrics)
    return app


def add_lora_routes(app: FastAPI, backend: ServingBackend) -> None:
    """vLLM's runtime LoRA updating: a name served already (the model's too) is a 400 to load, an
    unknown one a 404 to unload; an adapter the workers refuse is a 400 naming why."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        req = await parse_body(request, LoadLoRAAdapterRequest)
        if req.lora_name == backend.model_name or req.lora_name in backend.lora_modules:
            raise APIError(400, f"The LoRA adapter {req.lora_name!r} has already been loaded", param="lora_name")
        try:
            await backend.load_lora_adapter(req.lora_name, req.lora_path)
        except (ValueError, OSError) as exc:
            raise APIError(400, str(exc), param="lora_path") from None
        return {"lora_name": req.lora_name, "loaded": True}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        req = await parse_body(request, UnloadLoRAAdapterRequest)
        if req.lora_name not in backend.lora_modules:
            raise APIError(404, f"The LoRA adapter {req.lora_name!r} cannot be found", "not_found_error",
                           "lora_name", "model_not_found")
        await backend.unload_lora_adapter(req.lora_name)
        return {"lora_name": req.lora_name, "unloaded": True}


def add_weights_route(app: FastAPI, service: GenerationService) -> None:
    """SGLang's /update_weights_from_disk: its answer, ``success`` and ``message`` (with
    ``num_paused_requests``); a failure's body is also an OpenAI-style error: a checkpoint the
    workers refuse (nothing changed) is a 400, a failure after every check passed a 500. With
    ``abort_all_requests`` the server's requests in flight are aborted first, as /abort_request's
    (SGLang's tokenizer manager aborts all): answered finish_reason "abort", not failed by the
    workers' own abort, which ends those of other clients of the cluster. A server paused by
    /pause_generation continues once updated (as /continue_generation), unless ``keep_pause``.

    SGLang's /update_weights_from_tensor likewise, its tensors the base64 of a safetensors blob
    (:class:`UpdateWeightsFromTensorRequest`): one that is not, or tensors the workers refuse, a 400
    naming ``serialized_named_tensors``. A paused server stays paused (a trainer pushes its buckets
    under one pause)."""
    backend, requests = service.backend, service.requests

    def failed(status: int, message: str, code: str, param: str = "model_path") -> JSONResponse:
        error = APIError(status, message, "invalid_request_error" if status == 400 else "server_error",
                         param if status == 400 else None, code)
        return JSONResponse({**error.body(), "success": False, "message": message}, status_code=status)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        req = await parse_body(request, UpdateWeightsFromDiskRequest)
        if req.abort_all_requests:
            await requests.wait_ended(requests.abort_all())
        try:
            result = await backend.update_weights_from_disk(req.model_path, req.weight_version, req.abort_all_requests,
                                                            req.flush_cache, req.torch_empty_cache)
        except ValueError as exc:
            return failed(400, str(exc), "invalid_checkpoint")
        except RuntimeError as exc:
            return failed(500, str(exc), "weights_update_failed")
        if not (req.keep_pause or service.resumed.is_set()):
            await service.continue_generation()
        return result

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        req = await parse_body(request, UpdateWeightsFromTensorRequest)
        try:
            named_tensors = await asyncio.to_thread(req.named_tensors)
        except ValueError as exc:
            return failed(400, str(exc), "invalid_tensors", "serialized_named_tensors")
        if req.abort_all_requests:
            await requests.wait_ended(requests.abort_all())
        try:
            return await backend.update_weights_from_tensor(named_tensors, req.load_format, req.flush_cache,
                                                            req.abort_all_requests, req.weight_version,
                                                            req.torch_empty_cache)
        except ValueError as exc:
            param = "load_format" if "load_format" in str(exc) else "serialized_named_tensors"
            return failed(400, str(exc), "invalid_tensors", param)
        except RuntimeError as exc:
            return failed(500, str(exc), "weights_update_failed")
