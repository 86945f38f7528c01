"""Data pipeline: corpus readers, tokenizers, memory-mapped token folders, packing, a resumable DP sampler.

The trainer calls :func:`build_data`; ``tools/prepare_data.py`` makes token folders.
"""

from tessera.data.errors import DataError
from tessera.data.loader import Batch, DataBundle, TrainLoader, ValidLoader, build_data
from tessera.data.packing import IGNORE_INDEX, PackedRows
from tessera.data.prepare import prepare_corpus
from tessera.data.readers import Document, iter_documents, list_input_files
from tessera.data.sampler import GlobalRowSampler
from tessera.data.stdlib_corpus import prepare_stdlib_corpus, stdlib_files
from tessera.data.synthetic import SyntheticStream
from tessera.data.token_file import TokenFileWriter, TokenShard, open_token_folder
from tessera.data.tokenizer import ByteTokenizer, HFTokenizer, SentencePieceTokenizer, build_tokenizer, load_tokenizer

__all__ = [
    "Batch", "ByteTokenizer", "DataBundle", "DataError", "Document", "GlobalRowSampler", "HFTokenizer",
    "IGNORE_INDEX", "PackedRows", "SentencePieceTokenizer", "SyntheticStream", "TokenFileWriter", "TokenShard",
    "TrainLoader", "ValidLoader", "build_data", "build_tokenizer", "iter_documents", "list_input_files",
    "load_tokenizer", "open_token_folder", "prepare_corpus", "prepare_stdlib_corpus", "stdlib_files",
]
