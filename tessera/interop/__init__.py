"""Interoperability: Hugging Face Llama export/import, offline checkpoint layout conversion, inference loading.

Everything here runs in one process without a process group and streams checkpoints one tensor at a
time (``safetensors_io``), so it scales to 7B checkpoints on a workstation:

- ``ckpt_io``: read a tessera checkpoint of any TP layout tensor by tensor; write step folders and meta.json;
- ``convert``: change the TP x DP layout (model + optimizer shards), consolidate to one fp32 file;
- ``hf``: tessera <-> Hugging Face ``LlamaForCausalLM`` names, configs, export and import;
- ``tokenizers``: which tokenizer a run used, and HF tokenizer files for it;
- ``inference``: a TP=1 model from any checkpoint (used by ``tools/generate.py``).

The command-line front ends are ``tools/export_hf.py``, ``tools/import_hf.py``,
``tools/convert_checkpoint.py`` and ``tools/generate.py``.
"""
