"""The engine a prefill or decode worker hosts: one process, no Ray.

``Engine`` (SGLang's offline API) wires a model runner (model definitions,
attention backends, the KV pools of ``mem_cache``), a scheduler with
continuous batching, chunked prefill, retraction, SGLang's schedule policies
and priority scheduling, and sampling. The
command ``python -m actors.engine.tiny`` builds the tiny random-weight
checkpoints tests and the built-in default model use.
"""


def __getattr__(name):
    if name == "Engine":
        from actors.engine.engine import Engine

        return Engine
    raise AttributeError(name)
