"""contrafl: federated learning on non-IID data, centred on contrastive methods.

The package is laid out along the data flow of a simulation:
``data`` (datasets, partitions, batched augmentation) → ``models`` (backbones and heads)
→ ``algorithms`` (what the server sends, the client's local objective, what the client
returns, how the server aggregates) → ``engine`` (round loop, sampling, client state,
executors) → ``eval`` → ``cli``.
"""

import os

# Let idle OpenMP threads sleep instead of spinning: with the default policy, two torch
# processes sharing a few cores (a simulation next to a test run, or the parallel
# executor's workers) slow each other down by one to two orders of magnitude. Must be
# set before torch initialises OpenMP; an explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
