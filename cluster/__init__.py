"""Bringing a raydix cluster up from a config, and serving it.

The typed config (``config``), Ray placement and wiring (``pd``), the
driver-side client that runs a request through a (prefill, decode) pair
(``pd_client``), bring-up and drain, also the ``ray job submit`` entrypoint
(``launch``), the OpenAI-compatible and SGLang-native FastAPI app (``server``)
and the ``raydix`` command-line interface (``cli``).
"""
