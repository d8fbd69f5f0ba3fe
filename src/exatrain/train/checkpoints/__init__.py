"""Checkpoints: save and resume on any Plan, the manifest that verifies them, export.

  checkpoint    torch.distributed.checkpoint: sharded, atomic, resumable under another Plan
  manifest      what a checkpoint is, and proof its files are the ones written
  export        one unsharded safetensors file of a run's model; a run started from one

Imports: parallel (sharded state), optim, the foundations.
"""
