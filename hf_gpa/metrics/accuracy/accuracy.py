"""Accuracy as an `evaluate` metric module that ships inside hf_gpa, so that it loads with no network.

`evaluate.load("accuracy")` fetches its script from the Hugging Face Hub. The example scripts instead call
``evaluate.load(hf_gpa.metrics.ACCURACY)``, the path of this file, which evaluate loads as a local module. The
computation is the same as the Hub's ``evaluate-metric/accuracy``: scikit-learn's ``accuracy_score``.
"""

from __future__ import annotations

import datasets
import evaluate
from sklearn.metrics import accuracy_score

_DESCRIPTION = """
Accuracy is the proportion of correct predictions among the total number of cases processed:
Accuracy = (TP + TN) / (TP + TN + FP + FN).
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): predicted labels.
    references (`list` of `int`): ground-truth labels.
    normalize (`bool`): if False, return the number of correctly classified samples instead of the fraction.
        Defaults to True.
    sample_weight (`list` of `float`): sample weights. Defaults to None.

Returns:
    accuracy (`float` or `int`): in [0, 1] if `normalize` is True, else the count of correct samples.

Examples:
    >>> accuracy_metric = evaluate.load("hf_gpa/metrics/accuracy")
    >>> accuracy_metric.compute(references=[0, 1, 2, 0, 1, 2], predictions=[0, 1, 1, 2, 1, 0])
    {'accuracy': 0.5}
"""

_CITATION = """
@article{scikit-learn,
  title={Scikit-learn: Machine Learning in {P}ython},
  author={Pedregosa, F. and Varoquaux, G. and Gramfort, A. and Michel, V. and Thirion, B. and Grisel, O. and
          Blondel, M. and Prettenhofer, P. and Weiss, R. and Dubourg, V. and Vanderplas, J. and Passos, A. and
          Cournapeau, D. and Brucher, M. and Perrot, M. and Duchesnay, E.},
  journal={Journal of Machine Learning Research},
  volume={12},
  pages={2825--2830},
  year={2011}
}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    """Fraction (or count) of predictions equal to their reference label."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Value("int32")),
                    "references": datasets.Sequence(datasets.Value("int32")),
                }
                if self.config_name == "multilabel"
                else {
                    "predictions": datasets.Value("int32"),
                    "references": datasets.Value("int32"),
                }
            ),
            reference_urls=["https://scikit-learn.org/stable/modules/generated/sklearn.metrics.accuracy_score.html"],
        )

    def _compute(
        self,
        predictions: list[int],
        references: list[int],
        normalize: bool = True,
        sample_weight: list[float] | None = None,
    ) -> dict[str, float]:
        return {
            "accuracy": float(
                accuracy_score(references, predictions, normalize=normalize, sample_weight=sample_weight)
            )
        }
