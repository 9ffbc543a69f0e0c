"""kvrelay.engine

Importing the engine before torch asks torch's OpenMP threads to spin only briefly after each
parallel op (``envs.use_short_openmp_spin``, ~0.3 ms): a batched step's ops come tens of
microseconds apart, and a team that sleeps between them (the passive wait the ``kvrelay``
commands set for workers that share cores, ``envs.use_passive_openmp_wait``) made 16-64-row
decode steps 10-25% slower. The ``kvrelay`` commands set their policy first, so their workers
keep it; an offline ``LLM`` in a process that loaded torch first keeps torch's.
"""

import sys

from kvrelay import envs

if "torch" not in sys.modules:
    envs.use_short_openmp_spin()
