"""Running the app under uvicorn: in the foreground (serve mode) or on a background
thread (the ``--prompt`` demo, tests, benchmarks).

    with BackgroundServer(app, "127.0.0.1", 0) as server:   # port 0: any free port
        openai.OpenAI(base_url=server.url + "/v1", api_key=...)
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Optional

import uvicorn


GRACEFUL_SHUTDOWN_S = 120.0  # open requests finish for as long as the app's drain waits (build_app's drain_timeout_s)


def uvicorn_config(app, host: str, port: int, log_level: str = "warning") -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                          timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, access_log=False)


def serve_forever(app, host: str, port: int, log_level: str = "info") -> None:
    """Serve until SIGINT / SIGTERM; uvicorn then stops accepting and the app's lifespan drains,
    and this returns (so the caller can drain and stop the workers)."""
    # uvicorn re-raises the signal it caught to the handler it found; with the defaults that
    # would kill the process (SIGTERM) or raise KeyboardInterrupt before the workers are freed.
    # Ours also stops the server: a signal that comes before uvicorn installs its own handlers
    # (while the event loop starts) must not be swallowed.
    server = uvicorn.Server(uvicorn_config(app, host, port, log_level))

    def stop(signum, frame) -> None:
        server.should_exit = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class BackgroundServer:
    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.server = uvicorn.Server(uvicorn_config(app, host, port, log_level))
        self.host = host
        self.port: Optional[int] = None
        self._thread = threading.Thread(target=self.server.run, name="raydix-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start (port taken?)")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout_s: float = 120.0) -> None:
        """Stop accepting, let open requests finish, run the app's shutdown (drain)."""
        self.server.should_exit = True
        self._thread.join(timeout_s)

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
