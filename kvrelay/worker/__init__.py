"""The runtime every worker role shares: process loop, router and peer links, config,
metrics, stats and the status server. Role specifics live in ``prefill/`` and ``decode/``."""
