"""GPA with PEFT/LoRA adapters under GPATrainer: adapters saved at x, reloadable, resumable, the base untouched.

A 2-layer Llama from a config with LoRA on q_proj/v_proj trains 6 steps with checkpoints at 3 and 6, once straight
through and once resumed from checkpoint-3 (shared by the tests through a module-scoped fixture).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import RecordXY, make_args, tiny_llama, x_then_y

from hf_gpa.checkpoint import unwrap_gpa_optimizer
from hf_gpa.trainer import GPATrainer

peft = pytest.importorskip("peft")

STEPS, SAVE_STEPS = 6, 3


def _lora_model() -> torch.nn.Module:
    # init_lora_weights=False: B is random too, so that the adapter changes the outputs from the first step on.
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    return peft.get_peft_model(tiny_llama(), config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        self.ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer(output_dir: Path, model: torch.nn.Module, **extra) -> GPATrainer:
    args = make_args(output_dir, max_steps=STEPS, save_strategy="steps", save_steps=SAVE_STEPS)
    return GPATrainer(model=model, args=args, train_dataset=Tokens(), **extra)


def _trainable(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    names = [name for name, _ in model.named_parameters() if "lora_" in name]  # reloaded adapters are frozen
    state = state if state is not None else {n: p.detach().clone() for n, p in model.named_parameters()}
    return {name: state[name].clone() for name in names}


@dataclass
class Run:
    root: Path
    record: RecordXY
    base_before: dict[str, torch.Tensor]
    trainer: GPATrainer
    x: dict[str, torch.Tensor]
    y: dict[str, torch.Tensor]
    resumed_x: dict[str, torch.Tensor]
    resumed_y: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    root = tmp_path_factory.mktemp("peft")
    model = _lora_model()
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    record = RecordXY(_trainable)
    trainer = _trainer(root / "full", model, callbacks=[record])
    trainer.train()
    trainer.save_model(str(root / "final"))
    x, y = x_then_y(trainer, _trainable)
    resumed = _trainer(root / "resumed", _lora_model())
    resumed.train(resume_from_checkpoint=str(root / "full" / f"checkpoint-{SAVE_STEPS}"))
    resumed_x, resumed_y = x_then_y(resumed, _trainable)
    return Run(root, record, base_before, trainer, x, y, resumed_x, resumed_y)


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _reloaded(folder: Path) -> torch.nn.Module:
    return peft.PeftModel.from_pretrained(tiny_llama(), str(folder))


def test_peft_adapters_are_saved_at_x_and_reload(run: Run) -> None:
    """Each checkpoint's adapter, reloaded with PeftModel.from_pretrained on a fresh base, is that step's x, not y."""
    for step in (SAVE_STEPS, STEPS):
        reloaded = _trainable(_reloaded(run.root / "full" / f"checkpoint-{step}"))
        _assert_equal(reloaded, run.record.x[step])
        assert not any(torch.equal(reloaded[k], run.record.y[step][k]) for k in reloaded)


def test_peft_final_save_reproduces_the_trained_model_at_x(run: Run) -> None:
    """The final save equals the last checkpoint and reloads into a model whose outputs equal the trainer's at x."""
    final = _reloaded(run.root / "final")
    _assert_equal(_trainable(final), run.x)
    _assert_equal(_trainable(_reloaded(run.root / "full" / f"checkpoint-{STEPS}")), run.x)
    ids = Tokens().ids[:2]
    with torch.no_grad():
        torch.testing.assert_close(
            final(input_ids=ids).logits, run.trainer.model(input_ids=ids).logits, rtol=0, atol=0
        )


def test_peft_resume_from_middle_checkpoint_is_bitwise(run: Run) -> None:
    """A LoRA run resumed from checkpoint-3 ends with the same adapter x and y, bitwise, as the uninterrupted run."""
    _assert_equal(run.resumed_x, run.x)
    _assert_equal(run.resumed_y, run.y)


def test_peft_frozen_base_is_untouched(run: Run) -> None:
    """The frozen base weights are bitwise unchanged and are not among the optimizer's parameters."""
    model = run.trainer.model
    frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    _assert_equal(frozen, run.base_before)
    optimized = {id(p) for g in unwrap_gpa_optimizer(run.trainer.optimizer).param_groups for p in g["params"]}
    assert optimized == {id(p) for p in model.parameters() if p.requires_grad}


def test_peft_gpa_state_is_three_times_the_adapters(run: Run) -> None:
    """GPA-AdamW's per-parameter state (z, m, v) is exactly 3x the bytes of the trainable (adapter) parameters."""
    inner = unwrap_gpa_optimizer(run.trainer.optimizer)
    inner.train()
    try:
        state_bytes = sum(
            t.numel() * t.element_size() for s in inner.state.values() for t in s.values() if t.dim() > 0
        )
    finally:
        inner.eval()
    trainable_bytes = sum(p.numel() * p.element_size() for p in run.trainer.model.parameters() if p.requires_grad)
    all_bytes = sum(p.numel() * p.element_size() for p in run.trainer.model.parameters())
    assert state_bytes == 3 * trainable_bytes and trainable_bytes < all_bytes / 10
