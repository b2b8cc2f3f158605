"""The operator endpoints RL frameworks and ops scripts call on SGLang and vLLM servers.

==========================  =======================================================
POST /abort_request         SGLang's {"rid", "abort_all"}: end the requests named ``rid`` (an
                            ``X-Request-Id`` or a /generate rid), or all; each ends with
                            finish_reason "abort" (streamed: a last chunk; a pooling request, a
                            503), its workers freed; one waiting for a slot or a pause, at once
POST /pause_generation      SGLang's {"mode"}: new requests wait from now on; "abort" (the default):
                            those in flight end aborted; "retract": the workers' running requests go
                            back to waiting, their KV freed; "in_place": they stop, KV kept. All
                            workers or none: one failing, the others step again (a 500 naming it;
                            paused already, the server and its workers stay paused)
POST /continue_generation   the workers step again, the waiting requests run
GET  /get_model_info        SGLang's: model_path, tokenizer_path, is_generation, weight_version, ...
GET  /get_server_info       SGLang's: the configuration as served; SGLang's scheduler info (the
                            least over the decode workers: see ``cluster_limits``); and each
                            worker's state as ``internal_states``: role, id, load (its heartbeat's
                            stats), the sizes its engine chose (request rows, KV slots, SWA
                            and Mamba slots, page size, context, prefill chunk, speculation) and,
                            speculating, its ``avg_spec_accept_length`` (tokens per verify step);
                            ``paused``, ``is_sleeping`` (sleep mode: cluster.sleep_routes);
                            ``autoscaler``: per autoscaled side its bounds, current and desired
                            counts, the last decision's reason and the last change (None: off)
GET  /health_generate       SGLang's: one token generated on a worker pair within
                            ``server.health_generate_timeout_s``: 200, else 503 (paused: at once)
POST /reset_prefix_cache    vLLM's name of /flush_cache
GET, POST /ping             vLLM's (SageMaker's) health: /health
GET  /load                  vLLM's {"server_load"}: the requests running or queued for a slot here,
                            or held by a pause
==========================  =======================================================
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from typing import Any, Dict, List, Literal, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from cluster.api_errors import APIError
from cluster.backend import refresh_loads_briefly
from cluster.openai_protocol import FORBID

PAUSE_MODES = ("abort", "retract", "in_place")


class AbortRequest(BaseModel):
    """SGLang's AbortReq: ``rid`` "" or null names no request (nothing happens, as SGLang's)."""

    model_config = FORBID

    rid: Optional[str] = ""
    abort_all: bool = False


class PauseGenerationRequest(BaseModel):
    """SGLang's PauseGenerationReqInput."""

    model_config = FORBID

    mode: Literal[PAUSE_MODES] = "abort"


def _model_config(model_path: Optional[str]) -> Dict[str, Any]:
    """The checkpoint's config.json ({} when there is none to read)."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            return json.load(f)
    except (TypeError, OSError, ValueError):
        return {}


def cluster_limits(workers: List[Dict[str, Any]], max_prompt_len: int) -> Dict[str, Any]:
    """SGLang's scheduler info at the top of /get_server_info, for clients written for one SGLang
    server (sglang.bench_serving reads ``max_total_num_tokens``): the least over the live decode
    workers that reported their sizes, as a request's row and its KV, prompt and output, are held
    by one decode worker (None: none reported yet); ``max_req_input_len``: the longest prompt the
    cluster takes (the prefill workers' pools bound it too)."""
    decode = [w for w in workers if w["role"] == "decode" and w["alive"] and "max_total_num_tokens" in w]
    limits = {key: min((w[key] for w in decode), default=None)
              for key in ("max_running_requests", "max_total_num_tokens", "page_size")}
    return {**limits, "max_req_input_len": max_prompt_len}


def add_admin_routes(app: FastAPI, service, server, parse_body, health, flush_cache, served_config: Dict[str, Any],
                     installed_version: str, autoscaler=None) -> None:
    """The routes above, over ``service`` (a GenerationService: its backend, requests and pause);
    ``server``: the ServerConfig; ``health`` and ``flush_cache``: the app's /health and /flush_cache
    handlers (their aliases); ``served_config``: the configuration /get_server_info shows;
    ``autoscaler``: the cluster's (None: none runs)."""
    backend, requests = service.backend, service.requests

    @app.post("/abort_request")
    async def abort_request(request: Request):
        req = await parse_body(request, AbortRequest)
        if req.abort_all:
            requests.abort_all()
        elif req.rid:
            requests.abort(req.rid)
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        req = await parse_body(request, PauseGenerationRequest)
        was_paused = not service.resumed.is_set()
        service.resumed.clear()
        if req.mode == "abort":  # (SGLang's: the workers are not paused; nothing reaches them meanwhile)
            await requests.wait_ended(requests.abort_all())
            return {"message": "Generation paused successfully.", "status": "ok"}
        try:
            await backend.pause_generation(req.mode)
        except RuntimeError as exc:  # the workers as before the call: the server too
            if not was_paused:
                service.resumed.set()
            raise APIError(500, str(exc), "server_error", code="pause_failed") from None
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation():
        await service.continue_generation()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.get("/get_model_info")
    async def get_model_info():
        checkpoint = _model_config(backend.model_path)
        tokenizer = service.tokenizer
        return {"model_path": backend.model_path,
                "tokenizer_path": getattr(tokenizer, "name_or_path", None) if tokenizer is not None else None,
                "is_generation": True, "preferred_sampling_params": None, "weight_version": backend.weight_version,
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": checkpoint.get("model_type"), "architectures": checkpoint.get("architectures")}

    @app.get("/get_server_info")
    async def get_server_info():
        await refresh_loads_briefly(backend)
        workers = backend.workers()
        return {**served_config, **cluster_limits(workers, backend.max_prompt_len), "model_name": backend.model_name,
                "model_path": backend.model_path, "context_len": backend.context_len,
                "max_prompt_len": backend.max_prompt_len, "weight_version": backend.weight_version,
                "paused": not service.resumed.is_set(), "is_sleeping": backend.is_sleeping,
                "lora_modules": dict(backend.lora_modules),
                "internal_states": workers, "version": installed_version,
                "autoscaler": autoscaler.state() if autoscaler is not None else None}

    @app.get("/health_generate")
    async def health_generate():
        """A one-token generation past admission (its answer is the workers', not the queue's); on a
        timeout its stream is closed, which frees it on its workers. While paused (/pause_generation,
        any mode), a 503 at once with nothing sent: SGLang's check waits behind its pause like any
        request and fails at its timeout (its /ready is a 503 while paused too), and a paused worker
        would hold it as long."""
        if not service.resumed.is_set():
            return Response(status_code=503)

        async def one_token():
            params = {"max_new_tokens": 1, "temperature": 0.0}
            async for result in backend.generate_stream([0], params, f"HEALTH_CHECK_{uuid.uuid4().hex}"):
                if result["meta_info"]["finish_reason"] is not None:
                    return

        try:
            await asyncio.wait_for(one_token(), timeout=server.health_generate_timeout_s)
        except Exception:  # timed out, or the workers failed it
            return Response(status_code=503)
        return Response(status_code=200)

    app.post("/reset_prefix_cache")(flush_cache)
    app.get("/ping")(health)
    app.post("/ping")(health)

    @app.get("/load")
    async def server_load():
        admission = service.admission
        return JSONResponse({"server_load": admission.running + admission.waiting + service.num_paused})
