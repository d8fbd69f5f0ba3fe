"""The optimizers: how the tensors a strategy left behind are stepped.

  factory.py    the optimizer of `[optim]` (AdamW, Adam, SGD, or K-FAC's first-order base) built
                over the tensors the model's optimizer must step (ZeRO-1/2: the rank's shards,
                with the post-step all-gather wired); the fused/foreach/for-loop kernel choice,
                the gradient-layout fix the fused kernels need, whether a step is skipped on
                the device (`found_inf`)
  schedule.py   the learning-rate schedule: warm-up, decay, large-batch scaling
  gradnorm.py   the global gradient norm under any layout, clipping by it, the finiteness check
  kfac*.py      distributed K-FAC (KAISA): settings and plan checks (kfac_settings), factor
                statistics (kfac_factors), the assignment of layers and factors to ranks
                (kfac_assign), the preconditioner itself (kfac)

Layer: above `parallel` (K-FAC reads the spatial layers and the split branches; the factory
wires ZeRO's shards), below `workloads` and `train`. It imports comm, mesh, errors and parallel,
never workloads, train or anything above; the Trainer, the planner's measurements and the
benchmarks call it.
"""
