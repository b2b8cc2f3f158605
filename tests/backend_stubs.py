"""A ServingBackend with no workers to manage, for the HTTP app's in-process tests: a
subclass supplies ``model_name``, ``context_len``, ``max_prompt_len`` and ``generate_stream``."""

from __future__ import annotations


class StubBackend:
    draining = False
    is_sleeping = False
    priority_scheduling = False
    lora_modules = {}
    weight_version = "default"
    model_path = None
    starting = {}

    def routing_policy(self, role):
        return "round_robin"

    def workers(self, include_dead=False):
        return [{"id": "p-0", "role": "prefill", "node": "n", "alive": True, "inflight": 0, "load": {"waiting": 1}}]

    async def refresh_loads(self):
        pass

    async def health(self):
        return {"ready": True, "draining": False, "workers": {"p-0": True}}

    async def flush_cache(self):
        pass

    async def pause_generation(self, mode):
        pass

    async def continue_generation(self):
        pass

    async def add_worker(self, role):
        raise NotImplementedError(f"{type(self).__name__}: no workers to add")

    async def remove_worker(self, worker_id, drain_timeout_s=120.0):
        raise NotImplementedError(f"{type(self).__name__}: no workers to remove")

    async def drain(self, timeout_s):
        pass

    def start(self):
        pass

    def stop(self):
        pass
