"""tessera: tensor x data parallel (ZeRO-1) training of decoder LLMs with per-module precision."""

__version__ = "0.1.0"
