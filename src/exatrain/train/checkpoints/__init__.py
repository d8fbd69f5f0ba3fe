"""Checkpoints: save and resume (any Plan), the manifest that verifies them, export."""
