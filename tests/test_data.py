"""The embedded stdlib corpus: split determinism and disjointness, the cached local BPE tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_gpa.data import (
    EOS_TOKEN,
    corpus_fingerprint,
    get_default_tokenizer,
    load_stdlib_texts,
    stdlib_root,
    stdlib_source_files,
)
from hf_gpa.data.stdlib_corpus import _split_of


def _write_tree(root: Path, n_files: int = 60) -> None:
    """A small fake source tree with a test directory, a non-UTF-8 file and site-packages to be skipped."""
    for i in range(n_files):
        package = root / f"pkg{i % 3}"
        package.mkdir(parents=True, exist_ok=True)
        (package / f"mod{i}.py").write_text(f"def function_{i}(x):\n    return x + {i}\n" * 20, encoding="utf-8")
    (root / "test").mkdir()
    (root / "test" / "test_a.py").write_text("assert True\n", encoding="utf-8")
    (root / "site-packages").mkdir()
    (root / "site-packages" / "third.py").write_text("x = 1\n", encoding="utf-8")
    (root / "latin.py").write_bytes("# caf\xe9\n".encode("latin-1"))


def test_splits_are_disjoint_and_cover_the_stdlib() -> None:
    """Train and validation are disjoint, both non-empty, and validation is a small share of the files."""
    train = stdlib_source_files("train")
    validation = stdlib_source_files("validation")
    assert not set(train) & set(validation)
    assert len(validation) > 10
    assert 0.01 < len(validation) / (len(train) + len(validation)) < 0.15
    root = stdlib_root()
    assert all(path.is_relative_to(root) and path.suffix == ".py" for path in train + validation)
    assert not any("site-packages" in path.parts or "test" in path.parts for path in train + validation)


def test_split_depends_only_on_the_relative_path(tmp_path: Path) -> None:
    """A file's split is a function of its relative path alone, so two copies of a tree split identically."""
    for name in ("a", "b"):
        _write_tree(tmp_path / name)
    for split in ("train", "validation"):
        files_a = [p.relative_to(tmp_path / "a") for p in stdlib_source_files(split, tmp_path / "a")]
        files_b = [p.relative_to(tmp_path / "b") for p in stdlib_source_files(split, tmp_path / "b")]
        assert files_a == files_b
        assert all(_split_of(p.as_posix()) == split for p in files_a)
    assert corpus_fingerprint("train", tmp_path / "a") == corpus_fingerprint("train", tmp_path / "b")


def test_skips_tests_third_party_and_non_utf8(tmp_path: Path) -> None:
    """Test directories, site-packages and files that are not UTF-8 never enter the corpus."""
    _write_tree(tmp_path)
    names = {p.name for split in ("train", "validation") for p in stdlib_source_files(split, tmp_path)}
    assert len(names) == 60
    assert not names & {"test_a.py", "third.py", "latin.py"}
    assert len(load_stdlib_texts("train", tmp_path)) == len(stdlib_source_files("train", tmp_path))


def test_fingerprint_changes_with_content(tmp_path: Path) -> None:
    """Editing a train file changes the corpus fingerprint (and so the tokenizer cache key)."""
    _write_tree(tmp_path)
    before = corpus_fingerprint("train", tmp_path)
    stdlib_source_files("train", tmp_path)[0].write_text("changed = True\n", encoding="utf-8")
    assert corpus_fingerprint("train", tmp_path) != before


def test_bad_split_is_rejected() -> None:
    """An unknown split name raises a ValueError that names the valid ones."""
    with pytest.raises(ValueError, match="validation"):
        stdlib_source_files("test")


def test_tokenizer_round_trips_and_is_cached(tmp_path: Path) -> None:
    """The local BPE has the requested vocab, decodes back to the text, and the second call loads the cache."""
    tokenizer = get_default_tokenizer(vocab_size=512, cache_dir=tmp_path, max_train_bytes=200_000)
    assert len(tokenizer) == 512
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.pad_token == EOS_TOKEN
    text = load_stdlib_texts("validation")[0][:2000]
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    (cached,) = list(tmp_path.iterdir())
    assert (cached / "tokenizer.json").is_file()
    mtime = (cached / "tokenizer.json").stat().st_mtime_ns
    again = get_default_tokenizer(vocab_size=512, cache_dir=tmp_path, max_train_bytes=200_000)
    assert again(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert (cached / "tokenizer.json").stat().st_mtime_ns == mtime
    assert len(list(tmp_path.iterdir())) == 1


def test_digits_dataset_matches_scikit_learn() -> None:
    """The digits Dataset has scikit-learn's 1,797 images and labels, as 8x8 grayscale PIL images scaled to 0..255."""
    import numpy as np
    from sklearn.datasets import load_digits

    from hf_gpa.data import DIGIT_NAMES, load_digits_dataset

    dataset = load_digits_dataset()
    reference = load_digits()
    assert len(dataset) == 1797 and dataset.features["label"].names == list(DIGIT_NAMES)
    assert dataset["label"] == reference.target.tolist()
    for i in (0, 500, 1796):
        image = dataset[i]["image"]
        assert image.mode == "L" and image.size == (8, 8)
        np.testing.assert_array_equal(np.asarray(image), np.rint(reference.images[i] * 255 / 16).astype(np.uint8))
