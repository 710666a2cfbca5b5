"""Embedded default corpora for the example scripts and benchmarks (no network needed).

See :mod:`hf_gpa.data.stdlib_corpus` for the text corpus (its train/validation split and the tokenizer; the same on
site-packages or any directory of Python sources, ``corpus_root``) and
:mod:`hf_gpa.data.digits` for the image dataset.
"""

from .digits import DIGIT_NAMES, load_digits_dataset
from .stdlib_corpus import (
    EOS_TOKEN,
    MAX_FILE_BYTES,
    SPLITS,
    VALIDATION_PERCENTAGE,
    corpus_fingerprint,
    corpus_root,
    default_cache_dir,
    get_default_tokenizer,
    load_stdlib_texts,
    stdlib_root,
    stdlib_source_files,
)

__all__ = [
    "DIGIT_NAMES",
    "EOS_TOKEN",
    "MAX_FILE_BYTES",
    "SPLITS",
    "VALIDATION_PERCENTAGE",
    "corpus_fingerprint",
    "corpus_root",
    "default_cache_dir",
    "get_default_tokenizer",
    "load_digits_dataset",
    "load_stdlib_texts",
    "stdlib_root",
    "stdlib_source_files",
]
