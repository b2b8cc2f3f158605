"""The Ray actors of a raydix cluster, as plain Python classes.

Will hold the prefill worker, the decode worker, their tensor-parallel rank
actors and the router; ``actors/engine/`` will hold the engine they host
(scheduler, model runner, model definitions, attention backends, sampling).
``cluster/`` applies ``ray.remote`` to these classes and wires the handles.
"""
