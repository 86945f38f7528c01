from setuptools import find_packages, setup

setup(
    name="tessera",
    version="0.1.0",
    description="Tensor x data parallel (ZeRO-1) training of decoder LLMs with per-module precision",
    packages=find_packages(include=["tessera", "tessera.*"]),
    python_requires=">=3.10",
    # torchrun whose failure ends with tessera's error line (docs/tools.md, "Launching with tessera-run")
    entry_points={"console_scripts": ["tessera-run = tessera.run:cli"]},
    install_requires=[
        "torch>=2.4",
        "numpy",
        "einops",
        "tqdm",
        "tensorboard",
        "safetensors",
    ],
    extras_require={
        # fused CUDA attention kernels; without it tessera uses torch's SDPA kernels (logged once)
        "flash": ["flash-attn"],
        # Hugging Face tokenizer.json support in tools/prepare_data.py
        "tokenizers": ["tokenizers"],
        # corpus readers of tools/prepare_data.py: Parquet and save_to_disk folders, .jsonl.zst
        "parquet": ["pyarrow"],
        "zstd": ["zstandard"],
        # SentencePiece .model tokenizers (InternLM, Llama 2, Mistral)
        "sentencepiece": ["sentencepiece"],
        # Hugging Face export / import round-trip checks
        "hf": ["transformers", "tokenizers"],
        # heat maps of the precision telemetry (tools/precision_telemetry.py)
        "plots": ["matplotlib"],
        # Weights & Biases logging (metrics.wandb); its tests skip without it
        "wandb": ["wandb"],
        # lm-evaluation-harness on a checkpoint (tools/evaluate.py); 0.4.9 does not import beside transformers 5
        "eval": ["lm-eval>=0.4.13"],
        # torchao: the independent reference the block-format quantizers are checked against, bit for bit
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "transformers", "tokenizers", "matplotlib", "pyarrow",
                 "zstandard", "sentencepiece", "torchao==0.18.0"],
    },
)
