"""Attention backends behind one interface, chosen by name from a registry.

A backend's ``forward(q, layer, forward_batch, sinks=None)`` returns, for every
query token of the batch, attention over its request's context read from the KV
pool through ``req_to_token`` (causal within the extend, optionally limited
to a sliding window, optionally soft-capped, optionally with attention sinks:
a logit per head in each query's softmax denominator, with no value).
``init_forward_metadata`` is called once per forward before the layers run.
"""

from __future__ import annotations

import importlib

# name -> module defining the backend class ``Backend``
ATTENTION_BACKENDS = {
    "torch": "actors.engine.attention.torch_backend",
    "triton": "actors.engine.attention.triton_backend",
}


def create_attention_backend(name: str, **kwargs):
    try:
        module = ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention_backend {name!r}; known: {', '.join(sorted(ATTENTION_BACKENDS))}") from None
    return importlib.import_module(module).Backend(**kwargs)
