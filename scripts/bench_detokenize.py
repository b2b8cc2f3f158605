"""Cost per decode step of a request's output text: decoding the whole output after the prompt's
tail every step (what the engine did) against the incremental decode it does now
(:class:`actors.engine.finish.IncrementalText`, SGLang's surr / read offsets).

The tokenizer is the built-in byte-level one (one token a byte, characters of up to 4 bytes split
over tokens); times are per step, averaged over the last 100 steps of an output of each length.

    python scripts/bench_detokenize.py [--lengths 500 2000 8000]
"""

from __future__ import annotations

import argparse
import random
import time

from transformers import PreTrainedTokenizerFast

from actors.engine.finish import IncrementalText, decode_after
from actors.engine.tokenizer import BOS, EOS, PAD, build_byte_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[500, 2000, 8000])
    args = parser.parse_args()
    tok = PreTrainedTokenizerFast(tokenizer_object=build_byte_tokenizer(), bos_token=BOS, eos_token=EOS, pad_token=PAD)
    rng = random.Random(0)
    longest = max(args.lengths)
    text = "".join(rng.choice("abc déf €😀 \n") for _ in range(longest))
    ids = [5 + b for b in text.encode()][:longest]
    prompt = [5 + b for b in b"You are a helpful assistant."]
    print("| output tokens | whole-output decode µs/step | incremental µs/step | speed-up |")
    print("|---:|---:|---:|---:|")
    for length in args.lengths:
        steps = range(max(length - 100, 1), length + 1)
        start = time.perf_counter()
        for n in steps:
            decode_after(tok, prompt, ids[:n], True)
        whole = (time.perf_counter() - start) / len(steps)
        inc = IncrementalText(tok, prompt, True)
        for n in range(1, steps[0]):
            inc.update(tok, ids, n)
        start = time.perf_counter()
        for n in steps:
            inc.update(tok, ids, n)
        step = (time.perf_counter() - start) / len(steps)
        print(f"| {length:,} | {whole * 1e6:,.0f} | {step * 1e6:,.1f} | {whole / step:,.0f}× |")


if __name__ == "__main__":
    main()
