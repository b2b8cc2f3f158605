"""How many workers one side of the cluster should have: Ray Serve's default autoscaling policy,
with Dynamo Planner's load signals beside its ongoing requests. Pure: the caller gives the clock
and the samples (:class:`cluster.autoscaler.Autoscaler` runs it).

    policy = ScalingPolicy(config.decode.autoscaling)
    policy.record(LoadSample(now, ongoing_requests=5, kv_usage=0.7))   # summed over the side's workers
    decision = policy.decide(now, current=2)                           # .desired, .target, .reason

Each enabled signal asks for ``current × (its average per worker over the look-back) / target``
workers, which with the sums sampled here is ``average sum / target`` (a worker count does not
change the load it shares out); the desired count is the most any signal asks, moved towards by
the scaling factors (Ray Serve's ``_apply_scaling_factors``) and clamped to [min, max]. The count
to scale to (``target``) follows it only once it has stayed above the current count for
``upscale_delay_s`` (below it for ``downscale_delay_s``), as Ray Serve's ``_apply_delay_logic``.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Deque, NamedTuple, Optional

# a signal of LoadSample, by the AutoscalingConfig target it is held to
SIGNALS = (("ongoing_requests", "target_ongoing_requests"), ("waiting_requests", "target_waiting_requests"),
           ("queued_prefill_tokens", "target_queued_prefill_tokens"), ("kv_usage", "target_kv_usage"))


class LoadSample(NamedTuple):
    """One reading of a side's load, each signal summed over its live workers."""

    time: float
    ongoing_requests: float = 0.0  # held in any state: queued, transferring, running (Ray Serve's ongoing),
    # or waiting for the server's admission
    waiting_requests: float = 0.0  # waiting for a batch (a prefill side's: or for the server's admission)
    queued_prefill_tokens: float = 0.0  # uncached prompt tokens waiting to be prefilled
    kv_usage: float = 0.0  # fractions of KV slots in use (cached prefixes not counted)


class Decision(NamedTuple):
    """What :meth:`ScalingPolicy.decide` concluded at one tick."""

    current: int
    desired: int  # where the load says the side should be, in [min, max]
    target: int  # the count to scale to now: ``current`` while a delay runs
    reason: str


class ScalingPolicy:
    """One side's samples over the look-back and the delay that holds a change back."""

    def __init__(self, config):
        self.config = config
        self._samples: Deque[LoadSample] = deque()
        self._wanted_since: Optional[float] = None  # when the desired count first left the current one ...
        self._wanted_up = False  # ... and in which direction

    def record(self, sample: LoadSample) -> None:
        self._samples.append(sample)

    def restart_delay(self) -> None:
        """A change ended: the next one waits out its whole delay again (Ray Serve resets its timestamp).
        Only then: a decision the caller held back (a start's backoff) keeps the time its count was first
        wanted, and goes once the hold ends."""
        self._wanted_since = None

    def desired(self, now: float, current: int) -> "tuple[int, str]":
        """The count the load over the look-back asks for (smoothed, clamped) and which signal asked."""
        cfg = self.config
        while self._samples and self._samples[0].time <= now - cfg.look_back_period_s:
            self._samples.popleft()
        if not self._samples:
            return _clamp(current, cfg), "no load sample in the look-back period"
        asks = []
        for signal, target_name in SIGNALS:
            target = getattr(cfg, target_name)
            if target is not None:
                average = sum(getattr(s, signal) for s in self._samples) / len(self._samples)
                asks.append((average / target, f"{signal} {average:.3g} over {current} worker(s), target "
                             f"{target:g} each"))
        raw, why = max(asks, key=lambda ask: ask[0])
        return _clamp(_smoothed(raw, current, cfg), cfg), why

    def decide(self, now: float, current: int) -> Decision:
        desired, why = self.desired(now, current)
        if desired == current:
            self._wanted_since = None
            return Decision(current, desired, current, f"steady: {why}")
        up = desired > current
        if self._wanted_since is None or self._wanted_up != up:
            self._wanted_since, self._wanted_up = now, up
        delay = self.config.upscale_delay_s if up else self.config.downscale_delay_s
        waited = now - self._wanted_since
        if waited + 1e-9 < delay:  # (Ray Serve's tolerance for clock arithmetic)
            return Decision(current, desired, current, f"{why}; {'up' if up else 'down'}scale wanted for "
                            f"{waited:.1f}s of {delay:g}s")
        return Decision(current, desired, desired, why)


def _smoothed(raw: float, current: int, cfg) -> int:
    """Ray Serve's ``_apply_scaling_factors``: a factor's share of the way from ``current`` to
    ``raw``, rounded up, and at least one worker down when the load asks for fewer."""
    delta = raw - current
    factor = (cfg.upscaling_factor if delta > 0 else cfg.downscaling_factor) or 1.0
    scaled = math.ceil(current + factor * delta)
    if math.ceil(raw) < current and scaled == current:
        scaled -= 1
    return scaled


def _clamp(count: int, cfg) -> int:
    return max(cfg.min_workers, min(cfg.max_workers, count))
