"""What a run records and shows, in one home. Below train: the Trainer uses the meters, so
nothing here imports the run; what is needed of it (a mesh, a config, the trainer's values) is
passed in.

While a run trains:
  observer.py          the step observer: metrics.jsonl, TensorBoard, the summary, at log steps
  step_meters.py       step times, loss and gradient norm, kept on the device until a log step
  memory_meters.py     model-state bytes per rank and the peak of a step
  cpu_peak.py          a processor's peak FLOP/s (MFU on a CPU)
  matmul_rate.py       a device's measured matrix-multiply rate (MFU where no peak applies)
  host_reads.py        reads of tensor values into Python on the training thread, counted
  bandwidth.py         bus bandwidth per mesh axis, watched step by step
  target.py            train to a target quality (`train.target`)
  console.py, units.py what rank 0 shows a person, in a person's units
  fields.py            what every figure of summary.json and metrics.jsonl means
  trackers.py          W&B and MLflow beside TensorBoard (tracker_wandb, tracker_mlflow,
                       tracker_records: what every tracker is given)
  mlperf.py            the MLPerf HPC log (RUN_DIR/mlperf.log)
  options.py           the [observe] and [mlperf] config sections
After a run: report.py, figures.py, runs.py (`exatrain report`), timeline.py (a pipeline step).
Before a run: preflight.py, preflight_checks.py (`exatrain preflight`), startup.py (what a
rank's start-up asks of the file system)."""
