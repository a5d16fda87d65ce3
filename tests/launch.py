"""Test-side names for :mod:`lightning_sync.launch` (torchrun-like local processes)."""

from lightning_sync.launch import free_port, launch_local

run_external = launch_local

__all__ = ["free_port", "run_external"]
