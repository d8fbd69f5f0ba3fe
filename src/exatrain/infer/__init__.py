"""Inference: run a trained model over a data set under any Plan and write the outputs
(`exatrain predict`, `et.predict`).

  predict       the prediction loop, its outputs in HDF5, and its refusals (PredictError)

Imports: everything up to train (it rebuilds the run's workload and layout through the
composition root, train.job, and reads the run's checkpoints); nothing above.
"""
