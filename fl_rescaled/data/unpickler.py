"""A restricted unpickler: rebuilds plain numpy arrays and refuses every other global."""

from __future__ import annotations

import io
import pickle

import numpy as np

try:  # numpy >= 2: the real module; numpy.core is a warning shim
    from numpy._core import multiarray as _multiarray
except ImportError:  # numpy 1.x
    from numpy.core import multiarray as _multiarray  # type: ignore[no-redef]

_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that can rebuild plain numpy arrays and nothing else.

    Only ``numpy.core.multiarray._reconstruct`` (or its numpy-2 home
    ``numpy._core.multiarray._reconstruct``), ``numpy.ndarray`` and
    ``numpy.dtype`` are resolved; every other global is refused with
    :class:`pickle.UnpicklingError` before anything is imported or called.
    """

    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(
                f"refused global {module}.{name}: only numpy array reconstruction is allowed"
            )
        if name == "_reconstruct":
            return _multiarray._reconstruct
        if name == "ndarray":
            return np.ndarray
        return np.dtype


def restricted_loads(data: bytes):
    """Unpickle ``data`` with :class:`RestrictedUnpickler` (latin1 for Python 2 pickles)."""
    return RestrictedUnpickler(io.BytesIO(data), encoding="latin1").load()
