"""FedRep: a shared representation, personal heads, trained head first then body."""

from __future__ import annotations

from dataclasses import dataclass

from .. import params as P
from .base import Phase, Stage
from .fedper import FedPer
from .registry import ALGORITHMS


@dataclass(frozen=True)
class FedRepParams:
    head_epochs: int = P.param(
        1,
        P.Interval(1, None),
        "local epochs of the head (body frozen) before the run's local_epochs of the body "
        "(PFLlib's plocal_epochs: 1; the FedRep paper uses 10)",
    )


@ALGORITHMS.register("fedrep")
class FedRep(FedPer):
    """FedRep (Collins, Hassani, Mokhtari, Shakkottai, ICML 2021).

    Body ``phi`` (everything but the classifier ``l3``, shared) and head ``h`` (``l3``,
    personal), as in FedPer. Round ``t``, client ``i``, starting from
    ``phi_i = phi^t`` (received) and its own head ``h_i`` (its own initialisation at
    first):

    1. head phase, ``head_epochs`` epochs, body frozen, per batch::

           h_i <- h_i - eta * grad_h CE(h_i(phi^t(x)), y)

    2. body phase, the run's ``local_epochs``, head frozen (the ``h_i`` of step 1)::

           phi_i <- phi_i - eta * grad_phi CE(h_i(phi_i(x)), y)

       (``eta``/SGD stands for the run's optimiser; each phase has its own optimiser
       state, as PFLlib's two optimisers.)
    3. Reply: ``phi_i`` only; ``h_i`` stays on the client.

    Server: ``phi^{t+1} = sum_{i in S_t} n_i / (sum_{j in S_t} n_j) * phi_i``. Evaluation
    (PFLlib, start of a round): the received ``phi^{t+1}`` with the client's own head.
    The batches of the two phases are drawn one after the other from the client's
    stream of the round. Train-mode forwards of the head phase update the body's
    BatchNorm statistics (the body is frozen, not in eval mode, as in PFLlib).
    """

    name = "fedrep"
    summary = "FedRep: share the body; per round train the own head (body frozen), then the body (head frozen)"
    paper = "Collins, Hassani, Mokhtari, Shakkottai, Exploiting Shared Representations for Personalized Federated Learning, ICML 2021"
    Params = FedRepParams

    def phases(self, round: int) -> list[Phase]:
        return [
            Phase((Stage(self.local_loss, trains=("head",)),), epochs=self.params.head_epochs, name="head"),
            Phase((Stage(self.local_loss, trains=("body",)),), epochs=None, name="body"),
        ]
