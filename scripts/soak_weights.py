"""The weight updates of scripts/soak.py: every ``interval`` seconds of the run, POST
/update_weights_from_disk (``server.allow_weight_updates``) alternating between two checkpoints of
one config (the built-in model and another seed's), each under a new ``weight_version``, while the
mix keeps sending. An update is held to SGLang's contract: it succeeds, GET /get_weight_version
names its version, and a greedy probe sent right after gives the new weights' output (the same as
that checkpoint's first probe: at start, and after the first update to the other); the requests
meanwhile wait rather than fail, and the ``generate`` kind (SGLang's /generate, whose meta_info
carries the version) checks that each ran under a version in effect at some time of its life."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import random
import time
from typing import Dict, List, Set, Tuple

import httpx

from soak_client import Ctx, Outcome, post, prompt, require, sampling

PROBE = {"text": "the probe of the weights:", "sampling_params": {"temperature": 0, "max_new_tokens": 16,
                                                                  "ignore_eos": True}}
UPDATE_TIMEOUT_S = 600.0  # (an update waits for the requests in flight, which a busy CPU makes slow)


class WeightUpdates:
    """The updates of one run (``paths``: the two checkpoints, the served one first) and when each
    was asked for and answered, to tell which versions a request may have run under."""

    def __init__(self, paths: Tuple[str, str], interval: float):
        self.paths, self.interval = paths, interval
        # (version, when its update was asked for, when answered): "default" served from the start
        self.timeline: List[Tuple[str, float, float]] = [("default", -math.inf, -math.inf)]
        self.references: Dict[str, List[int]] = {}  # checkpoint path: the probe's output_ids there
        self._changed = asyncio.Condition()  # (of the two counts below)
        self._steady = 0  # requests in :meth:`steady` now
        self._updating = False  # an update waits for them or runs

    @contextlib.asynccontextmanager
    async def steady(self):
        """No update while in it: for requests held to each other's answers (greedy twice, a stream
        against the whole answer, a score against embeddings), which two weights would tell apart.
        An update waiting keeps new ones out, so that it is not put off for ever."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self._updating)
            self._steady += 1
        try:
            yield
        finally:
            async with self._changed:
                self._steady -= 1
                self._changed.notify_all()

    async def _between_steady(self, step) -> Outcome:
        """``step`` (an update) once no request is in :meth:`steady`."""
        async with self._changed:
            self._updating = True
            await self._changed.wait_for(lambda: self._steady == 0)
        try:
            return await step()
        finally:
            async with self._changed:
                self._updating = False
                self._changed.notify_all()

    def versions_during(self, start: float, end: float) -> Set[str]:
        """The versions that may have served at some time in [start, end]: from its update's request
        until the next update's answer (or now, for an update not answered yet)."""
        out = set()
        for k, (version, asked, _) in enumerate(self.timeline):
            superseded = self.timeline[k + 1][2] if k + 1 < len(self.timeline) else math.inf
            if asked <= end and superseded >= start:
                out.add(version)
        return out

    async def _probe(self, ctx: Ctx, path: str, version: str) -> None:
        """The greedy probe under ``version``: the output ``path``'s first probe gave."""
        answer = await post(ctx, "/generate", PROBE)
        require(answer.status_code == 200, f"probe {answer.status_code}: {answer.text[:300]}")
        out = answer.json()
        require(out["meta_info"]["weight_version"] == version, f"probe under {out['meta_info']['weight_version']}, "
                f"not {version}")
        want = self.references.setdefault(path, out["output_ids"])
        require(out["output_ids"] == want, f"{path} now gives {out['output_ids']}, first {want}")
        require(len(self.references) < 2 or self.references[self.paths[0]] != self.references[self.paths[1]],
                "both checkpoints give the same probe output")

    async def _update(self, ctx: Ctx, k: int) -> None:
        path, version = self.paths[k % 2], f"soak-{k}"
        headers = {"Authorization": f"Bearer {ctx.client.api_key}"}
        self.timeline.append((version, time.monotonic(), math.inf))
        async with httpx.AsyncClient(base_url=ctx.base_url, timeout=UPDATE_TIMEOUT_S, headers=headers) as raw:
            answer = await raw.post("/update_weights_from_disk", json={"model_path": path, "weight_version": version})
            self.timeline[-1] = (version, self.timeline[-1][1], time.monotonic())
            require(answer.status_code == 200 and answer.json()["success"] is True
                    and isinstance(answer.json()["num_paused_requests"], int), f"update to {path} as {version}: "
                    f"{answer.status_code} {answer.text[:300]}")
            served = (await raw.get("/get_weight_version")).json()["weight_version"]
        require(served == version, f"/get_weight_version {served!r} after the update to {version!r}")
        await self._probe(ctx, path, version)

    async def run(self, ctx: Ctx, stop: asyncio.Event) -> List[Outcome]:
        """The start's probe, then an update every ``interval`` seconds until ``stop``: one outcome each
        (kind ``weights``)."""
        outcomes = [await self._outcome(lambda: self._probe(ctx, self.paths[0], "default"))]
        for k in itertools.count(1):
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
                return outcomes
            except asyncio.TimeoutError:
                outcomes.append(await self._between_steady(lambda: self._outcome(lambda: self._update(ctx, k))))
                print(f"  weights update {k}: {outcomes[-1].status} in {outcomes[-1].latency:.1f}s", flush=True)

    @staticmethod
    async def _outcome(step) -> Outcome:
        start = time.perf_counter()
        try:
            await step()
            return Outcome("weights", "ok", time.perf_counter() - start)
        except Exception as exc:
            return Outcome("weights", "unexpected", time.perf_counter() - start, detail=f"{type(exc).__name__}: {exc}")


async def generate(ctx: Ctx, rng: random.Random) -> int:
    """SGLang's /generate, streamed or not: the output_ids its meta_info counts, under a weight version
    in effect at some time of its life ("default" in a run without updates)."""
    start = time.monotonic()
    stream = rng.random() < 0.5
    body = {"text": prompt(rng, False)["prompt"], "stream": stream,
            "sampling_params": dict(sampling(rng), max_new_tokens=rng.randint(1, 32))}
    answer = await post(ctx, "/generate", body)
    end = time.monotonic()
    require(answer.status_code == 200, f"/generate {answer.status_code}: {answer.text[:300]}")
    results = ([json.loads(line[len("data:"):]) for line in answer.text.splitlines()
                if line.startswith("data:") and "[DONE]" not in line] if stream else [answer.json()])
    allowed = ctx.weights.versions_during(start, end) if ctx.weights else {"default"}
    for out in results:
        meta = out["meta_info"]
        require(meta["weight_version"] in allowed, f"weight_version {meta['weight_version']} not of {allowed}")
    meta, ids = results[-1]["meta_info"], results[-1]["output_ids"]
    require(meta["finish_reason"] is not None and meta["completion_tokens"] == len(ids) > 0, f"meta_info {meta}")
    return len(ids)


WEIGHT_KINDS = {"generate": (generate, 2)}  # name: (sender, weight)
