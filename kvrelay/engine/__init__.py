"""kvrelay.engine

Importing the engine before torch asks torch's OpenMP threads to spin only briefly after each
parallel op (``envs.use_short_openmp_spin``, ~0.3 ms): a batched step's ops come tens of
microseconds apart, and a team that sleeps between them (the passive wait the ``kvrelay``
commands set for workers that share cores, ``envs.use_passive_openmp_wait``) made 16-64-row
decode steps 10-25% slower. The variable is removed again once torch has loaded (libgomp
read it then), so processes started from this one choose their own. The ``kvrelay`` commands
set their policy first, so their workers keep it; an offline ``LLM`` in a process that loaded
torch first keeps torch's.
"""

import os
import sys

from kvrelay import envs

if "torch" not in sys.modules and envs.use_short_openmp_spin():
    import torch  # noqa: F401  # libgomp reads its settings once, when torch loads it

    # this process's choice: processes it starts (a `kvrelay up` from a script) choose theirs
    del os.environ["GOMP_SPINCOUNT"]
