"""scikit-learn's bundled handwritten digits as an image-classification `datasets.Dataset`, with no download.

Why this file exists: run_vit_gpa.py needs a real image dataset on a machine with no network. scikit-learn ships
the UCI optical-recognition digits inside its wheel (``sklearn.datasets.load_digits``): 1,797 grayscale 8x8
images of the digits 0-9, 16 gray levels. This module turns them into the layout the ``imagefolder`` loader and
the Hub's image datasets have: an ``image`` column of PIL images and a ``label`` ``ClassLabel`` column.

API
---
``load_digits_dataset() -> datasets.Dataset``
    All 1,797 examples in scikit-learn's order; ``image`` (PIL, mode "L", 8x8, gray levels 0..16 scaled to
    0..255) and ``label`` (``ClassLabel`` with names "0".."9"). Split it with
    ``train_test_split(test_size, seed=..., stratify_by_column="label")``.

Needs ``datasets``, ``scikit-learn`` and ``pillow`` (the ``examples`` extra); they are imported when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import datasets

__all__ = ["DIGIT_NAMES", "load_digits_dataset"]

DIGIT_NAMES = tuple(str(digit) for digit in range(10))


def load_digits_dataset() -> datasets.Dataset:
    """The 1,797 scikit-learn digits as a Dataset with an ``image`` (PIL, 8x8, mode "L") and a ``label`` column."""
    import datasets
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    # images: (1797, 8, 8) float64 in 0..16 (16 gray levels); scale to the full uint8 range for PIL.
    pixels = np.rint(digits.images * (255.0 / 16.0)).astype(np.uint8)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(DIGIT_NAMES))})
    return datasets.Dataset.from_dict(
        {"image": [Image.fromarray(image, mode="L") for image in pixels], "label": digits.target.tolist()},
        features=features,
    )
