"""A decode step's delivery to asyncio streams: one ``call_soon_threadsafe`` per stream (how the
engine loop delivered before) against one per event loop (``hand_over``).

This thread plays the engine loop: each step it puts one output on each of N streams' queues,
read by N coroutines on an event loop in another thread, as the engine's and the workers'
``async_generate``/``stream`` read them. Per step: the engine thread's time to hand the step
over, and the time until every stream has its output (the snapshots are the same either way,
so they are left out).

    python scripts/bench_delivery.py --streams 256 --steps 200
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time

from actors.engine.engine_loop import Post, hand_over


def per_stream(posts):
    for post in posts:
        post.loop.call_soon_threadsafe(post.fn, *post.args)


def run(deliver, num_streams: int, num_steps: int):
    loop = asyncio.new_event_loop()
    queues, got, all_got = [], [0], threading.Event()

    async def read(queue):
        while await queue.get() is not None:
            got[0] += 1
            if got[0] == num_streams:
                got[0] = 0
                all_got.set()

    def serve():
        asyncio.set_event_loop(loop)
        queues.extend(asyncio.Queue() for _ in range(num_streams))
        readers = asyncio.gather(*(read(q) for q in queues))
        started.set()
        loop.run_until_complete(readers)

    started = threading.Event()
    thread = threading.Thread(target=serve)
    thread.start()
    started.wait()
    hand, whole = [], []
    for _ in range(num_steps):
        t0 = time.perf_counter()
        deliver([Post(loop, q.put_nowait, (1,)) for q in queues])
        t1 = time.perf_counter()
        all_got.wait()
        all_got.clear()
        hand.append(t1 - t0)
        whole.append(time.perf_counter() - t0)
    hand_over([Post(loop, q.put_nowait, (None,)) for q in queues])
    thread.join()
    loop.close()
    return statistics.median(hand) * 1e3, statistics.median(whole) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    print("| delivery | engine thread ms/step | until every stream has it ms/step |\n|---|---:|---:|")
    for name, deliver in (("per stream", per_stream), ("per event loop", hand_over)):
        hand, whole = run(deliver, args.streams, args.steps)
        print(f"| {name} | {hand:.3f} | {whole:.3f} |")


if __name__ == "__main__":
    main()
