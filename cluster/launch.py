"""Start (or join) a Ray cluster and bring the PD workers of a config up.

    python -m cluster.launch --config configs/local_cpu.yaml               # serve HTTP until Ctrl-C / SIGTERM
    python -m cluster.launch --config configs/local_cpu.yaml --prompt "Hi"  # requests through HTTP, drain, exit
    raydix launch --config ...                                               # the same, as a console script

``RAY_ADDRESS`` joins an existing cluster (``ray job submit`` sets it);
otherwise a local Ray instance is started. Serving, the OpenAI-compatible
app of ``cluster.server`` listens on ``server.host:server.port``; with
``--prompt`` it listens on a free loopback port and the prompts go through
it with the openai client. Ctrl-C / SIGTERM drains: new requests are
refused, in-flight transfers and decodes finish, then the workers free
their pools and exit.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Dict, List, Optional

logger = logging.getLogger("raydix.launch")


YAML_NULLS = ("", "~", "null", "Null", "NULL")


def parse_overrides(pairs: List[str]) -> Dict[str, Optional[str]]:
    """``--set key=value`` pairs by dotted key. A value is what ``key: value`` means in the YAML as
    far as null goes (``null``, ``~`` or nothing clears an optional field); any other value stays a
    string, for the field's own type to parse (``"9000"`` a port, ``"123"`` still a name)."""
    out: Dict[str, Optional[str]] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set expects key=value, got {pair!r}")
        out[key.strip()] = None if value.strip() in YAML_NULLS else value
    return out


def init_ray(num_cpus: Optional[int] = None) -> None:
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace="raydix")
    else:
        ray.init(address="local", num_cpus=num_cpus, namespace="raydix", include_dashboard=False, log_to_driver=False)


def load_tokenizer(config, model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.model.tokenizer_path or model_path, local_files_only=True)


def main(argv: Optional[List[str]] = None) -> int:
    from cluster.config import load_config
    from cluster.pd import PDCluster

    parser = argparse.ArgumentParser(prog="raydix launch", description="start the PD workers of a cluster config")
    parser.add_argument("--config", required=True, help="cluster YAML (see configs/)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field by dotted path, e.g. --set decode.num_workers=2 "
                        "(null clears an optional one)")
    parser.add_argument("--prompt", action="append", default=[], help="send this prompt (repeatable), then exit")
    parser.add_argument("--raw", action="store_true", help="send prompts as is, without the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs of a local Ray instance")
    parser.add_argument("--port", type=int, default=None,
                        help="HTTP port (default: server.port; with --prompt, any free port)")
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
        tokenizer = load_tokenizer(config, model_path)
        if args.prompt:  # through HTTP with the openai client, then drain and exit
            from cluster.demo import run_http_demo

            run_http_demo(cluster, tokenizer, config, args.prompt, args.max_new_tokens, args.raw, args.port)
            cluster.check_integrity()
            print("workers idle, integrity checks passed")
        else:
            from cluster.http_server import serve_forever
            from cluster.server import build_app

            port = args.port or config.server.port
            print(f"serving {config.model.name!r} on http://{config.server.host}:{port}/v1 "
                  f"({len(cluster.prefill)} prefill + {len(cluster.decode)} decode workers); "
                  "Ctrl-C / SIGTERM drains and stops", flush=True)
            serve_forever(build_app(cluster, tokenizer, config), config.server.host, port)
    finally:
        cluster.drain_and_shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
