"""Seeing what a run did: figures drawn from a run directory."""
