"""The export half: checkpoints, the exportable model, turbine export + iree-compile, the build child process
and the artefact cache. Modules here may import torch, but only inside the functions that build: resolving a
model and finding a warm cache entry stay torch-free."""
