"""Wire types every kvrelay process shares: messages, KV layout, sampling parameters, errors.

Torch-free and numpy-free: the router, the workers and the transports all import it.
"""
