"""Data sets: generic HDF5 / NumPy arrays, each workload's readers and generators, and the input
path.

  arrays.py          HDF5Dataset, NumpyDataset: generic (x, y) files
  reads.py           ReadCounter: what a data set read, over the process and its workers
  loader.py          the input path: one loader for all epochs, prefetch, copy ahead, decode
  batches.py         a worker's batch handed over in shared memory (collate, packed, BufferRing)
  stage.py           staging a data set to node-local storage
  cosmoflow.py       CosmoFlow: targets, reader, on-device decoder
  cosmoflow_synth.py CosmoFlow: the synthetic density cubes and write_cosmoflow
  deepcam.py         DeepCAM: HDF5 layout, channels, statistics, reader, on-device decoder
  deepcam_synth.py   DeepCAM: the synthetic atmospheric state and its labels
  deepcam_write.py   DeepCAM: write_deepcam, a data set with its statistics
  forecast.py        ForecastDataset: (x_t, x_{t+lead}) pairs of shallow-water trajectories
  forecast_synth.py  the rotating shallow-water solver and write_forecast
  graph.py           graphs for node classification: generator and reader
  qm9.py             QM9 molecules
  catalysis.py       adsorbates on metal surfaces relaxed with EMT: positions, forces
  text.py            an offline text corpus and a byte-level tokenizer
  writers.py         `exatrain data NAME --out DIR`

Imports: only the layers below data (foundations, comm, launch, mesh; tests/test_import_graph.py),
today errors and comm; nothing of parallel or above.
"""

from .arrays import HDF5Dataset, NumpyDataset
from .reads import ReadCounter

__all__ = ["HDF5Dataset", "NumpyDataset", "ReadCounter"]
