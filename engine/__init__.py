"""Eddy's engine: checkpoints, export/compile (torch, only when building) and the IREE runtime."""
