"""Finding, checking and reading checkpoints of the families in engine/arch.py (GGUF files, Hugging Face
folders, tiny random models). One module per job:

  source       resolving a spec to a checked ModelSource (built-in names, .gguf, HF folders; pickles refused)
  gguf         GGUF headers, config and weights
  hf           config.json and safetensors
  tiny         tiny-random[-<family>] test models from transformers' config classes
  chat         tokenizer.json + chat.json for the runtime
  fingerprint  content hashes, memoised on disk
  weights      read_config / open_tensors (one tensor at a time) / load_state_dict over all of them

torch and transformers are imported lazily inside the few functions that build tensors or tokenizers: a warm
start (resolve, read_config, fingerprint) must stay light.
"""
from .chat import save_tokenizer
from .source import DEFAULT_MODEL, ModelSource, resolve_model
from .tiny import TINY_RANDOM
from .weights import CheckpointTensors, load_state_dict, open_tensors, read_config

__all__ = [
    "DEFAULT_MODEL",
    "TINY_RANDOM",
    "ModelSource",
    "resolve_model",
    "read_config",
    "load_state_dict",
    "open_tensors",
    "CheckpointTensors",
    "save_tokenizer",
]
