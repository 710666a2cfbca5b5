"""The Python standard library's own source files as an embedded, offline text corpus.

Why this file exists: the example scripts and benchmarks must run on a machine with no network, yet train on
real text. Every machine that runs them has a Python interpreter, and with it about 11 MB of Python source
(the paper's 8B experiment was a code model). This module turns that source tree into a corpus with a
deterministic train/validation split and a byte-level BPE tokenizer trained locally on the train split.

API
---
``stdlib_root() -> Path``
    The directory that holds the standard library's ``.py`` files (``sysconfig.get_paths()["stdlib"]``).
``corpus_root(corpus) -> Path | None``
    The source tree of a named corpus: ``"stdlib"`` (None: the default root), ``"site-packages"`` (the running
    interpreter's third-party packages, often 100+ MB of Python on a GPU machine) or a directory of ``.py`` files.
    Every function below takes it as ``root``: the same file selection and split by file, on another tree.
``stdlib_source_files(split="train", root=None) -> list[Path]``
    The corpus files of one split (``"train"`` or ``"validation"``), sorted by relative path.
``load_stdlib_texts(split="train", root=None) -> list[str]``
    Their contents, one string per file, in the same order.
``corpus_fingerprint(split="train", root=None) -> str``
    A short hex digest of the split's relative paths and contents; keys caches.
``get_default_tokenizer(vocab_size=8192, cache_dir=None, max_train_bytes=4_000_000) -> PreTrainedTokenizerFast``
    A byte-level BPE trained on (a deterministic sample of) the train split, cached on disk under
    ``cache_dir / f"stdlib-bpe-v{vocab_size}-{fingerprint}"`` and loaded from there on later calls.

Which files are in the corpus
-----------------------------
Every ``*.py`` file under :func:`stdlib_root`, except

* third-party code: anything under ``site-packages`` or ``dist-packages``;
* test suites: anything under a directory named ``test``, ``tests`` or ``idle_test`` (``Lib/test`` alone is
  about half of the tree and is mostly generated or data-like);
* build-machine files: ``config-*`` and ``lib-dynload`` directories, ``_sysconfigdata_*.py``;
* generated data: files larger than :data:`MAX_FILE_BYTES` (``pydoc_data/topics.py`` is 750 KB of prose) and
  the character-map codec tables that ``gencodec.py`` wrote (``encodings/cp*.py`` and friends, near-identical);
* files that do not decode as UTF-8.

Which split a file belongs to depends only on its path relative to the root: the first 8 bytes of
``sha256(relative_posix_path)`` modulo 1000 below ``10 * VALIDATION_PERCENTAGE`` puts it in validation. The split
of a given file is therefore the same on every machine and Python version; the set of files differs between
Python versions, which :func:`corpus_fingerprint` (and the tokenizer cache key) reflects.

This module depends on the standard library only, except :func:`get_default_tokenizer`, which imports
``tokenizers`` and ``transformers`` when called.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sysconfig
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

__all__ = [
    "EOS_TOKEN",
    "MAX_FILE_BYTES",
    "SPLITS",
    "VALIDATION_PERCENTAGE",
    "corpus_fingerprint",
    "default_cache_dir",
    "get_default_tokenizer",
    "load_stdlib_texts",
    "corpus_root",
    "stdlib_root",
    "stdlib_source_files",
]

#: The corpora named by a word rather than a path (``corpus_root``).
NAMED_CORPORA = ("stdlib", "site-packages")

SPLITS = ("train", "validation")
#: Percentage of files (by stable path hash) that go to the validation split.
VALIDATION_PERCENTAGE = 5
#: Files above this size are generated data (doc topics, codec tables), not code.
MAX_FILE_BYTES = 256 * 1024
#: The one special token of the default tokenizer: document separator, BOS, EOS and padding.
EOS_TOKEN = "<|endoftext|>"

_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "lib-dynload"}
)
_GENERATED_MARKER = "with gencodec.py"
# Bump when the file selection or the tokenizer recipe changes, so stale caches are not reused.
_CORPUS_VERSION = "2"


def stdlib_root() -> Path:
    """The directory holding the running interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def corpus_root(corpus: str) -> Path | None:
    """The root of ``corpus``: None for "stdlib" (the default root), site-packages, or the directory named."""
    if corpus == "stdlib":
        return None
    if corpus == "site-packages":
        return Path(sysconfig.get_paths()["purelib"]).resolve()
    path = Path(corpus).expanduser().resolve()
    if not path.is_dir():
        raise ValueError(f"Invalid corpus: {corpus!r} (expected one of {NAMED_CORPORA} or a directory of .py files)")
    return path


def _is_excluded_dir(name: str) -> bool:
    return name in _EXCLUDED_DIRS or name.startswith("config-") or name.startswith(".")


def _split_of(relative_path: str) -> str:
    """The split of a file, from a stable hash of its relative POSIX path (independent of the machine)."""
    bucket = int.from_bytes(hashlib.sha256(relative_path.encode("utf-8")).digest()[:8], "big") % 1000
    return "validation" if bucket < 10 * VALIDATION_PERCENTAGE else "train"


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"Invalid split: {split!r}; expected one of {SPLITS}")


@lru_cache(maxsize=8)
def _scan(root: Path) -> tuple[tuple[str, str], ...]:
    """All corpus files under root as sorted (relative_posix_path, split) pairs; UTF-8 is checked here."""
    entries: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place keeps os.walk out of site-packages and the test suites entirely.
        dirnames[:] = sorted(d for d in dirnames if not _is_excluded_dir(d))
        for filename in sorted(filenames):
            if not filename.endswith(".py") or filename.startswith("_sysconfigdata_"):
                continue
            path = Path(dirpath) / filename
            try:
                if path.stat().st_size > MAX_FILE_BYTES:
                    continue
                head = path.read_bytes().decode("utf-8")[:1000]
            except (OSError, UnicodeDecodeError):
                continue
            if _GENERATED_MARKER in head:
                continue
            relative = path.relative_to(root).as_posix()
            entries.append((relative, _split_of(relative)))
    entries.sort()
    return tuple(entries)


def stdlib_source_files(split: str = "train", root: str | os.PathLike[str] | None = None) -> list[Path]:
    """The corpus files of ``split`` ("train" or "validation"), sorted by path relative to ``root``.

    Args:
        split: "train" (about 95% of the files) or "validation" (about 5%).
        root: the source tree to scan (default: :func:`stdlib_root`).
    """
    _check_split(split)
    base = stdlib_root() if root is None else Path(root).resolve()
    files = [base / relative for relative, file_split in _scan(base) if file_split == split]
    if not files:
        raise FileNotFoundError(f"No Python source files for split {split!r} under {base}")
    return files


def load_stdlib_texts(split: str = "train", root: str | os.PathLike[str] | None = None) -> list[str]:
    """The contents of :func:`stdlib_source_files` for ``split``, one string per file, in the same order."""
    return [path.read_text(encoding="utf-8") for path in stdlib_source_files(split, root)]


def corpus_fingerprint(split: str = "train", root: str | os.PathLike[str] | None = None) -> str:
    """A 16-hex-digit digest of the split's relative paths and file contents (changes with the Python version)."""
    base = stdlib_root() if root is None else Path(root).resolve()
    digest = hashlib.sha256(f"hf_gpa-stdlib-corpus-v{_CORPUS_VERSION}:{split}".encode())
    for path in stdlib_source_files(split, base):
        digest.update(path.relative_to(base).as_posix().encode("utf-8") + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def default_cache_dir() -> Path:
    """``$HF_GPA_CACHE`` if set, else ``$XDG_CACHE_HOME/hf_gpa`` (default ``~/.cache/hf_gpa``)."""
    if "HF_GPA_CACHE" in os.environ:
        return Path(os.environ["HF_GPA_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hf_gpa"


def _training_sample(texts: list[str], relative_paths: list[str], max_train_bytes: int) -> list[str]:
    """A deterministic sample of about ``max_train_bytes`` characters: whole files in path-hash order."""
    # A second hash (salted, so not the split hash) gives a fixed order that mixes packages and modules.
    order = sorted(range(len(texts)), key=lambda i: hashlib.sha256(b"sample:" + relative_paths[i].encode()).digest())
    sample: list[str] = []
    total = 0
    for i in order:
        if total >= max_train_bytes:
            break
        sample.append(texts[i])
        total += len(texts[i])
    return sample


def get_default_tokenizer(
    vocab_size: int = 8192,
    cache_dir: str | os.PathLike[str] | None = None,
    max_train_bytes: int = 4_000_000,
    root: str | os.PathLike[str] | None = None,
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained locally on the train split, cached on disk.

    The tokenizer is GPT-2 style (byte-level pre-tokenizer and decoder, no prefix space, no unknown token) with
    one special token, ``<|endoftext|>``, used as BOS, EOS and padding. It is trained on whole train-split files,
    taken in a fixed pseudo-random order until ``max_train_bytes`` characters are reached (4 MB trains in
    seconds). The result is saved with ``save_pretrained`` under
    ``cache_dir / f"stdlib-bpe-v{vocab_size}-{corpus_fingerprint('train')}"`` and loaded from there later;
    the directory is written under a temporary name and renamed, so concurrent callers never see a partial one.

    Args:
        vocab_size: size of the vocabulary, including the 256 byte tokens and the special token.
        cache_dir: where trained tokenizers are kept (default: :func:`default_cache_dir` / "tokenizers").
        max_train_bytes: how much of the train split the BPE trainer reads.
        root: the source tree (default: :func:`stdlib_root`).
    """
    if vocab_size < 258:
        raise ValueError(f"Invalid vocab_size: {vocab_size} (needs at least 256 bytes + 1 special token + 1)")
    if max_train_bytes <= 0:
        raise ValueError(f"Invalid max_train_bytes: {max_train_bytes}")
    from transformers import PreTrainedTokenizerFast

    base = stdlib_root() if root is None else Path(root).resolve()
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "tokenizers"
    key = f"stdlib-bpe-v{vocab_size}-b{max_train_bytes}-{corpus_fingerprint('train', base)}"
    target = cache / key
    if (target / "tokenizer.json").is_file():
        logger.info("Loading the cached stdlib BPE tokenizer from %s", target)
        return PreTrainedTokenizerFast.from_pretrained(str(target))

    paths = stdlib_source_files("train", base)
    texts = [path.read_text(encoding="utf-8") for path in paths]
    sample = _training_sample(texts, [path.relative_to(base).as_posix() for path in paths], max_train_bytes)
    logger.info(
        "Training a byte-level BPE tokenizer (vocab %d) on %d stdlib files (%.1f MB)",
        vocab_size,
        len(sample),
        sum(map(len, sample)) / 1e6,
    )
    tokenizer = _train_bpe(sample, vocab_size)
    _save_atomically(tokenizer, cache, key)
    logger.info("Saved the stdlib BPE tokenizer to %s", target)
    return tokenizer


def _train_bpe(sample: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """The GPT-2 style byte-level BPE tokenizer of `get_default_tokenizer`, trained on ``sample``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(sample, trainer=trainer, length=len(sample))
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=1_000_000_000,
        clean_up_tokenization_spaces=False,
    )


def _save_atomically(tokenizer: PreTrainedTokenizerFast, cache: Path, key: str) -> None:
    """``save_pretrained`` under ``cache / key``, written under a temporary name and renamed, so that concurrent
    callers never see a partial folder (one that finished first is kept: its copy is equivalent)."""
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=cache))
    try:
        tokenizer.save_pretrained(str(staging))
        try:
            staging.rename(cache / key)
        except OSError:
            if not (cache / key / "tokenizer.json").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
