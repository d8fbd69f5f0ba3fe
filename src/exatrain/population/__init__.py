"""Population training on the `trainer` axis: K trainers, each its own job on its own data
partition, meeting every `population.interval` steps for a tournament.

  options.py    the [population] config section
  partition.py  disjoint training partitions and each trainer's held-out tournament set
  pairing.py    who meets whom: random pairwise exchange, truncation selection, regularized
                evolution (pure functions of a shared seed: every rank computes the same answer
                without communicating)
  exchange.py   point-to-point model transfer between corresponding ranks of two trainers
  hparams.py    a trainer's hyperparameters, applied to its optimizer and model, and mutation
  plot.py       every trainer's validation curve with the exchanges marked
  member.py     one trainer's tournaments, composed into its Trainer (`PopulationMember`)
  run.py        the driver: builds every rank's trainer, runs the population, writes its report

`options.py` sits below `exatrain.train` (train's config reads the [population] section); the rest
sits above it, and `exatrain.train.run` (the run entry point) above them all.
"""
