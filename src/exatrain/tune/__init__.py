"""The planner and the tuner: predict every Plan's memory and step time, dry-run one rank of a
large job in one process, measure this machine, and tune by measuring few Plans.

  spec.py       ModelSpec: parameters, FLOPs and activation bytes of a model (FakeTensorMode trace)
  systems.py    System: device rates and links, from TOML files in systems/
  layout.py     Options, and what one rank does under a Plan: groups, samples, parameter shapes
  traffic.py    every collective of a step under a Plan: bytes and calls per axis (ledger's terms)
  overheads.py  fixed costs per operator, collective call and FSDP2 unit
  chanfilt.py   cost terms of channel/filter-parallel convolutions
  cost.py       predict(spec, plan, system, options): memory per rank, step time, bytes per axis
  search.py     every Plan of N ranks, ranked, or refused with the reason
  dryrun.py     one rank of an N-rank job over torch's fake process group
  calibrate.py  measures this machine into a system file
  devicefit.py  `exatrain plan --calibrate-from`: the planner beside a device's measured steps
  measure.py    a few training steps of a Plan on spawned ranks
  user.py       et.plans: every Plan's memory and step time for a user's own model
  tuner.py      measure few Plans, Gaussian-process surrogate on the cost model's residuals
  commands.py   `exatrain plan` and `exatrain tune`

Imports: every layer below tune (train, observe, parallel, ...; tests/test_import_graph.py);
nothing of exatrain's public API, bench or cli.
"""
