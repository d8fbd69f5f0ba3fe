"""The planner and the tuner: predict every Plan's memory and step time, dry-run one rank of a
large job in one process, measure this machine, and tune by measuring few Plans.

  spec.py       ModelSpec: parameters, FLOPs and activation bytes of a model (FakeTensorMode trace)
  systems.py    System: device rates and links, from TOML files in systems/
  cost.py       predict(spec, plan, system, options): memory per rank, step time, bytes per axis
  search.py     every Plan of N ranks, ranked, or refused with the reason
  dryrun.py     one rank of an N-rank job over torch's fake process group
  calibrate.py  measures this machine into a system file
  user.py       et.plans: every Plan's memory and step time for a user's own model
  tuner.py      measure few Plans, Gaussian-process surrogate on the cost model's residuals
"""
