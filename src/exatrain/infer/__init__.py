"""Inference: run a trained model over a data set under any Plan and write the outputs
(`exatrain predict`, `et.predict`). Above train: it rebuilds the run's workload and layout through
the composition root (train.job) and reads the run's checkpoints."""
