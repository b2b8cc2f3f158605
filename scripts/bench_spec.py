"""Offline decoding with n-gram (or, ``--draft``, draft-model) speculative decoding off and on (k = 2, 4 draft tokens).

Greedy requests on a tiny random-weight Llama (HF's default init; built here, no download).
Workloads: ``loop``, random prompts — a random model under greedy decoding soon loops, which
the n-gram lookup catches —; ``copy``, each prompt followed by the first 64 tokens of the
model's own continuation, so the output goes on with text the prompt holds (as an edit or a
quote repeats its input). Each case runs ``--repeats`` times on its own engine; the table: output tokens per second (wall time of ``generate`` over
the batch, the fastest run), forwards, the acceptance rate (accepted / drafted tokens) and the mean accepted
length (tokens a drafted request gets per verify step, its bonus token included).
``--draft``: draft-model speculative decoding instead, the draft the target cut to its first layer
(its embedding, layer 0 and head: it agrees with the target often; built here) or ``--draft PATH``.

    python scripts/bench_spec.py [--device cpu] [--batches 1 16] [--max-new-tokens 256] [--draft [PATH]]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine import Engine  # noqa: E402
from actors.engine.tiny import tiny_config  # noqa: E402

COPIED = 64  # tokens of the model's own continuation a ``copy`` prompt ends with


def build_model(out: Path) -> str:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config("llama")).save_pretrained(out)
    return str(out)


def build_draft(model: str, out: Path) -> str:
    """The target cut to its first layer."""
    from transformers import LlamaForCausalLM

    LlamaForCausalLM.from_pretrained(model, num_hidden_layers=1).save_pretrained(out)
    return str(out)


def run(model: str, device: str, batch: List[List[int]], max_new_tokens: int, k: Optional[int],
        repeats: int = 1, draft: Optional[str] = None) -> Dict:
    """The batch's outputs and figures, timed at the best of ``repeats`` runs (the prefix cache
    flushed before each: every run prefills the whole prompts); ``draft``: a draft model's path
    (else n-gram drafts)."""
    spec = {} if k is None else {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": k}
    if k is not None and draft is not None:
        spec.update(speculative_algorithm="draft_model", speculative_draft_model_path=draft)
    engine = Engine(model_path=model, device=device, skip_tokenizer_init=True, max_total_tokens=65536, **spec)
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    try:
        engine.generate(input_ids=batch[:1], sampling_params={**params, "max_new_tokens": 8})  # warm-up
        best = float("inf")
        for _ in range(repeats):
            engine.flush_cache()
            forwards, before = engine.runner.num_forwards, engine.scheduler.spec_stats.as_dict()
            start = time.perf_counter()
            outs = engine.generate(input_ids=batch, sampling_params=params)
            best = min(best, time.perf_counter() - start)
        stats = engine.scheduler.spec_stats.as_dict()
        drafted, accepted, drafts = (stats[key] - before[key]
                                     for key in ("num_draft_tokens", "num_accepted_tokens", "num_drafts"))
        return {"outputs": [o["output_ids"] for o in outs], "tok_s": sum(len(o["output_ids"]) for o in outs) / best,
                "forwards": engine.runner.num_forwards - forwards, "acceptance": accepted / max(1, drafted),
                "mean_len": (accepted + drafts) / max(1, drafts)}
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each case; the fastest is reported")
    parser.add_argument("--draft", nargs="?", const="first-layer", default=None,
                        help="draft-model speculative decoding: the target's first layer (built here) or a path")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "llama")
        draft = args.draft
        if draft == "first-layer":
            draft = build_draft(model, Path(tmp) / "draft")
        rng = random.Random(0)
        prompts = [[rng.randrange(5, 250) for _ in range(rng.randint(16, 64))] for _ in range(max(args.batches))]
        first = run(model, args.device, prompts, COPIED, None)["outputs"]
        workloads = {"loop": prompts, "copy": [p + o for p, o in zip(prompts, first)]}
        print("| workload | batch | k | tokens/s | forwards | acceptance | mean accepted len | speed-up |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name, all_prompts in workloads.items():
            for bs in args.batches:
                base = None
                for k in (None, 2, 4):
                    r = run(model, args.device, all_prompts[:bs], args.max_new_tokens, k, args.repeats, draft)
                    if base is None:
                        base = r
                    assert r["outputs"] == base["outputs"], "speculative decoding changed greedy tokens"
                    label = "off" if k is None else k
                    spec = "–" if k is None else f"{r['acceptance']:.2f}"
                    mean = "–" if k is None else f"{r['mean_len']:.2f}"
                    print(f"| {name} | {bs} | {label} | {r['tok_s']:.0f} | {r['forwards']} | {spec} | {mean} | "
                          f"{r['tok_s'] / base['tok_s']:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
