"""Embedded default corpora for the example scripts and benchmarks (no network needed).

See :mod:`hf_gpa.data.stdlib_corpus` for the corpus definition, the train/validation split and the tokenizer.
"""

from .stdlib_corpus import (
    EOS_TOKEN,
    MAX_FILE_BYTES,
    SPLITS,
    VALIDATION_PERCENTAGE,
    corpus_fingerprint,
    default_cache_dir,
    get_default_tokenizer,
    load_stdlib_texts,
    stdlib_root,
    stdlib_source_files,
)

__all__ = [
    "EOS_TOKEN",
    "MAX_FILE_BYTES",
    "SPLITS",
    "VALIDATION_PERCENTAGE",
    "corpus_fingerprint",
    "default_cache_dir",
    "get_default_tokenizer",
    "load_stdlib_texts",
    "stdlib_root",
    "stdlib_source_files",
]
