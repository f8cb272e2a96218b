"""contrafl.flower.codec: messages and replies as Flower RecordDicts, exactly and back."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict  # noqa: E402
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto  # noqa: E402
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # noqa: E402

from contrafl.algorithms.base import Reply, TensorSpec  # noqa: E402
from contrafl.config import load_config  # noqa: E402
from contrafl.engine.comm import payload_bytes, tensor_bytes  # noqa: E402
from contrafl.engine.setup import prepare  # noqa: E402
from contrafl.engine.simulation import Simulation  # noqa: E402
from contrafl.execution.validate import check_reply  # noqa: E402
from contrafl.flower.codec import (  # noqa: E402
    decode,
    decode_metrics,
    encode,
    encode_metrics,
    record_bytes,
    require_flwr,
)
from contrafl.flower.packed import named_arrays, record_of  # noqa: E402

from test_orchestra import tiny_cifar  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def assert_same(got: Any, want: Any, path: str = "") -> None:
    """``got`` equals ``want`` exactly: containers, key types and order, scalar types,
    tensor dtype, shape, device class and bits."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert (got.dtype, got.shape) == (want.dtype, want.shape), path
        assert not got.requires_grad, path
        assert _bits(got) == _bits(want), path
    elif isinstance(want, Mapping):
        assert type(got) is dict, path
        assert [(type(k), k) for k in got] == [(type(k), k) for k in want], path
        for k in want:
            assert_same(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}/{i}")
    else:
        assert type(got) is type(want), path
        assert got == want or (isinstance(want, float) and math.isnan(want) and math.isnan(got)), path


def _bits(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return bytes(t.view(torch.uint8).numpy()) if t.dtype != torch.bool else bytes(t.to(torch.uint8).numpy())


def through_flower(record: RecordDict) -> RecordDict:
    """``record`` through Flower's protobuf serialisation, as bytes and back."""
    wire = recorddict_to_proto(record).SerializeToString()
    proto = ProtoRecordDict()
    proto.ParseFromString(wire)
    return recorddict_from_proto(proto)


# -- every tree the algorithms exchange ----------------------------------------------------
SSL = ["model.projection_hidden=16", "model.projection_dim=8", "knn_k=5"]
ALGORITHMS = {  # overrides; kinds seen in the messages; kinds seen in the replies
    "fedavg": ([], "model", "model"),
    "scaffold": ([], "c model", "delta_c model"),  # control variates shaped like the model
    "fedcrl": (["rounds=2"], "body prototypes", "body prototypes"),  # global {reps, mask}; local {reps, counts}
    "fedproto": (["rounds=2"], "prototypes", "prototypes"),
    "fedgh": ([], "head", "prototypes"),
    "fedpac": (["rounds=2"], "body head prototypes", "body head prototypes stats"),  # per-client head; {V: 0-d, h}
    "fedssc": (["rounds=2"], "class_reps model", "class_reps model"),  # {reps [m, d] (m may be 0), mask bool}
    "fedamp": (["rounds=2"], "cloud init", "model"),  # per-client messages
    "fedrep": ([], "body", "body"),
    "solo": ([], "", ""),  # empty message and reply
    "fedbyol": ([*SSL, "algorithm.share_target=true"], "model target", "model target"),
    "fedu2": ([*SSL, "algorithm.predictor_hidden=16"], "model target", "model target"),
    "orchestra": (
        [*SSL, "augment=simclr", "algorithm.global_clusters=6", "algorithm.local_clusters=3", "algorithm.memory=8"],
        "centroids model", "local_centroids model",
    ),
}


def exchanged(algorithm: str, overrides: list[str], tmp_path) -> tuple[Any, list[tuple[dict, Reply]]]:
    """Run a tiny federation and return its algorithm and every (message, reply) pair."""
    settings = ["num_clients=2", "rounds=1", "local_epochs=1", "batch_size=8", "executor=sequential",
                "eval_personal=false", f"algorithm={algorithm}", *tiny_cifar(tmp_path, rows=16, test_rows=4), *overrides]
    sim = Simulation(prepare(load_config(None, settings)), None, None)
    algo, pairs, messages = sim.algorithm, [], {}
    message_for, client_end = algo.message_for, algo.client_end

    def recording_message_for(message, server, cid, round):
        messages[cid] = message_for(message, server, cid, round)
        return messages[cid]

    def recording_client_end(task, result, state, ctx):
        reply, new_state = client_end(task, result, state, ctx)
        pairs.append((messages[ctx.cid], reply))
        return reply, new_state

    algo.message_for, algo.client_end = recording_message_for, recording_client_end
    sim.run()
    return algo, pairs


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_algorithm_messages_and_replies_round_trip(algorithm, tmp_path):
    overrides, message_kinds, reply_kinds = ALGORITHMS[algorithm]
    algo, pairs = exchanged(algorithm, overrides, tmp_path)
    assert sorted({k for m, _ in pairs for k in m}) == message_kinds.split()
    assert sorted({k for _, r in pairs for k in r.payload}) == reply_kinds.split()
    for message, reply in pairs:
        sent = decode(through_flower(encode(message)))
        assert_same(sent, message)
        assert algo.reply_spec(sent) == algo.reply_spec(message)
        payload = decode(through_flower(encode(reply.payload)))
        assert_same(payload, reply.payload)
        spec = algo.reply_spec(message)
        assert check_reply(Reply(reply.cid, reply.num_samples, payload), spec) == check_reply(reply, spec) is None
        metrics = decode_metrics(through_flower(RecordDict({"m": encode_metrics(reply.metrics)}))["m"])
        assert metrics == reply.metrics


def test_decoded_reply_fails_validation_like_the_original():
    spec = {"model": {"w": TensorSpec((2,), torch.float32)}}
    bad = Reply(0, 5, {"model": {"w": torch.tensor([1.0, float("nan")])}})
    decoded = Reply(0, 5, decode(encode(bad.payload)))
    assert check_reply(decoded, spec) == check_reply(bad, spec) == "'model.w' has non-finite values (1 NaN, 0 infinite)"


# -- tensors ----------------------------------------------------------------------------------
def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g)
    return {
        "float32": x,
        "float64": x.double(),
        "float16": x.half(),
        "bfloat16": x.bfloat16(),
        "bf16_0d": torch.tensor(-2.5, dtype=torch.bfloat16),
        "float8": x.to(torch.float8_e4m3fn),
        "complex64": torch.complex(x, -x),
        "conj": torch.complex(x, x).conj(),  # conjugate bit set
        "int64": torch.arange(-5, 5),
        "int32": torch.arange(7, dtype=torch.int32),
        "int8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "uint8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": x > 0,
        "0d_int64": torch.tensor(12345678901234),  # BatchNorm's num_batches_tracked
        "0d_float": torch.tensor(3.25),
        "transposed": x.T,
        "strided": x[::2, 1::3],
        "expanded": torch.arange(3.0).expand(4, 3),
        "empty": torch.zeros(0, 256),
        "special": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45]),
        "grad": torch.ones(3, requires_grad=True) * 2,
    }


def test_tensors_are_bit_identical_with_dtype_shape_and_device():
    tree = {"t": tensors()}
    out = decode(through_flower(encode(tree)))
    assert_same(out, tree)
    assert all(v.device.type == "cpu" and v.is_contiguous() for v in out["t"].values())
    assert out["t"]["bfloat16"].dtype == torch.bfloat16 and out["t"]["bf16_0d"].shape == ()


def test_decode_places_tensors_on_the_device():
    out = decode(encode({"m": {"w": torch.ones(2, dtype=torch.bfloat16), "n": torch.tensor(1)}}), device="meta")
    assert {v.device.type for v in out["m"].values()} == {"meta"}
    assert out["m"]["w"].dtype == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_tensors_travel_by_the_cpu_and_come_back():
    tree = {"x": tensors()["bfloat16"].cuda(), "y": tensors()["bool"].cuda()}
    record = encode(tree)
    assert_same(decode(record), tree)
    assert decode(record, device="cuda")["x"].is_cuda


# -- structure ------------------------------------------------------------------------------
def test_int_and_str_keys_order_and_escaped_names():
    t = torch.arange(3.0)
    tree = {
        "class_reps": {7: t, 3: t + 1, "3": t + 2, -1: t + 3, "-1": t + 4},
        "z": {"b": t, "a": t, "10": t, "2": t},
        "odd": {"a/b": t, "a": {"b": -t}, "%2F": t * 3, "": {"": t * 4}, "x%y/": t * 5},
        "": t * 6,
    }
    record = encode(tree)
    out = decode(through_flower(record))
    assert_same(out, tree)
    assert list(out["class_reps"]) == [7, 3, "3", -1, "-1"] and list(out["z"]) == ["b", "a", "10", "2"]
    names = list(named_arrays(record))
    assert len(set(names)) == len(names) == 15
    assert names[:5] == ["class_reps/7", "class_reps/3", "class_reps/%33", "class_reps/-1", "class_reps/%2D1"]
    assert "odd/a%2Fb" in names and "odd/a/b" in names and "odd/%252F" in names


def test_lists_tuples_scalars_and_none():
    tree = {
        "model": {"features.0.weight": torch.ones(2, 2)},
        "nested": [torch.zeros(1), [torch.ones(1), (torch.full((1,), 2.0), {"k": torch.tensor(True)})], []],
        "pair": (1, "two"),
        "scalars": {"i": 2**62, "neg": -3, "f": 0.1, "one": 1.0, "nan": float("nan"), "inf": -float("inf"),
                    "t": True, "f0": False, "s": "text/with/slashes", "none": None},
        "np_float": np.float64(1.5),
        "empty": {},
    }
    out = decode(through_flower(encode(tree)))
    assert_same(out, {**tree, "np_float": 1.5})
    assert type(out["nested"][1][1]) is tuple and out["scalars"]["one"] == 1.0 and type(out["scalars"]["one"]) is float


def test_empty_tree_round_trips():
    assert decode(through_flower(encode({}))) == {}


def test_unsupported_leaves_and_keys_are_one_line_errors_naming_the_path():
    cases = {
        "cannot encode 'model/w' of type object: expected a tensor, dict, list, tuple, int, float, bool, str or None":
            {"model": {"w": object()}},
        "cannot encode 'reps/2/1' of type ndarray: expected a tensor, dict, list, tuple, int, float, bool, str or None":
            {"reps": [0, 1, (None, np.zeros(2))]},
        "cannot encode 'c': key (1, 2) is a tuple, expected str or int": {"c": {(1, 2): torch.ones(1)}},
        "cannot encode 'c': key True is a bool, expected str or int": {"c": {True: torch.ones(1)}},
        "cannot encode 's': torch.sparse_coo tensors are not supported": {"s": torch.eye(2).to_sparse()},
        "cannot encode a list: expected a mapping": [torch.ones(1)],
    }
    for message, tree in cases.items():
        with pytest.raises(ValueError) as info:
            encode(tree)
        assert str(info.value) == message


def test_decode_rejects_records_it_did_not_make():
    good = encode({"m": {"w": torch.ones(2)}})
    tree, packed = good["tree"], good["arrays"]["packed"]
    structure = str(tree["json"])

    def with_layout(layout):
        return RecordDict({"arrays": good["arrays"], "tree": ConfigRecord({**tree, "layout": layout})})

    broken = {
        "not a RecordDict made by contrafl.flower.codec.encode": RecordDict({"arrays": good["arrays"]}),
        "contrafl tree format 1, expected 2": RecordDict({"arrays": good["arrays"], "tree": ConfigRecord({**tree, "format": 1})}),
        "arrays: ['m/w'], expected ['packed']": RecordDict({"arrays": ArrayRecord({"m/w": packed}), "tree": tree}),
        "array 'm/w' of the tree is missing": record_of({}, structure),
        "array 'extra' of the RecordDict is not in its tree": record_of({"m/w": np.ones(2, np.float32), "extra": np.ones(1)}, structure),
        "holds torch.float32, which cannot carry the tree's torch.int64": RecordDict(
            {"arrays": good["arrays"], "tree": ConfigRecord({**tree, "json": structure.replace("float32", "int64")})}),
        "has unknown dtype 'nn'": RecordDict(
            {"arrays": good["arrays"], "tree": ConfigRecord({**tree, "json": structure.replace("float32", "nn")})}),
        "malformed contrafl tree": RecordDict({"arrays": good["arrays"], "tree": ConfigRecord({**tree, "json": "[1"})}),
        "malformed layout of the packed arrays: JSONDecodeError": with_layout("[1"),
        "malformed layout of the packed arrays at array 'm/w' (dtype 'object'": with_layout('[["m/w","object",[2]]]'),
        "malformed layout of the packed arrays at array 'm/w' (dtype 'float32', shape [-2]": with_layout('[["m/w","float32",[-2]]]'),
        "the packed arrays end at byte 8, inside array 'm/w' (bytes 0 to 12)": with_layout('[["m/w","float32",[3]]]'),
        "the packed arrays hold 4 bytes after the last array of their layout": with_layout('[["m/w","float32",[1]]]'),
    }
    for message, record in broken.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            decode(record)


def test_named_arrays_and_record_of_are_inverse_with_any_layout_order():
    arrays = {"b": np.arange(6, dtype=np.int16).reshape(2, 3), "a": np.array(True), "c": np.zeros((0, 4), np.float64)}
    back = named_arrays(record_of(arrays, '{"dict":[]}'))
    assert list(back) == ["b", "a", "c"]
    for name, array in arrays.items():
        assert back[name].dtype == array.dtype and back[name].shape == array.shape and np.array_equal(back[name], array)
        assert back[name].flags.writeable and back[name].flags.aligned
    with pytest.raises(ValueError, match="cannot encode array 'o' of numpy dtype object"):
        record_of({"o": np.array([None])}, "{}")


# -- metrics ----------------------------------------------------------------------------------
def test_metrics_are_coerced_to_plain_ints_and_floats():
    metrics = {
        "loss": torch.tensor(0.25), "acc": np.float32(0.5), "n": np.int64(7), "steps": torch.tensor(3),
        "ok": True, "flag": np.bool_(False), "f": 1.5, "i": 2, "f64": np.float64(2.5), "half": torch.tensor(0.5, dtype=torch.bfloat16),
    }
    record = encode_metrics(metrics)
    assert isinstance(record, MetricRecord)
    out = decode_metrics(through_flower(RecordDict({"metrics": record}))["metrics"])
    want = {"loss": 0.25, "acc": 0.5, "n": 7, "steps": 3, "ok": 1, "flag": 0, "f": 1.5, "i": 2, "f64": 2.5, "half": 0.5}
    assert out == want and list(out) == list(want)
    assert [type(v) for v in out.values()] == [type(v) for v in want.values()]


@pytest.mark.parametrize(
    ("metrics", "message"),
    [
        ({"per_class": [0.1, 0.2]}, "metric 'per_class' is a list, expected an int, float or bool scalar"),
        ({"nested": {"a": 1.0}}, "metric 'nested' is a dict, expected an int, float or bool scalar"),
        ({"vec": torch.ones(2)}, r"metric 'vec' has shape \[2\], expected a scalar"),
        ({"arr": np.ones((1, 1))}, r"metric 'arr' has shape \[1, 1\], expected a scalar"),
        ({"name": "x"}, "metric 'name' is a str, expected an int, float or bool scalar"),
        ({"none": None}, "metric 'none' is a NoneType, expected an int, float or bool scalar"),
        ({3: 1.0}, "metric name 3 is a int, expected str"),
    ],
)
def test_metrics_reject_what_is_not_a_scalar(metrics, message):
    with pytest.raises(ValueError, match=message):
        encode_metrics(metrics)


# -- accounting and packaging -------------------------------------------------------------------
def test_record_bytes_is_payload_bytes_plus_npy_headers_names_and_json():
    payload = {"model": {"w": torch.zeros(3, 4), "n": torch.tensor(2)}, "stats": {"V": torch.tensor(1.0), "h": torch.ones(2, 5, dtype=torch.bfloat16)}}
    record = encode(payload)
    data = sum(payload_bytes(payload).values())
    assert data == tensor_bytes(payload) == 48 + 8 + 4 + 20
    assert list(named_arrays(record)) == ["model/w", "model/n", "stats/V", "stats/h"]
    tree = record["tree"]
    config = len("format") + 8 + len("json") + len(tree["json"]) + len("layout") + len(tree["layout"])
    assert record_bytes(record) == data + 128 + len("packed") + config + len("arrays") + len("tree")
    assert record_bytes(through_flower(record)) == record_bytes(record)


def test_require_flwr_says_how_to_install_flower(monkeypatch):
    require_flwr()
    monkeypatch.setitem(sys.modules, "flwr", None)
    with pytest.raises(ImportError, match=r'pip install "contrafl\[flower\]"'):
        require_flwr()


def test_importing_the_package_does_not_import_flwr():
    code = "import sys, contrafl.flower; assert 'flwr' not in sys.modules, 'flwr imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
