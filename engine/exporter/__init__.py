"""The exporter: the exportable model, its kernels and quantised weights, turbine export + iree-compile, and the
build's child processes. Modules here may import torch, but only inside the functions that build: the parent side
of a build (engine/exporter/process.py) stays torch-free."""
