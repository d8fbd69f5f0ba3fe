"""Launching: recognise the job's launcher, or spawn local ranks."""

from .env import LaunchEnv, LaunchError, detect, expand_nodelist
from .local import spawn

__all__ = ["LaunchEnv", "LaunchError", "detect", "expand_nodelist", "spawn"]
