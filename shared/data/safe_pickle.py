"""A restricted unpickler for dataset files (MNIST pickle, CIFAR-10 batches).

Unpickling runs whatever callable a pickle names, so a planted dataset file is code execution.
These files only ever need numpy's array reconstruction, so everything outside a small allow-list
is refused before it is imported or called.
"""

from __future__ import annotations

import codecs
import importlib
import io
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from shared.data.errors import UnsafePickleError


def _numpy_core(sub: str) -> Any:
    """numpy's private core module ``sub`` under its numpy 2 name, or the numpy 1 one."""
    try:
        return importlib.import_module(f"numpy._core.{sub}")
    except ImportError:  # numpy < 2
        return importlib.import_module(f"numpy.core.{sub}")


def _latin1_encode(obj: str, encoding: str = "utf-8") -> bytes:
    """Stand-in for ``_codecs.encode``: Python 3 writes bytes at protocol 2 as encode(str, 'latin1')."""
    try:
        latin1 = isinstance(obj, str) and codecs.lookup(encoding).name == "iso8859-1"
    except (LookupError, TypeError):
        latin1 = False
    if not latin1:
        raise UnsafePickleError(f"_codecs.encode is only allowed for latin-1 text, got {encoding!r}")
    return obj.encode("latin-1")


def _allowed_globals() -> dict[tuple[str, str], Any]:
    multiarray = _numpy_core("multiarray")
    numeric = _numpy_core("numeric")
    allowed: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): _latin1_encode,
    }
    # The same functions are recorded under numpy 1 ("numpy.core") and numpy 2 ("numpy._core") names.
    for prefix in ("numpy.core", "numpy._core"):
        allowed[(f"{prefix}.multiarray", "_reconstruct")] = multiarray._reconstruct
        allowed[(f"{prefix}.multiarray", "scalar")] = multiarray.scalar
        allowed[(f"{prefix}.numeric", "_frombuffer")] = numeric._frombuffer
    return allowed


class Readable(Protocol):
    """What :class:`pickle.Unpickler` reads from (files, ``GzipFile``, ``BytesIO``)."""

    def read(self, n: int, /) -> bytes: ...

    def readline(self) -> bytes: ...


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only allow-listed globals (numpy array reconstruction)."""

    _allowed: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        if RestrictedUnpickler._allowed is None:
            RestrictedUnpickler._allowed = _allowed_globals()
        try:
            return RestrictedUnpickler._allowed[(module, name)]
        except KeyError:
            raise UnsafePickleError(
                f"refusing to unpickle global {module}.{name}: dataset pickles may only contain "
                "dicts, lists, strings, bytes, numbers and numpy arrays"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError("refusing a pickle with persistent ids")


def safe_load(fh: Readable, *, encoding: Literal["bytes", "latin1", "ASCII"] = "bytes") -> Any:
    """Unpickle ``fh`` with the allow-list.

    ``encoding`` applies to Python 2 ``str`` objects: ``"bytes"`` keeps them as bytes (CIFAR's
    ``b"data"`` keys), ``"latin1"`` is what numpy arrays pickled by Python 2 need.
    """
    unpickler = RestrictedUnpickler(fh, encoding=encoding)
    result = unpickler.load()
    _reject_object_arrays(result)
    return result


def safe_loads(data: bytes, *, encoding: Literal["bytes", "latin1", "ASCII"] = "bytes") -> Any:
    """:func:`safe_load` for an in-memory pickle."""
    return safe_load(io.BytesIO(data), encoding=encoding)


def safe_load_path(
    path: str | Path,
    *,
    encoding: Literal["bytes", "latin1", "ASCII"] = "bytes",
    opener: Callable[[Path], Readable] | None = None,
) -> Any:
    """Open ``path`` (with ``opener``, e.g. gzip, if given) and unpickle it with the allow-list."""
    p = Path(path)
    if opener is None:
        with p.open("rb") as fh:
            return safe_load(fh, encoding=encoding)
    return safe_load(opener(p), encoding=encoding)


def _reject_object_arrays(obj: Any, depth: int = 0) -> None:
    """Datasets are numeric; an object array means the file is not what it claims to be."""
    if depth > 8:
        return
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise UnsafePickleError("refusing a numpy array of Python objects in a dataset pickle")
    elif isinstance(obj, dict):
        for v in obj.values():
            _reject_object_arrays(v, depth + 1)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _reject_object_arrays(v, depth + 1)
