"""Sleep mode over HTTP (``server.enable_sleep_mode``): an RL trainer colocated with the cluster takes
the workers' memory while it trains and gives it back to generate (see ``actors.engine.memory_occupation``
for what each part is, ``cluster.backend.PDBackend`` for the cluster releasing together).

==================================  =======================================================
POST /sleep?level=1|2               vLLM's: every part released, level 1 keeping a CPU copy of the
                                    weights, level 2 discarding them (update them after /wake_up)
POST /wake_up[?tags=...]            vLLM's: the parts named (``tags`` repeated; none: all) resumed
GET  /is_sleeping                   vLLM's ``{"is_sleeping": bool}``
POST /release_memory_occupation     SGLang's ``{"tags": [...]}`` (optional; none: all): released, the
                                    weights discarded (SGLang keeps no copy)
POST /resume_memory_occupation      SGLang's ``{"tags": [...]}``: resumed
==================================  =======================================================

Each answers 200 with no body, as vLLM's and SGLang's do. An unknown tag or level is a 400; a release
while a worker holds a request a 409 (nothing released: it needs an idle cluster); a worker failing
it otherwise a 500 naming it (those that released resumed). While asleep, requests are refused at
once with a 503 (vLLM's), not held as a pause holds them: nothing could run them until a wake-up,
which may come after a weight update, and a trainer stops sending before it sleeps the server.
"""

from __future__ import annotations

from typing import List, Optional

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel

from actors.engine.memory_occupation import NotIdleError, parse_tags
from cluster.api_errors import APIError
from cluster.openai_protocol import FORBID


class MemoryOccupationRequest(BaseModel):
    """SGLang's Release/ResumeMemoryOccupationReqInput."""

    model_config = FORBID

    tags: Optional[List[str]] = None


def checked_tags(tags: Optional[List[str]]) -> Optional[List[str]]:
    """``tags`` as sent; a 400 naming an unknown one."""
    try:
        parse_tags(tags)
    except ValueError as exc:
        raise APIError(400, str(exc), param="tags") from None
    return tags


def add_sleep_routes(app: FastAPI, backend, parse_body) -> None:
    """The routes above over ``backend`` (a ServingBackend); ``parse_body``: the app's JSON body parser."""

    async def release(tags: Optional[List[str]], keep_weights: bool) -> Response:
        try:
            await backend.release_memory_occupation(tags, keep_weights)
        except NotIdleError as exc:
            raise APIError(409, str(exc), code="busy") from None
        except RuntimeError as exc:
            raise APIError(500, str(exc), "server_error", code="release_failed") from None
        return Response(status_code=200)

    async def resume(tags: Optional[List[str]]) -> Response:
        try:
            await backend.resume_memory_occupation(tags)
        except RuntimeError as exc:
            raise APIError(500, str(exc), "server_error", code="resume_failed") from None
        return Response(status_code=200)

    async def body_tags(request: Request) -> Optional[List[str]]:
        """The optional body's ``tags`` (SGLang's clients may send none)."""
        if not (await request.body()).strip():
            return None
        return checked_tags((await parse_body(request, MemoryOccupationRequest)).tags)

    @app.post("/sleep")
    async def sleep(level: str = "1"):
        if level not in ("1", "2"):
            raise APIError(400, f"level: {level!r} is not a sleep level (1 or 2)", param="level")
        return await release(None, keep_weights=level == "1")

    @app.post("/wake_up")
    async def wake_up(request: Request):
        return await resume(checked_tags(request.query_params.getlist("tags") or None))

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": backend.is_sleeping}

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request):
        return await release(await body_tags(request), keep_weights=False)

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request):
        return await resume(await body_tags(request))
