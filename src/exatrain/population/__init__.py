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

The driver that runs the trainers and holds the tournaments is `exatrain.train.population`.
"""
