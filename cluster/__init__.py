"""Bringing a raydix cluster up from a config, and serving it.

The typed config (``config``), Ray placement and wiring (``pd``), the
driver-side client that runs a request through a (prefill, decode) pair
(``pd_client``; one attempt on a pair in ``pd_attempt``, the workers' rotation
in ``pd_rotation``), bring-up and drain, also the ``ray job submit`` entrypoint
(``launch``), the OpenAI-compatible and SGLang-native FastAPI app (``server``)
and the ``raydix`` command-line interface (``cli``).

The app's endpoints: completions and chat (``openai_serving``; their bodies in
``completion_protocol`` and ``chat_protocol``, what they share in
``openai_protocol``), with tool calls (``tool_calls``, their parsers in
``tool_parsers``, ``model_tool_parsers`` and ``pythonic_tool_parsers``, their arguments
streamed by ``json_stream`` and ``python_stream``) and reasoning parsers (``reasoning``; GPT-OSS's Harmony for both in
``harmony``); the Responses API
(``openai_responses``, ``responses_format``, ``responses_store``); ``/tokenize``
and ``/detokenize`` (``openai_tokenization``); ``/v1/embeddings``
(``openai_embeddings``); ``/score`` and ``/rerank`` (``openai_score``).
"""
