"""Scaling hooks, one module each; created by name through ``kvrelay.autoscale.registry``.

Nothing is imported here: each hook's dependencies (the ``kubernetes`` client, httpx) load
only when that hook is chosen.
"""
