"""The Ray actors of a raydix cluster, as plain Python classes.

The prefill and decode workers (``workers``, with their disaggregated schedulers
``pd_prefill`` and ``pd_scheduler``), their tensor-parallel rank actors (``rank``)
and the router (``router``, over a prefix index of the workers' KV events);
``actors/engine/`` holds the engine they host (scheduler, model runner, model
definitions, attention backends, sampling). ``cluster/`` applies ``ray.remote``
to these classes and wires the handles.
"""
