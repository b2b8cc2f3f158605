"""The HTTP server's ASGI middleware (:class:`RequestGuard`), in front of every route: the
bearer-token check, the body size limit, the request counter, and each request's id (the
client's ``X-Request-Id`` when it can name a request, else a new one; echoed on every
response)."""

from __future__ import annotations

import hmac
import re
import uuid
from typing import Optional

from cluster.api_errors import APIError
from cluster.metrics import ServerMetrics

# health checks (a load balancer's, SageMaker's /ping, SGLang's /health_generate), and what /metrics shows
# anyway: vLLM guards only /v1, SGLang all but /health*, /metrics
OPEN_PATHS = ("/health", "/ping", "/health_generate", "/version", "/metrics", "/load")
# request counter labels; anything else counts as "other"
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/models", "/generate",
          "/tokenize", "/detokenize", "/health", "/version", "/metrics", "/workers", "/flush_cache",
          "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/score", "/v1/score", "/rerank", "/v1/rerank",
          "/v2/rerank", "/update_weights_from_disk", "/update_weights_from_tensor", "/get_weight_version",
          "/abort_request", "/pause_generation", "/continue_generation", "/get_model_info", "/get_server_info",
          "/health_generate", "/reset_prefix_cache", "/ping", "/load")
ID_ROUTES = tuple((re.compile(pattern), label) for pattern, label in (  # (model names may hold '/')
    (r"/workers/.+", "/workers/{id}"), (r"/v1/models/.+", "/v1/models/{id}"),
    (r"/v1/responses/[^/]+/input_items", "/v1/responses/{id}/input_items"), (r"/v1/responses/.+", "/v1/responses/{id}")))
CLIENT_REQUEST_ID = re.compile(rb"[!-~]{1,128}")  # printable ASCII, no whitespace, at most 128 characters


def endpoint_label(path: str) -> str:
    """The request counter's ``endpoint`` label of ``path``: the route, ids as ``{id}``."""
    if path in ROUTES:
        return path
    return next((label for pattern, label in ID_ROUTES if pattern.fullmatch(path)), "other")


def request_id_of(headers) -> bytes:
    """The request's id: the client's ``X-Request-Id`` when it can name a request in response ids,
    worker logs and the router's state (:data:`CLIENT_REQUEST_ID`), else a new one. vLLM takes any
    header as it is; a bad one is ignored here rather than refused, as vLLM refuses none."""
    sent = headers.get(b"x-request-id")
    return sent if sent is not None and CLIENT_REQUEST_ID.fullmatch(sent) else uuid.uuid4().hex.encode()


class RequestGuard:
    """ASGI middleware: bearer-token check, body size limit, the request counter, and the
    request's id (:func:`request_id_of`): ``request.state.request_id`` for the endpoints, and the
    ``X-Request-Id`` header on every response."""

    def __init__(self, app, api_key: Optional[str], max_body: int, metrics: ServerMetrics):
        self.app, self.api_key, self.max_body, self.metrics = app, api_key, max_body, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = endpoint_label(path)
        status = {"code": 500}
        headers = dict(scope["headers"])
        request_id = request_id_of(headers)
        scope.setdefault("state", {})["request_id"] = request_id.decode()

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = dict(message, headers=[*message.get("headers", ()), (b"x-request-id", request_id)])
            await send(message)

        try:
            error = self._refuse(headers, path)
            if error is not None:
                return await error.response()(scope, receive, counted_send)
            await self.app(scope, self._limited(receive), counted_send)
        finally:
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()

    def _refuse(self, headers, path: str) -> Optional[APIError]:
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return APIError(413, f"request body of {int(length)} bytes exceeds the limit of {self.max_body}",
                            code="body_too_large")
        if self.api_key and path not in OPEN_PATHS:
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key.encode()):
                return APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                                "authentication_error", code="invalid_api_key")
        return None

    def _limited(self, receive):
        seen = {"bytes": 0}

        async def limited():
            message = await receive()
            if message["type"] == "http.request":
                seen["bytes"] += len(message.get("body", b""))
                if seen["bytes"] > self.max_body:
                    raise APIError(413, f"request body exceeds the limit of {self.max_body} bytes",
                                   code="body_too_large")
            return message

        return limited
