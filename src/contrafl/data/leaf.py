"""``dataset=leaf``: a dataset in LEAF's JSON format (TalwalkarLab/leaf), e.g. FEMNIST.

LEAF's ``preprocess.sh ... -t sample`` writes ``data/<name>/data/train/*.json`` and
``.../test/*.json``; each file is ``{"users": [...], "num_samples": [...], "user_data":
{user: {"x": [...], "y": [...]}}}`` (optionally ``"hierarchies"``), FEMNIST's ``x`` being
lists of 784 floats in ``[0, 1]`` (28 x 28 pixels) and ``y`` integers ``0..61``. Give
``data_dir`` the folder holding ``train`` and ``test``.

Users are the clients (``partition=natural``), in the order of the ``users`` lists of the
training files (files in natural order of their names), named by their ids; a user's test
samples are its own test data. ``x`` becomes ``float32`` feature vectors, or float images
``[C, H, W]`` with ``dataset.shape`` (``[1,28,28]`` for FEMNIST). Labels are the classes
``0..max`` when integers, else the sorted names found.

The folder is checked whole, as LEAF's sample split writes it: every user has training
and test samples, in one training and one test file. A missing test folder, a user without
test data (or a test user without training data, as a user split, ``-t user``, gives), a
user listed twice in a split or without samples: a one-line error naming the file and the
user. The users are counted from the files' ``users`` lists alone (:func:`leaf_clients`,
which reads no sample where the list comes first, as LEAF writes it), so that
``partition=natural`` and ``num_clients`` need not be given.

LEAF's text datasets (Shakespeare, Sent140) and CelebA (whose ``x`` are file names) hold
no numeric vectors and are refused with a one-line error.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import params as P
from ..errors import ConfigError, DataError
from .arrays import as_samples, label_indices
from .base import FederatedDataset
from .registry import DATASETS, DatasetSpec, LoadRequest
from .user import CommonOptions, Part, assemble, check_memory, natural_key

__all__ = ["LeafOptions", "leaf_clients", "load_leaf"]

LAYOUT = "LEAF's layout: ROOT/train/*.json and ROOT/test/*.json (preprocess.sh ... -t sample)"
USERS_FIRST = re.compile(r'\s*\{\s*"users"\s*:\s*')
"""The head of a LEAF file whose first key is ``users``, as LEAF writes it."""


@dataclass(frozen=True)
class Shape:
    """Check: ``[C, H, W]``, ``[H, W]`` or ``[D]``, positive."""

    def __call__(self, value) -> bool:
        return len(value) in (1, 2, 3) and all(v >= 1 for v in value)

    def __str__(self) -> str:
        return "[C,H,W], [H,W] or [D] with positive sizes"


@dataclass(frozen=True)
class LeafOptions(CommonOptions):
    """Options of ``dataset=leaf``."""

    shape: list[int] | None = P.param(
        None, Shape(),
        "each sample's x as float images [C,H,W] ([H,W]: one channel), e.g. [1,28,28] for FEMNIST, or vectors [D] (auto: vectors)",
    )


def _read(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise DataError(f"{path} is not readable JSON ({' '.join(str(exc).split())}); generate it again with LEAF") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("users"), list) or not isinstance(doc.get("user_data"), dict):
        raise DataError(f"{path} is not a LEAF data file: it needs 'users' (a list) and 'user_data' (a dict); {LAYOUT}")
    counts = doc.get("num_samples")
    if counts is not None and (not isinstance(counts, list) or len(counts) != len(doc["users"])):
        raise DataError(f"{path}: 'num_samples' does not give one count per user; generate it again with LEAF")
    return doc


def _sample_shape(shape: list[int]) -> list[int]:
    """The shape of a sample for ``dataset.shape``: ``[H, W]`` is one channel."""
    return [1, *shape] if len(shape) == 2 else list(shape)


def _user(doc: dict, i: int, path: Path, shape: list[int] | None) -> tuple[str, np.ndarray, np.ndarray]:
    """User ``i`` of a LEAF file: its id, samples and raw labels."""
    user = doc["users"][i]
    data = doc["user_data"].get(user)
    source = f"{path} (user {user})"
    if not isinstance(data, dict) or not isinstance(data.get("x"), list) or not isinstance(data.get("y"), list):
        raise DataError(f"{source}: 'user_data' has no 'x' and 'y' lists for this user; generate it again with LEAF")
    xs, ys = data["x"], data["y"]
    if len(xs) != len(ys):
        raise DataError(f"{source}: {len(xs)} samples but {len(ys)} labels; give one label per sample")
    counts = doc.get("num_samples")
    if counts is not None and counts[i] != len(ys):
        raise DataError(f"{source}: num_samples says {counts[i]} but the user has {len(ys)} samples; generate it again with LEAF")
    if xs and not (isinstance(xs[0], list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in xs[0])):
        raise DataError(
            f"{source}: x holds {type(xs[0]).__name__} samples, not vectors of numbers (LEAF's text datasets and CelebA's "
            "image file names are not read); give numeric vectors such as FEMNIST's"
        )
    try:
        x = np.asarray(xs, dtype=np.float32).reshape(len(xs), -1) if xs else np.zeros((0, 0), np.float32)
    except (ValueError, TypeError) as exc:
        raise DataError(f"{source}: x is not a list of vectors of one length ({' '.join(str(exc).split())})") from None
    if shape is not None and len(xs):
        if x.shape[1] != math.prod(shape):
            raise DataError(
                f"{source}: samples of {x.shape[1]} values do not fit dataset.shape={list(shape)} ({math.prod(shape)} values); "
                "set dataset.shape to the samples' shape"
            )
        x = x.reshape(len(x), *_sample_shape(shape))
    bad = next((v for v in ys if isinstance(v, bool) or not isinstance(v, (int, str, float)) or (isinstance(v, float) and not v.is_integer())), None)
    if bad is not None:
        raise DataError(f"{source}: label {bad!r} is not an integer or a class name; give integer labels or names")
    y = np.asarray([str(v) for v in ys] if any(isinstance(v, str) for v in ys) else [int(v) for v in ys])
    return str(user), as_samples(x, source, "nchw") if len(xs) else x, y


def _files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.glob("*.json") if not p.name.startswith(".")), key=lambda p: natural_key(p.name))


def _listed_users(path: Path) -> list[str]:
    """The ``users`` list of a LEAF file, read from the file's head without parsing its
    samples where the list comes first, as LEAF writes it (``split_data.py``); the whole
    file is parsed where it does not."""
    decoder = json.JSONDecoder()
    try:
        with open(path, encoding="utf-8") as f:
            head, size = "", 1 << 16
            while chunk := f.read(size):
                head, size = head + chunk, 2 * size
                start = USERS_FIRST.match(head)
                if start is None:
                    break
                try:
                    users = decoder.raw_decode(head, start.end())[0]
                except ValueError:  # the list goes on past the head read so far
                    continue
                if not isinstance(users, list):
                    break
                return [str(user) for user in users]
    except (OSError, UnicodeDecodeError):
        pass  # _read names the problem
    return [str(user) for user in _read(path)["users"]]


def _user_files(root: Path) -> dict[str, dict[str, Path]]:
    """Each user's training and test file (``{user: {"train": path, "test": path}}``), in
    the order of the training files' ``users`` lists, the folder checked whole by those
    lists alone: a one-line :class:`DataError` for a missing train or test folder, a user
    listed twice in a split, a test user without training data or a user without test
    data (LEAF's ``-t sample`` split gives every user both)."""
    train_files, test_files = _files(root / "train"), _files(root / "test")
    if not train_files:
        raise DataError(f"{root / 'train'} holds no .json files; give data_dir the folder of LEAF's train and test folders ({LAYOUT})")
    if not test_files:
        raise DataError(
            f"{root / 'test'} holds no .json files, but LEAF writes every user's test samples there beside {root / 'train'}; "
            f"copy the test folder too ({LAYOUT})"
        )
    users: dict[str, dict[str, Path]] = {}
    for split, files in (("train", train_files), ("test", test_files)):
        for path in files:
            for user in _listed_users(path):
                if split == "test" and user not in users:
                    raise DataError(
                        f"{path}: test user {user!r} has no training data (LEAF's user split, -t user, gives test users of their own, "
                        "which federated clients cannot hold); split by sample (-t sample)"
                    )
                if split in users.setdefault(user, {}):
                    raise DataError(f"{path}: user {user!r} appears twice in the {split} files (also {users[user][split]}); keep one")
                users[user][split] = path
    if not users:
        raise DataError(f"the files of {root / 'train'} list no users; give data_dir the folder of LEAF's train and test folders ({LAYOUT})")
    missing = next((user for user, files in users.items() if "test" not in files), None)
    if missing is not None:
        raise DataError(
            f"{users[missing]['train']}: user {missing!r} has no test samples in {root / 'test'}, but LEAF's sample split "
            "(-t sample) gives every user test samples; copy all of the test files, or generate the split again"
        )
    return users


def leaf_clients(req: LoadRequest) -> list[str]:
    """The users of the LEAF folder ``req.data_dir``, the clients, from the files' ``users``
    lists (the folder checked whole by them, no sample parsed where LEAF wrote the lists
    first)."""
    if req.data_dir is None:
        raise ConfigError(f"dataset leaf needs data_dir=DIR, the folder of LEAF's train and test folders ({LAYOUT})")
    return list(_user_files(Path(req.data_dir)))


def load_leaf(req: LoadRequest) -> FederatedDataset:
    """The LEAF dataset at ``req.data_dir`` (see the module docstring)."""
    options = req.options if isinstance(req.options, LeafOptions) else LeafOptions()
    if req.data_dir is None:
        raise ConfigError(f"dataset leaf needs data_dir=DIR, the folder of LEAF's train and test folders ({LAYOUT})")
    root = Path(req.data_dir)
    users = _user_files(root)
    samples: dict[str, dict[str, tuple[np.ndarray, np.ndarray, str]]] = {user: {} for user in users}
    nbytes = 0
    for split in ("train", "test"):
        for path in dict.fromkeys(files[split] for files in users.values()):
            doc = _read(path)
            for i in range(len(doc["users"])):
                user, x, y = _user(doc, i, path, options.shape)
                if not len(y):
                    raise DataError(
                        f"{path} (user {user}): no {split} samples, but LEAF's sample split (-t sample) gives every user training "
                        "and test samples; generate the split again, or remove the user from both files"
                    )
                samples[user][split] = (x, y, str(path))
                nbytes += x.nbytes
                check_memory(nbytes, options, f"the users of {root}")
    ys = [y for user in samples.values() for _, y, _ in user.values() if y.size]
    if any(y.dtype.kind == "U" for y in ys):
        names = sorted({str(v) for y in ys for v in y.tolist()}, key=natural_key)
        ys_as = str
    else:
        names = [str(i) for i in range(max((int(y.max()) for y in ys), default=-1) + 1)]
        ys_as = None
    parts = []
    for user, splits in samples.items():
        arrays = {}
        for split in ("train", "test"):
            x, y, path = splits[split]
            y = y.astype(str) if ys_as is str else y
            arrays[split] = (x, label_indices(y, names, f"{path} (user {user})")[0])
        (x_train, y_train), (x_test, y_test) = arrays["train"], arrays["test"]
        parts.append(Part(user, x_train, y_train, x_test, y_test, names, f"{splits['train'][2]} (user {user})"))
    if options.classes is None and ys_as is None:  # integer labels keep their values: classes 0..max
        options = dataclasses.replace(options, classes=names)
    if options.shape is not None:
        options = dataclasses.replace(options, shape=_sample_shape(options.shape))
    return assemble("leaf", parts, options, True, {"folder": str(root), "users": len(parts)})


DATASETS.add(
    "leaf",
    DatasetSpec(
        name="leaf",
        summary="a LEAF dataset such as FEMNIST: data_dir/train/*.json and test/*.json; one client per user (dataset.shape=[1,28,28] for images)",
        load=load_leaf,
        default_model="mlp",
        augment="none",
        ssl_augment=None,
        recommended={"batch_size": 32, "rounds": 20, "local_epochs": 5},
        options=LeafOptions,
        needs_data_dir=True,
        clients=leaf_clients,
    ),
)
