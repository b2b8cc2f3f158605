"""The ``raydix`` command line.

    raydix generate [--model-path DIR] [--prompt TEXT] [--max-new-tokens N]
    raydix launch --config FILE [--prompt TEXT] [--set KEY=VALUE]   (cluster.launch)

With no ``--model-path`` it serves the built-in tiny model (random weights,
built once from a config into ``$RAYDIX_HOME/models``, ``~/.cache/raydix/models``
by default; nothing is downloaded).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

DEFAULT_FAMILY = "llama"
# actors.engine.tiny's (that imports torch)
FAMILIES = ("llama", "qwen3", "qwen3_next", "deepseek_v3", "gemma3", "gpt_oss", "qwen3_moe", "mixtral", "mistral",
            "phi3", "granite", "olmo2", "deepseek_v2")


def raydix_home() -> Path:
    return Path(os.environ.get("RAYDIX_HOME", Path.home() / ".cache" / "raydix"))


def builtin_model(family: str = DEFAULT_FAMILY, seed: int = 0) -> str:
    """Path of the built-in tiny checkpoint, built on first use.

    It is built in a scratch directory beside its place and renamed into it whole, so a
    build that was stopped halfway (config.json written, weights not) is never taken for
    the checkpoint, and two processes building it at once never read a half-written one."""
    from actors.engine import tiny

    path = raydix_home() / "models" / f"tiny-{family}-seed{seed}"
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        scratch.chmod(0o755)  # (mkdtemp's 0700 would follow it into place)
        tiny.build_tiny_checkpoint(family, scratch, seed=seed)
        if path.exists() and not any(path.glob("*.safetensors")):  # left by a build that stopped halfway
            shutil.rmtree(path, ignore_errors=True)
        try:
            os.rename(scratch, path)
        except OSError:  # another process built it meanwhile: theirs stays
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return str(path)


def cmd_generate(args) -> int:
    from actors.engine import Engine

    model_path = args.model_path or builtin_model(args.family)
    try:
        engine = Engine(model_path=model_path, device=args.device, max_total_tokens=args.max_total_tokens)
    except ValueError as exc:  # a bad setting (pydantic's ValidationError is one), or cuda without CUDA
        raise SystemExit(f"raydix generate: {exc}") from None
    try:
        params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "seed": args.seed}
        if args.raw:  # the text as a prompt: with the tokenizer's special tokens (BOS), as SGLang encodes it
            out = engine.generate(prompt=args.prompt, sampling_params=params)
        else:  # the template writes its own special tokens: none added on top (vLLM's chat)
            messages = [{"role": "user", "content": args.prompt}]
            text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = engine.tokenizer.encode(text, add_special_tokens=False)
            out = engine.generate(input_ids=ids, sampling_params=params)
        engine.check_integrity()
    finally:
        engine.shutdown()
    meta = out["meta_info"]
    print(f"model: {model_path}")
    print(f"prompt: {args.prompt!r}")
    print(f"output: {out['text']!r}")
    print(json.dumps({k: meta[k] for k in ("prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason")}))
    print(f"ttft {meta['ttft'] * 1000:.1f} ms, end-to-end {meta['e2e_latency'] * 1000:.1f} ms")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raydix", description="raydix: PD-disaggregated LLM serving on Ray")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline generation with one in-process engine")
    gen.add_argument("--model-path", help="HF checkpoint directory (default: the built-in tiny model)")
    gen.add_argument("--family", default=DEFAULT_FAMILY, choices=FAMILIES, help="family of the built-in tiny model")
    gen.add_argument("--prompt", default="Tell me about prefix caching.")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    gen.add_argument("--max-total-tokens", type=int, default=8192)
    gen.set_defaults(func=cmd_generate)
    sub.add_parser("launch", help="start the PD cluster of a config (see: raydix launch --help)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:  # the PD cluster has its own parser
        from cluster.launch import main as launch_main

        return launch_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
