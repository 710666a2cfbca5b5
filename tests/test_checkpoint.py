"""hf_gpa.checkpoint: x-weight export that leaves y in place, through wrappers and failures."""

from __future__ import annotations

import pytest
import torch
from helpers import MU_X, MU_Y, NARROW_LLAMA, assert_equal_dicts, params_of, tiny_llama
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaForCausalLM

from hf_gpa.checkpoint import evaluation_weights, save_x_weights, unwrap_gpa_optimizer, x_state_dict
from hf_gpa.optim import GPA, GPAAdamW


def trained(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        optimizer.zero_grad()
        sum(((p - torch.randn(p.shape, generator=g, dtype=p.dtype)) ** 2).sum() for p in model.parameters()).backward()
        optimizer.step()


def x_from_y_and_z(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The paper's x = (y - (1 - mu_y) z) / mu_y (Appendix B), from the live y and the optimizer's z."""
    return {n: (p - (1 - MU_Y) * optimizer.state[p]["z"]) / MU_Y for n, p in model.named_parameters()}


def test_x_state_dict_is_x_and_leaves_y():
    """x_state_dict equals the closed form x from y and z (fp64); the parameters stay at y bitwise."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    optimizer = GPAAdamW(model.parameters(), lr=0.1, mu_x=MU_X, mu_y=MU_Y)
    trained(model, optimizer)
    y = params_of(model)
    expected = x_from_y_and_z(model, optimizer)
    x = x_state_dict(model, optimizer)
    torch.testing.assert_close(x, expected, rtol=1e-12, atol=1e-14)
    assert min((x[n] - y[n]).abs().max().item() for n in y) > 1e-3
    assert optimizer.train_mode
    assert_equal_dicts(params_of(model), y)


def test_evaluation_weights_restores_y_when_the_block_raises():
    """An exception inside evaluation_weights still puts y back bitwise, in train mode."""
    model = nn.Linear(4, 4)
    optimizer = GPA(model.parameters(), base=torch.optim.SGD, lr=0.1, mu_x=MU_X, mu_y=MU_Y)
    trained(model, optimizer)
    y = params_of(model)
    with pytest.raises(OSError, match="injected"), evaluation_weights(optimizer):
        assert not optimizer.train_mode
        raise OSError("injected")
    assert optimizer.train_mode
    assert_equal_dicts(params_of(model), y)


def test_evaluation_weights_leaves_eval_mode_as_found():
    """Entered in eval mode (parameters at x), the block changes nothing and the optimizer stays in eval mode."""
    model = nn.Linear(4, 4)
    optimizer = GPAAdamW(model.parameters(), lr=0.1, mu_x=MU_X, mu_y=MU_Y)
    trained(model, optimizer)
    optimizer.eval()
    x = params_of(model)
    with evaluation_weights(optimizer):
        assert_equal_dicts(params_of(model), x)
    assert not optimizer.train_mode
    assert_equal_dicts(params_of(model), x)


class Wrapper:
    """Holds the real optimizer in ``.optimizer``, as accelerate's AcceleratedOptimizer does (see test_trainer)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer


def test_unwraps_wrappers_and_ignores_stock_optimizers():
    """The GPA optimizer is found behind .optimizer wrappers; stock optimizers and None are left alone."""
    model = nn.Linear(4, 4)
    optimizer = GPAAdamW(model.parameters(), lr=0.1, mu_x=MU_X, mu_y=MU_Y)
    assert unwrap_gpa_optimizer(Wrapper(Wrapper(optimizer))) is optimizer
    assert unwrap_gpa_optimizer(optimizer) is optimizer
    stock = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert unwrap_gpa_optimizer(Wrapper(stock)) is None
    trained(model, stock)
    before = params_of(model)
    with evaluation_weights(Wrapper(stock)), evaluation_weights(None):
        assert_equal_dicts(params_of(model), before)
    assert_equal_dicts(params_of(model), before)


def test_save_x_weights_plain_module_and_pretrained(tmp_path):
    """save_x_weights writes x (safetensors for a plain module, save_pretrained for a PreTrainedModel), keeps y."""
    plain = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    optimizer = GPAAdamW(plain.parameters(), lr=0.1, mu_x=MU_X, mu_y=MU_Y)
    trained(plain, optimizer)
    y, x = params_of(plain), x_state_dict(plain, optimizer)
    path = save_x_weights(plain, optimizer, tmp_path / "plain")
    assert_equal_dicts(load_file(path), x)
    assert_equal_dicts(params_of(plain), y)

    llama = tiny_llama(**NARROW_LLAMA)
    optimizer = GPAAdamW(llama.parameters(), lr=0.1, mu_x=MU_X, mu_y=MU_Y)
    trained(llama, optimizer, steps=2)
    y, x = params_of(llama), x_state_dict(llama, optimizer)
    save_x_weights(llama, optimizer, tmp_path / "llama")
    assert_equal_dicts(params_of(LlamaForCausalLM.from_pretrained(tmp_path / "llama")), x)
    assert_equal_dicts(params_of(llama), y)
