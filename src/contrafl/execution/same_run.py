"""That every rank of a distributed run trains the same run.

Under ``torchrun`` each process builds its run from its own command line and its own
``data_dir``: one machine started with another seed, another learning rate, other data
files or another contrafl would train its share of every round on something else, and
the run would end with results that no configuration computes. So each worker sends
rank 0 its :func:`identity` when it joins, and rank 0 compares it with its own
(:func:`disagreement`) before round 1: a difference in what determines the results ends
the run on every rank with one line naming it; other versions of torch or Python,
which change results at float tolerance only, are a warning.
"""

from __future__ import annotations

import hashlib
import platform
import socket
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .. import __version__
from ..config import differences, fingerprint
from ..errors import ContraflError

if TYPE_CHECKING:
    from ..data.base import ArrayDataset
    from ..data.partition import Partition
    from .context import Setup


class Refused(ContraflError):
    """Rank 0 refused a rank that does not train the same run: its reason, sent to every
    rank, each of which ends with it."""


def data_digest(train: ArrayDataset, partition: Partition) -> str:
    """SHA-256 of the training split's samples and labels and of every client's rows:
    equal where the ranks' clients train on the same samples."""
    h = hashlib.sha256()
    for t in (train.x, train.y):
        h.update(str((tuple(t.shape), t.dtype)).encode())
        h.update(memoryview(t.detach().cpu().contiguous().numpy()).cast("B"))
    for rows in partition.train + (partition.test or []):
        h.update(np.ascontiguousarray(rows, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()


def identity(setup: Setup) -> dict[str, Any]:
    """What this process trains, for :func:`disagreement`: its settings (their
    :func:`~contrafl.config.fingerprint` and the resolved configuration), the
    :func:`data_digest`, contrafl's, torch's and Python's versions, and where it runs."""
    cfg = setup.config
    return {
        "host": socket.gethostname(),
        "config": cfg.to_dict(),
        "fingerprint": fingerprint(cfg),
        "data": data_digest(setup.data.train, setup.partition),
        "data_dir": cfg.data_dir,
        "contrafl": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def disagreement(rank: int, ours: dict[str, Any], theirs: dict[str, Any]) -> tuple[str | None, str | None]:
    """``(error, warning)`` for rank ``rank``, whose :func:`identity` is ``theirs``,
    against rank 0's ``ours``: the error names the first difference in what determines
    the results (contrafl's version, the settings, the training data), the warning other
    versions of torch or Python; None where there is none."""
    who = f"rank {rank} (on {theirs['host']})"
    error = None
    if theirs["contrafl"] != ours["contrafl"]:
        error = f"{who} runs contrafl {theirs['contrafl']} and rank 0 contrafl {ours['contrafl']}; install the same contrafl on every machine"
    elif theirs["fingerprint"] != ours["fingerprint"]:
        changed = ", ".join(differences(ours["config"], theirs["config"])) or "the file of the user's model"
        error = (
            f"{who} was started with other settings than rank 0 (rank 0 -> rank {rank}: {changed}); run the same "
            "`contrafl run` command on every machine, setting explicitly what `auto` resolves by machine (precision)"
        )
    elif theirs["data"] != ours["data"]:
        error = (
            f"{who} has other training data in data_dir={theirs['data_dir']} than rank 0 in data_dir={ours['data_dir']}; "
            "every machine's data_dir must hold the same files"
        )
    versions = [f"{name} {theirs[name]} (rank 0: {ours[name]})" for name in ("torch", "python") if theirs[name] != ours[name]]
    warning = (
        f"{who} runs {' and '.join(versions)}: the run is reproducible bit for bit only with the same versions on every rank"
        if versions else None
    )
    return error, warning
