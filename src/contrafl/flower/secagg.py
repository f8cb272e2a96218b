"""Secure aggregation on Flower: the server learns only the weighted mean of the clients'
updates, through Flower's SecAgg+ (flwr 1.41's ``SecAggPlusWorkflow`` and
``secaggplus_mod``).

flwr 1.41 runs SecAgg+ for its legacy message flow: the workflow asks a ``Strategy`` for
each node's ``FitIns``, runs the protocol's four stages (setup, share keys, collect
masked vectors, unmask) over the grid, and hands the strategy every client's ``FitRes``
with its parameters replaced by the unmasked ``sum_i n_i p_i / sum_i n_i`` (``n_i`` its
``num_examples``). The client's mod answers the first two stages itself and, in the
third, calls the ClientApp and masks the float arrays of its ``FitRes``.

contrafl fits its round into that flow:

- the server wraps each client's train message (the request :class:`GridTransport`
  would send, :mod:`contrafl.flower.wire`-packed) into a ``FitIns`` config value,
  with the seed of the client's stochastic rounding (:func:`request_fitins`);
- the client's ClientApp answers as for a plain train message and splits its reply
  (:func:`reply_fitres`): the payload's float arrays go to SecAgg+ as the ``FitRes``
  parameters, weighted by the reply's ``num_samples``; everything else (the structure,
  integer tensors, the loss and steps, the straggler record) travels as a packed
  metric, in the clear;
- the server rebuilds each client's reply with the mean in place of its own float
  arrays (:func:`outcome_from`): the algorithm's sample-weighted average of equal
  payloads is that mean, so ``aggregate`` gives the plain deployment's model up to the
  protocol's quantisation (each value clipped to +-``CLIPPING_RANGE``, rounded
  stochastically to ``2 * CLIPPING_RANGE / QUANTIZATION_RANGE``).

The stochastic rounding draws from numpy's global generator, which the client seeds
from ``(seed, "secagg", round, client)`` before the mod quantises: the masks cancel
exactly, so a run is reproducible. Algorithms whose server needs more than this
weighted mean refuse (:func:`refusal`).
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Callable
from typing import Any

import numpy as np

from . import require_flwr

require_flwr()
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict  # noqa: E402
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays  # noqa: E402
from flwr.compat.common import recorddict_compat as compat  # noqa: E402

from .wire import pack, unpack  # noqa: E402

#: Every float value a client sends is clipped to +-CLIPPING_RANGE (SecAgg+'s default is 8).
CLIPPING_RANGE = 8.0
#: Quantisation levels over [-CLIPPING_RANGE, CLIPPING_RANGE] (SecAgg+'s default, 2**22).
QUANTIZATION_RANGE = 2**22
#: The share of a client's key shares that rebuild it: up to a third of the round's clients
#: may drop out during the protocol and the others' mean is still unmasked.
RECONSTRUCTION = 2 / 3
REQUEST = "contrafl-request"
ROUNDING_SEED = "contrafl-rounding-seed"
REST = "contrafl-rest"
SECURE = "contrafl-secure"
_FLOATS = ("float16", "float32", "float64")


def refusal(algo_cls: type, algo_params: Any, cfg: Any) -> str | None:
    """Why a run cannot use secure aggregation, or None: its algorithm's server must need
    only the sample-weighted mean of the replies (``Algorithm.beyond_weighted_mean``), and
    its settings nothing of single updates."""
    why = algo_cls.beyond_weighted_mean(algo_params)
    if why is not None:
        return why
    if cfg.dp.name == "central":
        return "dp=central clips each update at the server, which secure aggregation hides from it (dp=local adds the noise on the clients)"
    if cfg.round_deadline is not None:
        return "a straggler dropped at round_deadline sends no update for SecAgg+ to mask"
    return None


# -- client ----------------------------------------------------------------------------------
def is_secure_request(content: RecordDict) -> bool:
    """Whether a train message's content is a SecAgg+ collect stage's ``FitIns`` made by
    :func:`request_fitins`."""
    return "fitins.config" in content.config_records and REQUEST in content.config_records["fitins.config"]


def unwrap_request(content: RecordDict) -> tuple[RecordDict, int]:
    """The plain train request inside a secure ``FitIns``, and the rounding seed."""
    config = content.config_records["fitins.config"]
    return unpack(bytes(config[REQUEST])), int(config[ROUNDING_SEED])


def reply_fitres(reply: RecordDict, rounding_seed: int) -> RecordDict:
    """A client's plain train reply as the ``FitRes`` SecAgg+ masks: the payload's float
    arrays as parameters (weight: the reply's ``num_samples``), the rest packed in the
    metrics. Seeds numpy's global generator for the mod's stochastic rounding."""
    arrays = reply["arrays"]
    secure = [name for name, a in arrays.items() if name.startswith("payload/") and a.dtype in _FLOATS]
    rest = RecordDict({
        "arrays": ArrayRecord({name: a for name, a in arrays.items() if name not in secure}, keep_input=False),
        "tree": reply["tree"],
    })
    tree = json.loads(str(reply["tree"]["json"]))
    num_samples = next(node["value"] for key, node in tree["dict"] if key == "num_samples")
    fitres = FitRes(
        Status(Code.OK, ""),
        ndarrays_to_parameters([arrays[name].numpy() for name in secure]),
        int(num_samples),
        {REST: pack(rest), SECURE: json.dumps([[name, arrays[name].dtype] for name in secure])},
    )
    np.random.seed(rounding_seed % 2**32)
    return compat.fitres_to_recorddict(fitres, keep_input=True)


def secure_mod(msg: Message, context: Any, call_next: Callable) -> Message:
    """A ClientApp mod: Flower's ``secaggplus_mod`` for the messages of a SecAgg+
    workflow, the others straight through."""
    from flwr.app import MessageType
    from flwr.client.mod import secaggplus_mod
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    if msg.metadata.message_type == MessageType.TRAIN and RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


# -- server ----------------------------------------------------------------------------------
def request_fitins(request: RecordDict, rounding_seed: int) -> FitIns:
    """The ``FitIns`` carrying a client's train request (see the module docstring)."""
    return FitIns(Parameters([], ""), {REQUEST: pack(request), ROUNDING_SEED: rounding_seed})


def outcome_tree(fitres: FitRes) -> RecordDict:
    """A client's reply rebuilt from its ``FitRes`` after unmasking: its own structure and
    clear entries, with the mean in place of its float arrays (cast back to their dtypes)."""
    rest = unpack(bytes(fitres.metrics[REST]))
    names = json.loads(str(fitres.metrics[SECURE]))
    mean = parameters_to_ndarrays(fitres.parameters)
    arrays = dict(rest["arrays"].items())
    arrays.update({name: Array(np.ascontiguousarray(m.astype(dtype))) for (name, dtype), m in zip(names, mean, strict=True)})
    return RecordDict({"arrays": ArrayRecord(arrays, keep_input=False), "tree": rest["tree"]})


class SecureRound:
    """One round of SecAgg+ over ``grid`` for the nodes ``node_of`` of contrafl's clients,
    with ``fitins`` for each client: the unmasked replies ``{cid: RecordDict}`` (empty
    when the protocol could not finish: fewer than its threshold of clients answered)."""

    def __init__(self, grid: Any, context: Any, timeout: float, max_weight: float) -> None:
        self.grid, self.context, self.timeout, self.max_weight = grid, context, timeout, max_weight

    def run(self, t: int, node_of: dict[int, int], fitins: dict[int, FitIns]) -> tuple[dict[int, RecordDict], list[str]]:
        results, failures = self.exchange(t, node_of, fitins)
        return {cid: outcome_tree(fitres) for cid, fitres in results.items()}, failures

    def exchange(self, t: int, node_of: dict[int, int], fitins: dict[int, FitIns]) -> tuple[dict[int, FitRes], list[str]]:
        """The protocol itself: each client's ``FitRes`` with the unmasked weighted mean
        as its parameters (none when it could not finish), and the failures."""
        from flwr.server import ServerConfig
        from flwr.server.client_manager import SimpleClientManager
        from flwr.server.compat.grid_client_proxy import GridClientProxy
        from flwr.server.compat.legacy_context import LegacyContext
        from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key

        cid_of = {node: cid for cid, node in node_of.items()}
        proxies = {node: GridClientProxy(node, self.grid, self.context.run_id) for node in cid_of}
        strategy = _OneRound([(proxies[node_of[cid]], fitins[cid]) for cid in sorted(fitins)])
        manager = SimpleClientManager()
        for proxy in proxies.values():
            manager.register(proxy)
        legacy = LegacyContext(self.context, ServerConfig(num_rounds=t + 1), strategy, manager)
        legacy.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({Key.CURRENT_ROUND: t + 1})
        legacy.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
        workflow = _drop_tolerant_workflow()(  # every client shares its keys with all; 2/3 of the shares rebuild them
            num_shares=1.0, reconstruction_threshold=RECONSTRUCTION, max_weight=self.max_weight,
            clipping_range=CLIPPING_RANGE, quantization_range=QUANTIZATION_RANGE, timeout=self.timeout,
        )
        state = random.getstate()
        try:
            random.seed(t)  # the workflow shuffles the nodes with Python's generator
            workflow(self.grid, legacy)
        finally:
            random.setstate(state)
        return {cid_of[proxy.node_id]: fitres for proxy, fitres in strategy.results}, [str(f) for f in strategy.failures]


@functools.cache
def _drop_tolerant_workflow() -> type:
    """flwr's ``SecAggPlusWorkflow``, made to survive nodes that drop out before they
    have shared their keys (the class is made on the first call, not at import: the
    ClientApp imports this module, and ``flwr.server`` is the server's).

    flwr 1.41, and its later releases, count every node of the setup stage that sends
    no masked vector as dead in the unmask stage, and ask the others for the shares of
    its secret key. A node that stopped answering in the setup or share-keys stage
    never sent those shares: each other node's mod then fails looking for one
    (``KeyError`` in ``sk1_share_dict``), and the server would remove pairwise masks
    that nobody added, since the other nodes mask only with the nodes whose shares they
    received. So, once the keys are shared, the nodes that shared them become the
    round's sampled nodes and each one's only neighbours; a node dropping later is
    unmasked as flwr does it.
    """
    from flwr.server.workflow import SecAggPlusWorkflow

    class DropTolerantSecAggPlus(SecAggPlusWorkflow):
        def share_keys_stage(self, grid: Any, context: Any, state: Any) -> bool:
            super().share_keys_stage(grid, context, state)
            shared = set(state.active_node_ids)
            state.sampled_node_ids = shared
            state.nid_to_neighbours = {nid: nbrs & shared for nid, nbrs in state.nid_to_neighbours.items() if nid in shared}
            return self._check_threshold(state)

    return DropTolerantSecAggPlus


class _OneRound:
    """The legacy ``Strategy`` the workflow drives: the round's ``FitIns`` as given, and
    the unmasked results kept."""

    def __init__(self, instructions: list[tuple[Any, FitIns]]) -> None:
        self.instructions = instructions
        self.results: list[tuple[Any, FitRes]] = []
        self.failures: list[Any] = []

    def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> list[tuple[Any, FitIns]]:
        return self.instructions

    def aggregate_fit(self, server_round: int, results: list, failures: list) -> tuple[None, dict]:
        self.results, self.failures = list(results), list(failures)
        return None, {}
