"""One process of a multi-process scenario (see harness.py): worker.py SCENARIO ID N PORT OUT.

SCENARIO is a function of scenarios.py, or ``module.function`` for one of another module next
to this file; the module is imported after `jax.distributed.initialize`, which must come
before lowbit starts a backend.
"""

import faulthandler
import importlib
import signal
import sys
from pathlib import Path

import jax
import numpy as np

# The harness sends SIGUSR1 to a worker that runs past its timeout: every thread's stack
# goes to the log, so a hang names where it waits.
faulthandler.register(signal.SIGUSR1, all_threads=True)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
scenario, pid, n, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:6]
jax.distributed.initialize(
    f"127.0.0.1:{port}", num_processes=n, process_id=pid, initialization_timeout=120
)
sys.path.insert(0, str(Path(__file__).parent))
module, _, function = scenario.rpartition(".")
scenarios = importlib.import_module(module or "scenarios")
np.savez(f"{out}/result{pid}.npz", **getattr(scenarios, function)(out, *sys.argv[6:]))
jax.distributed.shutdown()
