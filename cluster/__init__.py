"""Bringing a raydix cluster up from a config.

Will hold placement groups, the OpenAI-compatible FastAPI app, the
``ray job submit`` entrypoint and the ``raydix`` command-line interface.
"""
