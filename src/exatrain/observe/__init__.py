"""What a run records and shows, in one home: the step observer and its meters (step times,
memory, CPU peak, host reads, the bandwidth watch), the console, the summary's fields and units,
targets, the trackers (TensorBoard beside W&B and MLflow), the MLPerf log, the `[observe]`
options; reading a finished run back (report, figures, timeline); preflight and start-up
counts. Below train: the Trainer uses the meters, so nothing here imports the run; what is
needed of it (a mesh, a config) is passed in."""
