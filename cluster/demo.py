"""``raydix launch --prompt``: the HTTP server on a background thread, prompts sent
through it with the official openai client, then the first prompt again as a
stream to show the prefix cache at work (``usage.prompt_tokens_details``)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional


def _ask(client, model: str, prompt: str, max_tokens: int, raw: bool):
    if raw:
        out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
        return out.choices[0].text, out.choices[0].finish_reason, out.usage
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                         max_tokens=max_tokens, temperature=0)
    return out.choices[0].message.content, out.choices[0].finish_reason, out.usage


def _cached(usage) -> int:
    details = getattr(usage, "prompt_tokens_details", None)
    return (details.cached_tokens or 0) if details is not None else 0


def run_http_demo(cluster, tokenizer, config, prompts: List[str], max_tokens: int, raw: bool = False,
                  port: Optional[int] = None) -> None:
    import logging

    import openai

    from cluster.http_server import BackgroundServer
    from cluster.server import build_app

    for name in ("httpx", "httpx2"):  # one INFO line per request otherwise
        logging.getLogger(name).setLevel(logging.WARNING)

    model = config.model.name
    key = config.server.api_key.get_secret_value() if config.server.api_key is not None else "none"
    app = build_app(cluster, tokenizer, config)
    with BackgroundServer(app, config.server.host, 0 if port is None else port) as server:
        print(f"OpenAI-compatible server up at {server.url}/v1 (model {model!r})", flush=True)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=300)
        with ThreadPoolExecutor(max_workers=max(1, len(prompts))) as pool:
            answers = list(pool.map(lambda p: _ask(client, model, p, max_tokens, raw), prompts))
        for prompt, (text, reason, usage) in zip(prompts, answers):
            print(f"prompt: {prompt!r}")
            print(f"output: {text!r}")
            print(f"  finish_reason {reason}, usage: prompt {usage.prompt_tokens}, completion "
                  f"{usage.completion_tokens}, cached {_cached(usage)}")
        again = dict(model=model, max_tokens=max_tokens, temperature=0, stream=True,
                     stream_options={"include_usage": True})
        if raw:
            stream = client.completions.create(prompt=prompts[0], **again)
        else:
            stream = client.chat.completions.create(messages=[{"role": "user", "content": prompts[0]}], **again)
        pieces, usage = [], None
        for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].text if raw else chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        print(f"the first prompt again, streamed in {len(pieces)} chunks: {_cached(usage)} of {usage.prompt_tokens} "
              "prompt tokens came from the prefix cache")
    print("HTTP server stopped (drained)", flush=True)
