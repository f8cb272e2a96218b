"""LG-FedAvg: local representations, a shared global classifier head."""

from __future__ import annotations

from .fedper import SharedPart
from .registry import ALGORITHMS


@ALGORITHMS.register("lg_fedavg")
class LGFedAvg(SharedPart):
    """LG-FedAvg (Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency,
    arXiv 2001.01523, 2020), as PFLlib implements it.

    The model is split into a body ``phi`` (everything but the classifier ``l3``:
    *local*, PFLlib's "local representation") and a head ``h`` (the classifier ``l3``:
    *global*, shared). Round ``t``, client ``i``:

    1. ``h_i <- h^t`` (the received head); ``phi_i`` is the client's own body, starting
       from the client's own initialisation.
    2. Local training of ``(phi_i, h_i)`` jointly on ``CE(h_i(phi_i(x)), y)`` with the
       run's optimiser and ``local_epochs``.
    3. Reply: ``h_i`` only; ``phi_i`` stays on the client.

    Server: ``h^{t+1} = sum_{i in S_t} n_i / (sum_{j in S_t} n_j) * h_i``. The server's
    model stays a full state dict whose body entries keep their initial values (never
    sent, never used). Evaluation (PFLlib, start of a round): the client's own
    ``phi_i`` with the received ``h^{t+1}``.

    The paper's global part is "the top layers" (possibly several); PFLlib, and this
    implementation, share the last linear layer only.
    """

    name = "lg_fedavg"
    summary = "LG-FedAvg: each client keeps its own body; only the classifier head is shared and averaged"
    paper = (
        "Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency, Think Locally, Act Globally: "
        "Federated Learning with Local and Global Representations, arXiv 2001.01523, 2020"
    )
    shared = "head"
