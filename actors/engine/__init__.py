"""The engine a prefill or decode worker hosts: one process, no Ray.

``Engine`` (SGLang's offline API) wires a model runner (model definitions,
attention backends, the KV pools of ``mem_cache``), a scheduler with
continuous batching, chunked prefill, retraction, SGLang's schedule policies
and priority scheduling, and sampling. Beside them: structured output
(``grammar``), n-gram speculative decoding (``spec_decode``, the verify step;
``spec_accept``, how each draft position is picked and accepted; ``ngram``,
the draft lookup), multi-LoRA serving (``lora``, its adapters loaded at
runtime by ``lora_updates``), weight updates from disk or tensors (``weight_updates``,
SGLang's ``update_weights_from_disk`` and ``update_weights_from_tensor``), sleep mode (``memory_occupation``, vLLM's
``sleep`` / ``wake_up``, SGLang's ``release`` / ``resume_memory_occupation``) and the embeddings' last-token pooling
(``pooling``). The command ``python -m actors.engine.tiny`` builds the tiny
random-weight checkpoints tests and the built-in default model use.
"""


def __getattr__(name):
    if name == "Engine":
        from actors.engine.engine import Engine

        return Engine
    raise AttributeError(name)
