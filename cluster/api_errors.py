"""OpenAI-style error bodies and the status each failure maps to.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

=====================================  ======  =========================
failure                                status  type
=====================================  ======  =========================
malformed JSON, bad field, too long    400     invalid_request_error
missing / wrong API key                401     authentication_error
unknown model, worker, route           404     not_found_error
no admission slot within the timeout   408     timeout_error
busy, a worker not added (asleep)      409     invalid_request_error
request body too large                 413     invalid_request_error
queue full                             429     rate_limit_error
a worker failed (PDRequestError)       500     server_error
draining, no live worker, sleeping     503     service_unavailable
=====================================  ======  =========================
"""

from __future__ import annotations

import re
from typing import Any, Dict, Optional

from fastapi.responses import JSONResponse

from actors.engine.memory_occupation import SleepingError
from actors.pd_scheduler import PDRequestError
from cluster.admission import QueueFullError, QueueTimeoutError


def own_message(exc: BaseException) -> str:
    """What ``exc`` says: a Ray task's error (raised as its cause's class) its cause's message,
    not the task's traceback."""
    return str(getattr(exc, "cause", exc))


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    @classmethod
    def from_exception(cls, exc: BaseException) -> "APIError":
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, QueueFullError):
            return cls(429, str(exc), "rate_limit_error", code="queue_full")
        if isinstance(exc, QueueTimeoutError):
            return cls(408, str(exc), "timeout_error", code="queue_timeout")
        if isinstance(exc, SleepingError):  # (vLLM's answer while asleep)
            return cls(503, str(exc), "service_unavailable", code="sleeping")
        if isinstance(exc, PDRequestError):
            message = str(exc)
            if "draining" in message or message.startswith("no live"):
                return cls(503, message, "service_unavailable", code="unavailable")
            return cls(500, f"a worker failed: {message}", "server_error", code="worker_failure")
        if isinstance(exc, ValueError):  # the workers refused the request (prompt too long, bad parameter)
            message = own_message(exc)
            field = re.match(r"([A-Za-z_][\w.]*): ", message)  # (a bad parameter's message names it first)
            return cls(400, message, param=field.group(1) if field else None)
        return cls(500, f"internal error: {type(exc).__name__}: {exc}", "server_error", code="internal_error")
