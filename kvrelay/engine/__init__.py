"""kvrelay.engine

Importing the engine before torch asks torch's OpenMP threads to sleep between ops
(``envs.use_passive_openmp_wait``), as the ``kvrelay`` commands do for the workers: the
engine runs its native kernels on a thread pool of its own (``kernels/gemv.py``), and an
OpenMP thread spinning for milliseconds after each torch op holds the core that pool needs.
An offline ``LLM`` in a process that loaded torch first keeps torch's policy.
"""

import sys

from kvrelay import envs

if "torch" not in sys.modules:
    envs.use_passive_openmp_wait()
