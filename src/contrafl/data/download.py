"""Official sources of the datasets: checksums, download and extraction.

:data:`SOURCES` describes each downloadable dataset: the official archives (the URLs and md5
published by the dataset authors and used by torchvision) and the files the loaders read,
with their official md5, size in bytes and number of samples. :func:`matches` compares a
file with its official md5; :func:`download` fetches, checks and unpacks the archives.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import sys
import tarfile
import time
import urllib.request
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from ..errors import ConfigError, DataError
from .formats import index_tiny_imagenet

__all__ = [
    "OfficialFile",
    "Archive",
    "ImageTree",
    "Source",
    "SOURCES",
    "EMNIST_ROWS",
    "file_md5",
    "present",
    "matches",
    "source",
    "tree_counts",
    "locate",
    "download",
]


@dataclass(frozen=True)
class OfficialFile:
    """A file of an official release, at ``path`` inside the dataset folder.

    Attributes:
        md5: official checksum; ``None`` when the release publishes none for the file
            (Tiny-ImageNet's files: only its archive has one).
        size: official size in bytes, when known.
        rows: number of samples in the official file.
        uncompressed: the same file gunzipped, accepted in its place (MNIST's
            ``train-images-idx3-ubyte`` for ``train-images-idx3-ubyte.gz``).
    """

    path: str
    md5: str | None
    size: int | None = None
    rows: int | None = None
    uncompressed: OfficialFile | None = None


@dataclass(frozen=True)
class Archive:
    """An official download, fetched from the first of ``urls`` that works.

    With ``unpack`` its members under ``<dataset folder name>/`` are extracted into the dataset
    folder and the archive is kept in ``data_dir``; otherwise the archive is itself a data file
    and is stored in the dataset folder (MNIST's ``.gz`` files, EMNIST's ``gzip.zip``).
    """

    filename: str
    md5: str
    urls: tuple[str, ...]
    unpack: bool = True


@dataclass(frozen=True)
class ImageTree:
    """Counts of a class-folder release without per-file checksums (Tiny-ImageNet)."""

    classes: int
    train: int
    test: int


@dataclass(frozen=True)
class Source:
    """Where a dataset comes from and what its official files are.

    Attributes:
        folder: name of the dataset folder under ``data_dir``.
        archives: the official downloads.
        files: the files the loader reads, checked against their official md5.
        aliases: other folders under ``data_dir`` that may hold the files (torchvision's).
        tree: official counts of an image tree, checked in place of per-file checksums.
    """

    folder: str
    archives: tuple[Archive, ...]
    files: tuple[OfficialFile, ...]
    aliases: tuple[str, ...] = ()
    tree: ImageTree | None = None

    def file(self, path: str) -> OfficialFile:
        return next(f for f in self.files if f.path == path)


def _cifar(folder: str, archive: Archive, files: list[tuple[str, str, int | None, int | None]]) -> Source:
    return Source(folder, (archive,), tuple(OfficialFile(*f) for f in files))


def _idx(
    folder: str,
    mirrors: tuple[str, ...],
    files: list[tuple[str, str, int, str, int, int]],
    aliases: tuple[str, ...],
) -> Source:
    """An IDX release: four ``.gz`` files, each an archive of its own, read in place (or
    gunzipped by the user)."""
    official = tuple(
        OfficialFile(f"{name}.gz", gz_md5, gz_size, rows, OfficialFile(name, raw_md5, raw_size, rows))
        for name, gz_md5, gz_size, raw_md5, raw_size, rows in files
    )
    archives = tuple(
        Archive(f.path, f.md5, tuple(m + f.path for m in mirrors), unpack=False) for f in official
    )
    return Source(folder, archives, official, aliases)


# IDX releases, one row per file: name, .gz md5, .gz bytes, gunzipped md5, gunzipped bytes, samples.
# fmt: off
_MNIST_FILES = [
    ("train-images-idx3-ubyte", "f68b3c2dcbeaaa9fbdd348bbdeb94873", 9_912_422,
     "6bbc9ace898e44ae57da46a324031adb", 47_040_016, 60_000),
    ("train-labels-idx1-ubyte", "d53e105ee54ea40749a09fcbcd1e9432", 28_881,
     "a25bea736e30d166cdddb491f175f624", 60_008, 60_000),
    ("t10k-images-idx3-ubyte", "9fb629c4189551a2d022fa330f9573f3", 1_648_877,
     "2646ac647ad5339dbf082846283269ea", 7_840_016, 10_000),
    ("t10k-labels-idx1-ubyte", "ec29112dd5afa0611ce80d1b7f02629c", 4_542,
     "27ae3e4e09519cfbb04c329615203637", 10_008, 10_000),
]
_FMNIST_FILES = [
    ("train-images-idx3-ubyte", "8d4fb7e6c68d591d4c3dfef9ec88bf0d", 26_421_880,
     "f4a8712d7a061bf5bd6d2ca38dc4d50a", 47_040_016, 60_000),
    ("train-labels-idx1-ubyte", "25c81989df183df01b3e8a0aad5dffbe", 29_515,
     "9018921c3c673c538a1fc5bad174d6f9", 60_008, 60_000),
    ("t10k-images-idx3-ubyte", "bef4ecab320f06d8554ea6380940ec79", 4_422_102,
     "8181f5470baa50b63fa0f6fddb340f0a", 7_840_016, 10_000),
    ("t10k-labels-idx1-ubyte", "bb300cfdad3c16e7a12a480ee83cd310", 5_148,
     "15d484375f8d13e6eb1aabb0c3f46965", 10_008, 10_000),
]
# fmt: on

SOURCES: dict[str, Source] = {
    # https://www.cs.toronto.edu/~kriz/cifar.html (archive md5); file md5 as in torchvision's
    # datasets/cifar.py (CIFAR10.train_list/test_list/meta); sizes of the official files.
    "cifar10": _cifar(
        "cifar-10-batches-py",
        Archive(
            "cifar-10-python.tar.gz",
            "c58f30108f718f92721af3b95e74349a",
            ("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",),
        ),
        [
            ("data_batch_1", "c99cafc152244af753f735de768cd75f", 31_035_704, 10_000),
            ("data_batch_2", "d4bba439e000b95fd0a9bffe97cbabec", 31_035_320, 10_000),
            ("data_batch_3", "54ebc095f3ab1f0389bbae665268c751", 31_035_999, 10_000),
            ("data_batch_4", "634d18415352ddfa80567beed471001a", 31_035_696, 10_000),
            ("data_batch_5", "482c414d41f54cd18b22e5b47cb7c3cb", 31_035_623, 10_000),
            ("test_batch", "40351d587109b95175f43aff81a1287e", 31_035_526, 10_000),
            ("batches.meta", "5ff9c542aee3614f3951f8cda6e48888", 158, None),
        ],
    ),
    # torchvision's datasets/cifar.py (CIFAR100); the file sizes are not published there.
    "cifar100": _cifar(
        "cifar-100-python",
        Archive(
            "cifar-100-python.tar.gz",
            "eb9058c3a382ffc7106e4002c42a8d85",
            ("https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",),
        ),
        [
            ("train", "16019d7e3df5f24257cddd939b257f8d", None, 50_000),
            ("test", "f0ef6b0ae62326f3e7ffdfab6717acfc", None, 10_000),
            ("meta", "7973b15100ade9c7d40fb424638fde48", None, None),
        ],
    ),
    # .gz md5: torchvision's datasets/mnist.py (MNIST.resources, mirrors in this order);
    # md5 of the gunzipped files as listed by several independent checkers of the release.
    "mnist": _idx(
        "mnist",
        ("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/"),
        _MNIST_FILES,
        aliases=("MNIST/raw",),
    ),
    # torchvision's datasets/mnist.py (FashionMNIST.resources); gunzipped md5 as in MindSpore's
    # FashionMnist (raw_data) and the zalandoresearch/fashion-mnist release.
    "fmnist": _idx(
        "fashion-mnist",
        ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
        _FMNIST_FILES,
        aliases=("FashionMNIST/raw",),
    ),
    # torchvision's datasets/mnist.py (EMNIST.url/md5). NIST publishes a checksum for gzip.zip
    # only, so the loader reads the balanced split from the verified archive itself.
    "emnist": Source(
        "emnist",
        (
            Archive(
                "gzip.zip",
                "58c8d27c78d21e728a6bc7b3cc06412e",
                (
                    "https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip",
                    "https://www.itl.nist.gov/iaui/vip/cs_links/EMNIST/gzip.zip",
                ),
                unpack=False,
            ),
        ),
        (OfficialFile("gzip.zip", "58c8d27c78d21e728a6bc7b3cc06412e", 561_753_746),),
        aliases=("EMNIST/raw",),
    ),
    # http://cs231n.stanford.edu/tiny-imagenet-200.zip, md5 as used by Avalanche and other
    # Tiny-ImageNet loaders. The extracted files have no published checksums: the loader
    # checks the tree against the official counts (200 classes x 500 + 10,000 val images).
    "tinyimagenet": Source(
        "tiny-imagenet-200",
        (
            Archive(
                "tiny-imagenet-200.zip",
                "90528d7ca1a48142e341f4ef8d21d0de",
                ("http://cs231n.stanford.edu/tiny-imagenet-200.zip",),
            ),
        ),
        (
            OfficialFile("wnids.txt", None),
            OfficialFile("words.txt", None),
            OfficialFile("val/val_annotations.txt", None),
        ),
        tree=ImageTree(classes=200, train=100_000, test=10_000),
    ),
}

EMNIST_ROWS = {"train": 112_800, "test": 18_800}
"""Samples of EMNIST balanced (Cohen et al., 2017, Table II)."""


_md5_cache: dict[tuple[str, int, int, int], str] = {}


def file_md5(path: Path) -> str:
    """md5 of a file, computed once per ``(path, inode, size, mtime)`` in this process."""
    st = path.stat()
    key = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _md5_cache:
        digest = hashlib.md5()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
        _md5_cache[key] = digest.hexdigest()
    return _md5_cache[key]


def present(folder: Path, official: OfficialFile) -> OfficialFile | None:
    """The form of ``official`` found in ``folder`` (compressed first), or ``None``."""
    for form in (official, official.uncompressed):
        if form is not None and (folder / form.path).is_file():
            return form
    return None


def matches(path: Path, official: OfficialFile) -> bool:
    """Whether ``path`` is the official file (always, when no checksum is published)."""
    return official.md5 is None or file_md5(path) == official.md5


def source(name: str) -> Source:
    try:
        return SOURCES[name]
    except KeyError:
        raise ConfigError(
            f"dataset '{name}' has no official files to download; expected one of: {', '.join(SOURCES)}"
        ) from None


def locate(name: str, data_dir: Path) -> Path:
    """The folder holding ``name``'s files: ``data_dir`` itself, ``data_dir/<folder>`` or a
    torchvision-style alias, whichever holds one of the official files; else the folder
    :func:`download` fills (``data_dir`` when it is named like the dataset folder)."""
    src = source(name)
    data_dir = Path(data_dir)
    for candidate in (data_dir, *(data_dir / sub for sub in (src.folder, *src.aliases))):
        if any(present(candidate, f) for f in src.files):
            return candidate
    return data_dir if data_dir.name == src.folder else data_dir / src.folder


def tree_counts(folder: Path) -> ImageTree:
    index = index_tiny_imagenet(folder)
    return ImageTree(len(index.wnids), len(index.train), len(index.test))


def _complete(src: Source, folder: Path) -> bool:
    """Whether ``folder`` holds the official release."""
    for official in src.files:
        form = present(folder, official)
        if form is None or not matches(folder / form.path, form):
            return False
    if src.tree is None:
        return True
    try:
        return tree_counts(folder) == src.tree
    except DataError:
        return False


def download(name: str, data_dir: Path) -> Path:
    """Fetch ``name``'s official archives into ``data_dir``, check their md5, unpack them and
    check the files; returns the dataset folder.

    Idempotent: nothing is fetched when the folder already holds the verified release, and an
    archive already on disk with the official md5 is not fetched again.
    """
    src = source(name)
    data_dir = Path(data_dir)
    folder = locate(name, data_dir)
    if _complete(src, folder):
        print(f"{name}: {folder} already holds the verified official files", file=sys.stderr)
        return folder
    for archive in src.archives:
        target = (data_dir if archive.unpack else folder) / archive.filename
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_file() and file_md5(target) == archive.md5:
            print(f"{name}: using the verified {target}", file=sys.stderr)
        else:
            _fetch(archive, target)
        if archive.unpack:
            print(f"{name}: extracting {target} into {folder}", file=sys.stderr)
            _unpack(target, src.folder, folder)
    if not _complete(src, folder):
        raise DataError(
            f"{folder} does not hold the official {name} files after unpacking the verified archives; "
            f"delete {folder} and rerun `contrafl data download {name} --data-dir {data_dir}`"
        )
    print(f"{name}: verified the official files in {folder}", file=sys.stderr)
    return folder


def _fetch(archive: Archive, target: Path) -> None:
    """Download ``archive`` to ``target`` from the first mirror that serves the official file."""
    part = target.with_name(target.name + ".part")
    failures = []
    for url in archive.urls:
        try:
            _stream(url, part)
        except (OSError, http.client.HTTPException) as exc:  # URLError and timeouts are OSErrors
            failures.append(f"{url}: {getattr(exc, 'reason', None) or exc}")
            part.unlink(missing_ok=True)
            continue
        digest = file_md5(part)
        if digest == archive.md5:
            os.replace(part, target)
            return
        failures.append(f"{url} served a file with md5 {digest}, the official md5 is {archive.md5}")
        part.unlink()
    raise DataError(
        f"could not download {archive.filename} ({'; '.join(failures)}); "
        f"download it manually from {archive.urls[0]} into {target.parent} and rerun"
    )


def _stream(url: str, path: Path) -> None:
    """Copy ``url`` to ``path``, showing progress on stderr."""
    print(f"downloading {url}", file=sys.stderr)
    with urllib.request.urlopen(url, timeout=60) as response, open(path, "wb") as out:
        total = int(response.headers.get("Content-Length") or 0)
        done, shown = 0, 0.0
        while chunk := response.read(1 << 20):
            out.write(chunk)
            done += len(chunk)
            if time.monotonic() - shown > 0.5:
                shown = time.monotonic()
                of = f" of {total / 2**20:.1f}" if total else ""
                print(f"\r  {done / 2**20:.1f}{of} MiB", end="", file=sys.stderr, flush=True)
        print(f"\r  {done / 2**20:.1f} MiB done", file=sys.stderr)


def _members(archive: Path, prefix: str) -> Iterator[tuple[PurePosixPath, IO[bytes]]]:
    """``(path relative to prefix, stream)`` of the regular files under ``prefix/`` of a
    ``.zip`` or ``.tar.gz`` archive."""

    def relative(name: str) -> PurePosixPath | None:
        parts = PurePosixPath(name).parts
        if len(parts) < 2 or parts[0] != prefix:
            return None
        if any(p in ("..", "") for p in parts[1:]):
            raise DataError(f"{archive} has a member {name} outside its folder; delete it and rerun")
        return PurePosixPath(*parts[1:])

    if archive.suffix == ".zip":
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                rel = None if info.is_dir() else relative(info.filename)
                if rel is not None:
                    with zf.open(info) as stream:
                        yield rel, stream
    else:
        with tarfile.open(archive) as tar:
            for member in tar:
                rel = relative(member.name) if member.isfile() else None
                if rel is not None:
                    yield rel, tar.extractfile(member)


def _unpack(archive: Path, prefix: str, folder: Path) -> None:
    """Extract the files under ``prefix/`` of ``archive`` into ``folder``.

    Files are written to a staging folder first and moved into place once all are out, so an
    interrupted extraction never leaves a half-written file in the dataset folder.
    """
    staging = folder.with_name(f".{folder.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        for rel, stream in _members(archive, prefix):
            target = staging.joinpath(*rel.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as out:
                shutil.copyfileobj(stream, out)
        if not staging.exists():
            raise DataError(f"{archive} holds no files under {prefix}/; delete it and rerun")
        if not folder.exists():
            staging.rename(folder)
            return
        for path in sorted(p for p in staging.rglob("*") if p.is_file()):
            target = folder / path.relative_to(staging)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
    except (OSError, EOFError, zlib.error, tarfile.TarError, zipfile.BadZipFile) as exc:
        raise DataError(
            f"could not extract {archive} into {folder} ({exc}); free space or fix permissions and rerun"
        ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
