"""Start (or join) a Ray cluster and bring the PD workers of a config up.

    python -m cluster.launch --config configs/local_cpu.yaml               # serve until Ctrl-C / SIGTERM
    python -m cluster.launch --config configs/local_cpu.yaml --prompt "Hi"  # send requests, then drain and exit
    raydix launch --config ...                                               # the same, as a console script

``RAY_ADDRESS`` joins an existing cluster (``ray job submit`` sets it);
otherwise a local Ray instance is started. Ctrl-C / SIGTERM drains: new
requests are refused, in-flight transfers and decodes finish, then the
workers free their pools and exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from typing import Dict, List, Optional

logger = logging.getLogger("raydix.launch")


def parse_overrides(pairs: List[str]) -> Dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set expects key=value, got {pair!r}")
        out[key] = value
    return out


def init_ray(num_cpus: Optional[int] = None) -> None:
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace="raydix")
    else:
        ray.init(num_cpus=num_cpus, namespace="raydix", include_dashboard=False, log_to_driver=False)


def load_tokenizer(config, model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.model.tokenizer_path or model_path, local_files_only=True)


def render_prompt(tokenizer, prompt: str, raw: bool = False) -> List[int]:
    if raw:
        return tokenizer.encode(prompt, add_special_tokens=False)
    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


async def run_prompts(client, tokenizer, prompts: List[str], max_new_tokens: int, raw: bool) -> List[dict]:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    outs = await asyncio.gather(*(client.generate(render_prompt(tokenizer, p, raw), params) for p in prompts))
    for prompt, out in zip(prompts, outs):
        meta = out["meta_info"]
        print(f"prompt: {prompt!r}")
        print(f"output: {out.get('text', out['output_ids'])!r}")
        keys = ("prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "prefill_worker", "decode_worker")
        print("  " + json.dumps({k: meta.get(k) for k in keys}))
        print(f"  ttft (prefill + transfer) {meta['ttft_pd'] * 1000:.1f} ms, end-to-end {meta['e2e_latency_pd'] * 1000:.1f} ms")
    return outs


def serve_until_signal(cluster) -> None:
    stop = {"now": False}

    def handler(signum, frame):
        logger.info("signal %s: draining", signum)
        stop["now"] = True

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    print(f"serving: {len(cluster.prefill)} prefill + {len(cluster.decode)} decode workers; Ctrl-C drains and stops",
          flush=True)
    while not stop["now"]:
        time.sleep(0.5)


def main(argv: Optional[List[str]] = None) -> int:
    from cluster.config import load_config
    from cluster.pd import PDCluster

    parser = argparse.ArgumentParser(prog="raydix launch", description="start the PD workers of a cluster config")
    parser.add_argument("--config", required=True, help="cluster YAML (see configs/)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field by dotted path, e.g. --set decode.num_workers=2")
    parser.add_argument("--prompt", action="append", default=[], help="send this prompt (repeatable), then exit")
    parser.add_argument("--raw", action="store_true", help="send prompts as is, without the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs of a local Ray instance")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    config = load_config(args.config)
    if args.set:
        config = config.with_updates(parse_overrides(args.set))
    init_ray(args.num_cpus)
    model_path = config.model.resolve_model_path()
    started = time.perf_counter()
    cluster = PDCluster(config, model_path).start()
    print(f"cluster up in {time.perf_counter() - started:.1f}s: model {config.model.name} ({model_path})", flush=True)
    try:
        if args.prompt:
            tokenizer = load_tokenizer(config, model_path)

            async def demo():
                client = cluster.client()
                await run_prompts(client, tokenizer, args.prompt, args.max_new_tokens, args.raw)
                again = await client.generate(render_prompt(tokenizer, args.prompt[0], args.raw),
                                              {"max_new_tokens": args.max_new_tokens, "temperature": 0.0})
                meta = again["meta_info"]
                print(f"the first prompt again: {meta['cached_tokens']} of {meta['prompt_tokens']} prompt tokens "
                      f"came from the prefix cache, ttft {meta['ttft_pd'] * 1000:.1f} ms")

            asyncio.run(demo())
            cluster.check_integrity()
            print("workers idle, integrity checks passed")
        else:
            serve_until_signal(cluster)
    finally:
        cluster.drain_and_shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
