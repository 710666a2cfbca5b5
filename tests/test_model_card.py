"""The model card a GPA run writes (`GPATrainer.create_model_card`, `hf_gpa.model_card`): the final evaluation's
results, in the card's text and its ``model-index``, and the optimizer's arguments, where transformers' card leaves
"Training results" empty, ``model-index: results: []`` and "No additional optimizer arguments"."""

from __future__ import annotations

import pytest
import yaml
from helpers import TokenDataset, make_args, tiny_llama

from hf_gpa.trainer import GPATrainer


def _card(tmp_path, optim: str, **card_kwargs) -> str:
    trainer = GPATrainer(
        model=tiny_llama(),
        args=make_args(tmp_path, max_steps=2, optim=optim),
        train_dataset=TokenDataset(8, 1),
        eval_dataset=TokenDataset(4, 2),
    )
    trainer.train()
    metrics = trainer.evaluate()
    trainer.create_model_card(dataset="tokens", tasks="text-generation", **card_kwargs)
    assert metrics["eval_loss"] > 0
    return (tmp_path / "README.md").read_text()


def _metadata(card: str) -> dict:
    return yaml.safe_load(card.split("---\n")[1])


def test_the_card_holds_the_results_a_script_computed_and_the_gpa_arguments(tmp_path) -> None:
    """With the script's metrics (perplexity computed after the evaluation), the card's "Training results" and its
    model-index hold every result, at full precision in the model-index; the optimizer line names mu_x, mu_y, H, lr."""
    results = {"eval_loss": 5.5, "perplexity": 244.69193226422038, "eval_accuracy": 0.125, "eval_runtime": 1.0}
    card = _card(tmp_path, "gpa_adamw", results=results)
    training_results = card.split("### Training results")[1].split("###")[0]
    for row in ("| loss | 5.5 |", "| perplexity | 244.692 |", "| accuracy | 0.125 |"):
        assert row in training_results
    assert "runtime" not in training_results
    (result,) = _metadata(card)["model-index"][0]["results"]
    assert result["task"]["type"] == "text-generation" and result["dataset"]["name"] == "tokens"
    assert {m["name"]: m["value"] for m in result["metrics"]} == {
        "loss": 5.5,
        "perplexity": 244.69193226422038,
        "accuracy": 0.125,
    }
    assert "No additional optimizer arguments" not in card
    (line,) = [line for line in card.splitlines() if line.startswith("- optimizer: ")]
    for arg in ("lr=", "gpa_mu_x=", "gpa_mu_y=0.7", "gpa_averaging=gpa"):
        assert arg in line


@pytest.mark.parametrize("optim", ["gpa_adamw", "adamw_torch"])
def test_without_the_script_s_metrics_the_last_evaluation_is_the_result(tmp_path, optim: str) -> None:
    """Without metrics handed in, the card's results are the last evaluation of the log history (its eval_loss), for
    a stock --optim too; a stock --optim keeps transformers' optimizer line."""
    card = _card(tmp_path, optim)
    (result,) = _metadata(card)["model-index"][0]["results"]
    (loss,) = [m["value"] for m in result["metrics"] if m["name"] == "loss"]
    assert loss > 0 and "| loss |" in card.split("### Training results")[1]
    assert ("No additional optimizer arguments" in card) == (optim == "adamw_torch")
