"""Resilience: what keeps a run going, or ends it cleanly.

  restart       the run directory a restarted run resumes from, and its failure record
  elastic       re-formation under torchrun --nnodes MIN:MAX (data shrinks, batch kept)
  replicas, replica_launch   replica groups over data that survive a group's loss (torchft);
                the lighthouse and one restart loop per group
  replica_sync  groups on slow links: synchronised every sync_every steps (LocalSGD, DiLoCo)
  watchdog, stop, policies, faults   hangs; stop signals; non-finite steps, bad samples, out of
                memory; injected faults for tests and drills

Imports: what train's other modules may (no Trainer: the policies get the values they use).
"""
