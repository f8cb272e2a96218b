"""Client sampling: from the seed (``sampling=seeded``, the default, like MOON's code) or
from the operating system's CSPRNG (``sampling=secret``)."""

from __future__ import annotations

import random
import secrets

from ..rng import derive_seed


def clients_per_round(num_clients: int, fraction: float) -> int:
    """``max(1, int(N * fraction))``, all ``N`` when the fraction is 1."""
    return num_clients if fraction >= 1.0 else max(1, int(num_clients * fraction))


def sample_schedule(num_clients: int, fraction: float, rounds: int, seed: int) -> list[list[int]]:
    """Clients of every round, drawn up front like MOON's ``party_list_rounds``:
    ``random.sample(range(N), clients_per_round(N, fraction))`` per round (all clients
    when the fraction is 1), sorted."""
    if fraction >= 1.0:
        return [list(range(num_clients))] * rounds
    rng = random.Random(derive_seed(seed, "client-sampling"))
    k = clients_per_round(num_clients, fraction)
    return [sorted(rng.sample(range(num_clients), k)) for _ in range(rounds)]


def secret_sample(num_clients: int, fraction: float) -> list[int]:
    """One round's clients for ``sampling=secret``: ``clients_per_round(N, fraction)`` of
    ``range(N)`` without replacement, sorted, drawn from the operating system's CSPRNG
    (``secrets.SystemRandom``), so that nothing in the run's files or seed tells who
    took part."""
    return sorted(secrets.SystemRandom().sample(range(num_clients), clients_per_round(num_clients, fraction)))
