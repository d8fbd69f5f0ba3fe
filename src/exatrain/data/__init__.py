"""Data sets: generic HDF5 / NumPy arrays, and each workload's readers and generators."""

from .arrays import HDF5Dataset, NumpyDataset
from .reads import ReadCounter

__all__ = ["HDF5Dataset", "NumpyDataset", "ReadCounter"]
