"""Resilience: restarts, the hang watchdog, failure policies, stop signals, fault injection."""
