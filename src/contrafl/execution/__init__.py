"""How clients train: the executors, below the round loop.

An executor receives a round's jobs (each client's local task, made by the algorithm
from the server's message and the client's state, its batch plans and its optimiser
state) and returns their results: :mod:`~contrafl.execution.executor` (sequential),
:mod:`~contrafl.execution.parallel` (processes), :mod:`~contrafl.execution.vectorized`
(clients stacked under ``vmap``, CUDA graphs on a GPU). :class:`~contrafl.execution.
clients.LocalClients` makes the jobs of the clients of a process and their outcomes;
:mod:`~contrafl.execution.distributed` spreads a round's clients over ranks, each
serving its share with a ``LocalClients`` of its own. Nothing here imports the round
loop (:mod:`contrafl.engine`), which drives these parts.
"""
