"""One decode step's sampling, the dense way it was done and the sparse way it is done now.

"dense": what the scheduler did before — a ``[bs, vocab]`` float32 adjustment tensor
(:func:`~actors.engine.sampling.logit_adjustments`) whenever a row has a ``logit_bias`` or a
min-tokens mask, one batched argmax for plain greedy rows, and every penalised row through
:func:`~actors.engine.sampling.sample_next` on its own (its prompt's and output's id sets and a
vocab-sized count rebuilt each step). "sparse": the scheduler's
:meth:`~actors.engine.scheduler.Scheduler._pick_tokens` — per-request state synced with the new
token, ``(row, token, value)`` triples written with ``index_put_``, then
:func:`~actors.engine.sampling.pick_tokens`.

Every request is greedy (temperature 0), so the table shows the adjustments' cost, not the
draws' (top-k/p sorts are the same work either way). Each step appends one token to every
output first, as decoding does. Modes: ``none``; ``penalties`` (frequency 0.5, presence 0.3,
repetition 1.1; 1,024-token prompts, outputs from 128 tokens); ``logit_bias`` (32 ids a
request); ``min_tokens`` (EOS and 4 stop ids masked). The sparse step adjusts the float32
logits in place, as the scheduler does a step's own: their values drift from step to step,
not the work.

The second table ("draw") times the draw itself, every row sampled (temperature 0.8 with top-k 40,
top-p 0.95 and min-p 0.02, or top-p 0.95 alone; every other row seeded): "per-row" as the scheduler did it before — the
sampled rows copied to the host in one ``[n, vocab]`` float32 transfer, then softmax, top-k/top-p
sorts and ``multinomial`` row by row with CPU generators —, "batched" as
:func:`~actors.engine.sampling.pick_tokens` does it now, on the logits' device (one sort, an
exponential race, the tokens copied back).

The third ("top-p") times ``pick_tokens`` with top-p 0.95 alone (temperature 0.8, every other row
seeded), the filters on whole sorted rows (``FIRST_HEAD`` the vocab: the sort it did before) and
on each row's largest first (:func:`~actors.engine.sampling.filter_sorted_probs`), over
standard-normal logits times 5 ("peaked": a nucleus of tens to a few hundred tokens, as a model's
usually is) or times 1 ("flat": most of the vocab, where every row ends in the whole sort).

    python scripts/bench_sampling.py [--device cpu] [--batches 1 32 256] [--vocabs 32000 152000]
                                     [--tables adjust draw top-p]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Callable, List
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine import sampling  # noqa: E402
from actors.engine.req import Req  # noqa: E402
from actors.engine.sampling import (filter_probs, logit_adjustments, make_generator, pick_tokens,  # noqa: E402
                                    sample_next)
from actors.engine.sampling_params import SamplingParams  # noqa: E402
from actors.engine.scheduler import Scheduler  # noqa: E402

EOS = [2]
MODES = ("none", "penalties", "logit_bias", "min_tokens")


def make_reqs(mode: str, batch: int, vocab: int, rng: random.Random) -> List[Req]:
    params = {
        "none": lambda: SamplingParams(temperature=0, max_new_tokens=4096),
        "penalties": lambda: SamplingParams(temperature=0, max_new_tokens=4096, frequency_penalty=0.5,
                                            presence_penalty=0.3, repetition_penalty=1.1),
        "logit_bias": lambda: SamplingParams(temperature=0, max_new_tokens=4096,
                                             logit_bias={rng.randrange(vocab): 2.0 for _ in range(32)}),
        "min_tokens": lambda: SamplingParams(temperature=0, max_new_tokens=4096, min_new_tokens=4096,
                                             stop_token_ids=[rng.randrange(vocab) for _ in range(4)]),
    }[mode]
    reqs = []
    for i in range(batch):
        req = Req(f"r{i}", [rng.randrange(vocab) for _ in range(1024)], params(), eos_token_ids=EOS)
        req.output_ids = [rng.randrange(vocab) for _ in range(128)]
        reqs.append(req)
    return reqs


def dense_step(reqs: List[Req], logits: torch.Tensor) -> List[int]:
    """The scheduler's decode picks before the sparse path."""
    params = [r.sampling_params for r in reqs]
    masked = [p.masked_token_ids(len(r.output_ids), r.eos_token_ids) for p, r in zip(params, reqs)]
    adjust = logit_adjustments(params, masked, logits.shape[-1], logits.device)
    rows = [i for i, p in enumerate(params) if p.is_greedy and not p.has_penalties and not p.return_logprob]
    plain = logits if adjust is None else logits.float() + adjust  # (one argmax for the plain greedy rows)
    greedy = dict(zip(rows, torch.argmax(plain[torch.tensor(rows, dtype=torch.int64)], dim=-1).tolist())) if rows else {}
    return [greedy[i] if i in greedy else sample_next(logits[i], r.sampling_params, r.origin_input_ids, r.output_ids,
                                                      r.generator, None if adjust is None else adjust[i])[0]
            for i, r in enumerate(reqs)]


def sparse_step(reqs: List[Req], logits: torch.Tensor) -> List[int]:
    return [pick.token for pick in Scheduler._pick_tokens(reqs, logits)]


DRAWS = {"top-k 40, top-p 0.95": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.02),
         "top-p 0.95": dict(temperature=0.8, top_p=0.95)}


def per_row_draw(logits: torch.Tensor, params: List[SamplingParams], generators: List[torch.Generator]) -> List[int]:
    """The draw as it was: one transfer to the host, then each row on its own with a CPU generator."""
    rows = logits.float().cpu()
    return [int(torch.multinomial(filter_probs(torch.softmax(row / p.temperature, dim=-1), p), 1, generator=gen))
            for row, p, gen in zip(rows, params, generators)]


def seeded_draws(batch: int, draw: dict, device: str):
    """``batch`` rows of ``draw``'s parameters, every other one seeded, and their generators on ``device``."""
    params = [SamplingParams(**draw, seed=i if i % 2 else None) for i in range(batch)]
    return params, [make_generator(p.seed, device) if p.seed is not None else None for p in params]


def time_draws(batch: int, vocab: int, draw: dict, device: str, min_s: float):
    """Mean seconds of one step's draw with ``draw``'s parameters, per-row and batched."""
    logits = torch.randn(batch, vocab, device=device)
    params, device_gens = seeded_draws(batch, draw, device)
    cpu_gens = [make_generator(p.seed) for p in params]
    steps = {"per-row": lambda: per_row_draw(logits, params, cpu_gens),
             "batched": lambda: pick_tokens(logits.clone(), params, device_gens, [None] * batch)}
    return [time_call(steps[name], logits.is_cuda, min_s) for name in ("per-row", "batched")]


TOP_P_LOGITS = {"peaked": 5.0, "flat": 1.0}  # the standard-normal logits' scale


def time_top_p(batch: int, vocab: int, scale: float, device: str, min_s: float):
    """Mean seconds of one step's top-p 0.95 draw, whole rows sorted and each row's largest first."""
    logits = torch.randn(batch, vocab, device=device) * scale
    params, gens = seeded_draws(batch, DRAWS["top-p 0.95"], device)

    def draw() -> None:
        pick_tokens(logits.clone(), params, gens, [None] * batch)

    with mock.patch.object(sampling, "FIRST_HEAD", vocab):
        whole = time_call(draw, logits.is_cuda, min_s)
    return whole, time_call(draw, logits.is_cuda, min_s)


def time_call(fn: Callable, cuda: bool, min_s: float) -> float:
    """Mean seconds of ``fn()`` (synchronised), over at least ``min_s`` and 3 calls, after a warm-up."""
    def one() -> None:
        fn()
        if cuda:
            torch.cuda.synchronize()

    one()
    n, start = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - start < min_s:
        one()
        n += 1
    return (time.perf_counter() - start) / n


def time_step(step: Callable, reqs: List[Req], logits: torch.Tensor, min_s: float) -> float:
    """Mean seconds of one step (each after every output grew by a token), over at least ``min_s``."""
    def one() -> None:
        for r in reqs:
            r.output_ids.append(7)
        step(reqs, logits)
        if logits.is_cuda:
            torch.cuda.synchronize()

    one()  # warm: the sparse states are built here, as at a request's first step
    n, start = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - start < min_s:
        one()
        n += 1
    return (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32000, 152000])
    parser.add_argument("--min-s", type=float, default=0.15, help="time each cell for at least this long")
    parser.add_argument("--tables", nargs="+", choices=("adjust", "draw", "top-p"), default=["adjust", "draw", "top-p"])
    args = parser.parse_args()
    torch.manual_seed(0)
    if "adjust" in args.tables:
        adjust_table(args)
    if "draw" in args.tables:
        comparison_table(args, "params | per-row draw ms/step | batched draw ms/step", DRAWS,
                         lambda batch, vocab, draw: time_draws(batch, vocab, draw, args.device, args.min_s))
    if "top-p" in args.tables:
        comparison_table(args, "logits | whole sort ms/step | largest first ms/step", TOP_P_LOGITS,
                         lambda batch, vocab, scale: time_top_p(batch, vocab, scale, args.device, args.min_s))


def comparison_table(args, columns: str, cases: dict, time_pair: Callable) -> None:
    """A row per vocab, batch and case: ``time_pair(batch, vocab, case)``'s two mean seconds (before,
    after) and their ratio."""
    print(f"\n| vocab | batch | {columns} | speed-up |")
    print("|---:|---:|---|---:|---:|---:|")
    for vocab in args.vocabs:
        for batch in args.batches:
            for name, case in cases.items():
                before, after = time_pair(batch, vocab, case)
                print(f"| {vocab:,} | {batch} | {name} | {before * 1e3:,.2f} | {after * 1e3:,.2f} | "
                      f"{before / after:,.1f}× |", flush=True)


def adjust_table(args) -> None:
    """The adjustments' table: dense and sparse per mode (every row greedy)."""
    print("| vocab | batch | mode | dense ms/step | sparse ms/step | speed-up |")
    print("|---:|---:|---|---:|---:|---:|")
    for vocab in args.vocabs:
        for batch in args.batches:
            logits = torch.randn(batch, vocab, device=args.device)  # fp32, as the model returns them
            for mode in MODES:
                times = []
                for step in (dense_step, sparse_step):
                    reqs = make_reqs(mode, batch, vocab, random.Random(batch))
                    times.append(time_step(step, reqs, logits, args.min_s))
                dense, sparse = times
                print(f"| {vocab:,} | {batch} | {mode} | {dense * 1e3:,.2f} | {sparse * 1e3:,.2f} | "
                      f"{dense / sparse:,.1f}× |", flush=True)

if __name__ == "__main__":
    main()
