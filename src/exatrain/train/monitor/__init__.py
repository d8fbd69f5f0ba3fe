"""What a run records about itself: the step observer, console, units, memory, MLPerf log, targets."""
