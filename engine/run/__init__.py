"""The runtime half: the compiled module (iree.runtime), the chat session, the tokenizer and sampling.
Nothing under engine/run/ may import torch, transformers or the compiler (tests/test_engine.py checks)."""
