"""An offline, real text corpus and a byte-level tokenizer for language-model tests.

Every machine that runs exatrain has a Python installation, and therefore the
standard library's ``.py`` sources: tens of megabytes of real, human-written
text that needs no download. :func:`write_text_corpus` turns them into the
nanoGPT-style on-disk format (``train.bin`` / ``val.bin`` raw token arrays plus
``meta.json``), and :class:`TokenDataset` reads such a file back through a
``numpy.memmap`` as ``(x, y)`` next-token pairs.

The corpus is deterministic for a given Python installation (files sorted by
path, fixed separator); ``meta.json`` records the Python version, file count and
a SHA-256 of the token stream so that two machines can check they trained on the
same bytes. Different Python versions or distributions (some ship the stdlib
without its ``test`` package) give different corpora.

Example::

    meta = write_text_corpus("data/pystdlib", max_bytes=2_000_000)
    ds = TokenDataset("data/pystdlib/train.bin", block_size=256)
    x, y = ds[0]          # int64 tensors of length 256, y[i] == x[i + 1]
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sysconfig
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import DataError, MissingFileError

__all__ = [
    "ByteTokenizer",
    "stdlib_source_files",
    "write_text_corpus",
    "TokenDataset",
    "FILE_SEPARATOR",
]

# Written before each file's contents. Naming the file gives the model (and a
# human reading a decoded sample) a visible document boundary.
FILE_SEPARATOR = "\n\n# ==== {path} ====\n\n"

# Directories under the stdlib path that are not the standard library itself:
# third-party packages differ from machine to machine and would make the
# corpus non-reproducible; bytecode caches are not text.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


class ByteTokenizer:
    """Tokenizer whose tokens are the UTF-8 bytes of the text (vocabulary 256).

    Lossless for any string; needs no vocabulary file, which keeps the corpus
    and models independent of any download.
    """

    vocab_size: int = 256
    name: str = "byte"

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as a list of ints in ``[0, 256)``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int] | np.ndarray | torch.Tensor) -> str:
        """Turn token ids back into text.

        Invalid UTF-8 (which a sampling model can produce, e.g. half of a
        multi-byte character) is shown as U+FFFD rather than raising.
        """
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().cpu().numpy()
        arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise DataError(
                f"byte token ids must be in [0, 255], got range [{arr.min()}, {arr.max()}]"
            )
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def stdlib_source_files(stdlib_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """The standard library's ``.py`` files, sorted by POSIX relative path.

    Skips ``site-packages``/``dist-packages`` (third-party code), bytecode
    caches, and ``_sysconfigdata*.py`` (generated per build, so it embeds
    machine-specific paths).
    """
    root = Path(stdlib_dir if stdlib_dir is not None else sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise MissingFileError(f"Python standard library directory not found: {root}")
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending into excluded trees.
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for fname in filenames:
            if fname.endswith(".py") and not fname.startswith("_sysconfigdata"):
                path = Path(dirpath) / fname
                found.append((path.relative_to(root).as_posix(), path))
    # Sort on the relative POSIX string, not os.walk order (filesystem dependent).
    found.sort(key=lambda item: item[0])
    return [path for _, path in found]


def _atomic_write_bytes(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` so readers see either the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # Never leave a half-written temp file behind on failure or Ctrl-C.
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_text_corpus(
    out_dir: str | os.PathLike[str],
    max_bytes: int | None = None,
    val_fraction: float = 0.05,
) -> dict[str, Any]:
    """Build the Python-stdlib byte corpus in ``out_dir``.

    The stdlib ``.py`` files (:func:`stdlib_source_files`) are concatenated in
    sorted order, each preceded by :data:`FILE_SEPARATOR`, and byte-tokenized
    (one uint8 token per byte). The first ``1 - val_fraction`` of the stream
    becomes ``train.bin`` and the rest ``val.bin`` (a contiguous split, so no
    validation text leaks into training). Both are raw uint8 arrays that
    ``numpy.memmap`` can open directly. ``meta.json`` is written last, so its
    presence means the corpus is complete; every file is written atomically.

    Args:
        out_dir: directory to create or overwrite the three files in.
        max_bytes: if given, stop after this many tokens in total (reading
            stops early, so small corpora are cheap to build).
        val_fraction: share of tokens for validation, in ``(0, 1)``.

    Returns:
        The metadata dict written to ``meta.json`` plus ``out_dir`` (absolute).
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if max_bytes is not None and max_bytes < 2:
        raise DataError(
            f"max_bytes must be at least 2 (one train and one val token), got {max_bytes}")

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_source_files(stdlib)
    if not files:
        raise MissingFileError(f"no .py files found under the standard library at {stdlib}")

    chunks: list[bytes] = []
    total = 0
    n_files = 0
    for path in files:
        rel = path.relative_to(stdlib).as_posix()
        # Raw bytes, not decoded text: a few stdlib files are deliberately
        # not UTF-8, and the byte tokenizer takes any bytes.
        piece = FILE_SEPARATOR.format(path=rel).encode("utf-8") + path.read_bytes()
        if max_bytes is not None and total + len(piece) > max_bytes:
            piece = piece[: max_bytes - total]
        chunks.append(piece)
        total += len(piece)
        n_files += 1
        if max_bytes is not None and total >= max_bytes:
            break
    data = b"".join(chunks)

    n_val = max(1, int(round(len(data) * val_fraction)))
    n_train = len(data) - n_val
    if n_train < 1:
        raise DataError(
            f"corpus of {len(data)} tokens is too small to split with val_fraction={val_fraction}")

    tok = ByteTokenizer()
    meta: dict[str, Any] = {
        "vocab_size": tok.vocab_size,
        "tokenizer": tok.name,
        "dtype": "uint8",
        "num_tokens": len(data),
        "train_tokens": n_train,
        "val_tokens": n_val,
        "source": "python-stdlib",
        "source_description": "the .py files of the Python standard library, sorted by path",
        "python_version": platform.python_version(),
        "num_files": n_files,
        "separator": FILE_SEPARATOR,
        "max_bytes": max_bytes,
        "val_fraction": val_fraction,
        "sha256": hashlib.sha256(data).hexdigest(),
        "train_file": "train.bin",
        "val_file": "val.bin",
    }

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    view = memoryview(data)  # slices without copying the (possibly ~30 MB) stream
    _atomic_write_bytes(out / "train.bin", view[:n_train])
    _atomic_write_bytes(out / "val.bin", view[n_train:])
    _atomic_write_bytes(out / "meta.json", (json.dumps(meta, indent=2) + "\n").encode("utf-8"))
    return {**meta, "out_dir": str(out.resolve())}


class TokenDataset(Dataset):
    """Next-token pairs from a raw token file, read through ``numpy.memmap``.

    Item ``i`` is ``(x, y)`` with ``x = tokens[i*B : i*B + B]`` and
    ``y = tokens[i*B + 1 : i*B + B + 1]`` (``B = block_size``), both int64
    tensors of length ``B``, so ``y`` is ``x`` shifted by one.

    ``len(ds)`` is the number of non-overlapping blocks, ``(n - 1) // B`` for a
    file of ``n`` tokens: each block needs ``B + 1`` tokens (its target reaches
    one past its end), consecutive blocks start ``B`` apart, and the leftover
    tail is dropped. Items are a pure function of the file and ``i``, so the
    dataset is deterministic; shuffling is the sampler's job.

    The memmap is opened lazily and not pickled, so the dataset is cheap to
    send to ``DataLoader`` worker processes (each opens its own map).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        block_size: int,
        dtype: np.dtype | type = np.uint8,
    ) -> None:
        """
        Args:
            path: a ``train.bin``/``val.bin`` file from :func:`write_text_corpus`.
            block_size: tokens per sample.
            dtype: token dtype in the file (uint8 for the byte corpus).
        """
        self.path = Path(path)
        if not self.path.is_file():
            raise MissingFileError(
                f"token file not found: {self.path}; build the corpus first with "
                f"`exatrain data text --out DIR`"
            )
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.dtype = np.dtype(dtype)
        size = self.path.stat().st_size
        if size % self.dtype.itemsize:
            raise DataError(
                f"{self.path} has {size} bytes, not a multiple of {self.dtype} ({self.dtype.itemsize} bytes)"
            )
        self.num_tokens = size // self.dtype.itemsize
        if block_size + 1 > self.num_tokens:
            raise DataError(
                f"block_size={block_size} is too large for {self.path}: it holds "
                f"{self.num_tokens} tokens and one sample needs block_size + 1 = {block_size + 1}"
            )
        self._data: np.memmap | None = None

    @property
    def data(self) -> np.memmap:
        """The read-only memory map of the whole file (opened on first use)."""
        if self._data is None:
            self._data = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._data

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for TokenDataset of length {n}")
        start = (i % n) * self.block_size
        # np.array copies out of the map (int64 for embedding lookups), so the
        # returned tensors do not pin the mapping or share its read-only memory.
        chunk = torch.from_numpy(np.array(self.data[start : start + self.block_size + 1], dtype=np.int64))
        return chunk[:-1], chunk[1:]

    def __getstate__(self) -> dict[str, Any]:
        # Drop the map: pickling a memmap would copy the whole file into the pickle.
        state = self.__dict__.copy()
        state["_data"] = None
        return state
