"""Resilience: restarts, the hang watchdog, failure policies, stop signals, fault injection,
replica groups that survive a group's loss (torchft)."""
