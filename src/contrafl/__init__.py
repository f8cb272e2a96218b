"""contrafl: federated learning on non-IID data, centred on contrastive methods.

The package is laid out along the data flow of a simulation:
``data`` (datasets, partitions, batched augmentation) → ``models`` (backbones and heads)
→ ``algorithms`` (what the server sends, the client's local objective, what the client
returns, how the server aggregates) → ``engine`` (round loop, sampling, client state,
executors) → ``eval`` → ``cli``.
"""

__version__ = "0.1.0"
