"""GPA and DiLoCo around low-bit base optimizers: torchao's AdamW8bit / AdamW4bit (CPU), bitsandbytes' (CUDA).

torchao's optimizers keep ``lr`` as a tensor in their groups and refuse a step once it was replaced by a float; the
wrapper fills that tensor instead. On CPU their step compiles through ``torch.compile`` (tens of seconds per tensor
shape), so one test runs compiled on a 64x64 tensor (4096 elements, the smallest torchao quantizes) and a vector
(kept in float32); every other test runs the same code eagerly (``TORCHDYNAMO_DISABLE=1``).
"""

from __future__ import annotations

import io
import os

import pytest
import torch

from benchmarks.report import state_bytes
from hf_gpa.optim import GPA, DiLoCo

torchao_optim = pytest.importorskip("torchao.optim", reason="torchao is the `lowbit` extra")

SHAPES = [(64, 64), (8,)]  # quantized (>= 4096 elements), float32 state (fewer)
ADAM = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
LOWBIT = ["AdamW8bit", "AdamW4bit"]


@pytest.fixture
def eager(monkeypatch):
    """torchao's step without torch.compile (the same operations, run eagerly: seconds instead of minutes)."""
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in SHAPES]


def grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=g) for shape in SHAPES]


def run(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: range) -> None:
    for step in steps:
        for p, grad in zip(params, grads(step)):
            p.grad = grad.clone()
        lr = ADAM["lr"] * (1.0 - 0.2 * step)  # a schedule, as a trainer's would write it
        for group in optimizer.param_groups:
            if torch.is_tensor(group["lr"]):  # torchao's own groups: its lr tensor is filled
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        optimizer.step()


@pytest.mark.parametrize("name", LOWBIT)
def test_mu_x_zero_equals_the_base_compiled(name):
    """GPA(base, mu_x=0) steps (tensor lr filled, not replaced) and equals the base itself bitwise, compiled."""
    cls = getattr(torchao_optim, name)
    ours, theirs = make_params(), make_params()
    gpa = GPA(ours, base=cls, mu_x=0.0, mu_y=0.7, **ADAM)
    base = cls(theirs, **ADAM)
    run(gpa, ours, range(3))
    run(base, theirs, range(3))
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    base_lr = gpa.base_optimizer.param_groups[0]["lr"]
    assert torch.is_tensor(base_lr) and base_lr.item() == pytest.approx(ADAM["lr"] * 0.6)
    assert type(gpa.state[ours[0]]["base"]["exp_avg"]).__name__.startswith("OptimState")  # quantized
    assert type(gpa.state[ours[1]]["base"]["exp_avg"]) is torch.Tensor  # too small to quantize


@pytest.mark.parametrize("name", [*LOWBIT, "AdamWFp8"])
def test_eval_train_round_trip_is_exact(name, eager):
    """After real steps, eval() puts x in the parameters and train() gives y back bitwise."""
    params = make_params()
    gpa = GPA(params, base=getattr(torchao_optim, name), mu_x=0.9, mu_y=0.7, **ADAM)
    run(gpa, params, range(3))
    y = [p.detach().clone() for p in params]
    gpa.eval()
    assert all((p - t).abs().max() > 1e-4 for p, t in zip(params, y))  # x is not y
    gpa.train()
    for p, t in zip(params, y):
        assert torch.equal(p, t)


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", LOWBIT)
def test_state_dict_round_trip_resumes_bitwise(name, mode, eager):
    """A state dict saved (torch.save, weights_only load) in train or eval mode resumes bitwise: y, z and m, v."""
    cls = getattr(torchao_optim, name)
    params = make_params()
    gpa = GPA(params, base=cls, mu_x=0.9, mu_y=0.7, **ADAM)
    run(gpa, params, range(2))
    if mode == "eval":
        gpa.eval()
    buffer = io.BytesIO()
    torch.save(gpa.state_dict(), buffer)
    saved_params = [p.detach().clone() for p in params]
    gpa.train()
    run(gpa, params, range(2, 4))

    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    resumed = [torch.nn.Parameter(t.clone()) for t in saved_params]
    again = GPA(resumed, base=cls, mu_x=0.9, mu_y=0.7, **ADAM)
    again.load_state_dict(loaded)
    again.train()
    run(again, resumed, range(2, 4))
    for a, b in zip(params, resumed):
        assert torch.equal(a, b)
    for p, q in zip(params, resumed):
        assert torch.equal(gpa.state[p]["z"], again.state[q]["z"])
        for key in ("exp_avg", "exp_avg_sq"):
            m, n = gpa.state[p]["base"][key], again.state[q]["base"][key]
            assert type(m) is type(n) and torch.equal(_plain(m), _plain(n))


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A quantized state tensor as the float32 values it stands for."""
    return t.dequantize() if hasattr(t, "dequantize") else t


def test_diloco_with_plain_outer_step_equals_the_base(eager):
    """DiLoCo(AdamW8bit) with outer lr 1 and no outer momentum follows the base (the wrapper fills its lr too)."""
    cls = torchao_optim.AdamW8bit
    ours, theirs = make_params(), make_params()
    diloco = DiLoCo(ours, base=cls, inner_steps=2, outer_lr=1.0, outer_momentum=0.0, **ADAM)
    base = cls(theirs, **ADAM)
    run(diloco, ours, range(4))
    run(base, theirs, range(4))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


# z 4 bytes, m and v 1 byte (8-bit) or half a byte (4-bit) each, per-block scales; at 4096 weights the 8-bit lookup
# tables (256 float32 values for each of m and v) add 0.5 bytes per weight.
@pytest.mark.parametrize("name, most", [("AdamW8bit", 6.55), ("AdamW4bit", 5.1)])
def test_state_is_below_fp32_adamw(name, most, eager):
    """GPA(8-bit AdamW) holds z in float32 and m, v in 8 bits: ~6 bytes per weight against AdamW's 8 (4-bit: ~5)."""
    p = torch.nn.Parameter(torch.randn(64, 64))
    gpa = GPA([p], base=getattr(torchao_optim, name), **ADAM)
    adamw = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone())], **ADAM)
    for opt in (gpa, adamw):
        opt.param_groups[0]["params"][0].grad = torch.randn(64, 64)
        opt.step()
    per_weight = state_bytes(gpa) / p.numel()
    assert per_weight < most < state_bytes(adamw) / p.numel() == pytest.approx(8.0, abs=0.01)


@pytest.mark.parametrize("saver", ["AdamW8bit", "torch.optim.AdamW"])
def test_an_adopted_state_keeps_the_low_bit_moments(saver, eager):
    """GPA(base=AdamW8bit) adopting an AdamW8bit (or torch AdamW) run keeps m, v quantized: the bytes per weight of a
    fresh GPA(AdamW8bit), not fp32 moments (8 bytes per weight); the adopted values are kept within 8-bit rounding."""
    cls = torchao_optim.AdamW8bit
    params = make_params()
    base = cls(params, **ADAM) if saver == "AdamW8bit" else torch.optim.AdamW(params, **ADAM)
    run(base, params, range(3))
    adopted_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    adopted = GPA(adopted_params, base=cls, mu_x=0.9, mu_y=0.7, **ADAM)
    adopted.load_state_dict(base.state_dict())
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = GPA(fresh_params, base=cls, mu_x=0.9, mu_y=0.7, **ADAM)
    run(fresh, fresh_params, range(1))
    quantized = adopted.state[adopted_params[0]]["base"]["exp_avg"]
    assert type(quantized).__name__.startswith("OptimState")
    per_weight = state_bytes(adopted) / sum(p.numel() for p in params)
    assert per_weight == state_bytes(fresh) / sum(p.numel() for p in params)
    saved = _plain(base.state[params[0]]["exp_avg"])
    torch.testing.assert_close(_plain(quantized), saved, atol=0.02 * saved.abs().max().item(), rtol=0)
    run(adopted, adopted_params, range(3, 5))
    assert all(torch.isfinite(p).all() for p in adopted_params)


# ---- through GPATrainer: --optim gpa --gpa_base_optim adamw_torch_8bit / adamw_torch_4bit ----


def lowbit_llama():
    """A one-layer Llama whose every matrix has >= 4096 elements, so torchao quantizes all but the norm weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """Per base name: a 4-step run saving at steps 2 and 4, and one resumed from its step-2 checkpoint."""
    from helpers import Snapshots, TokenDataset, make_args

    from hf_gpa.trainer import GPATrainer

    cache = {}

    def get(base: str):
        if base not in cache:
            root = tmp_path_factory.mktemp(base)
            old = os.environ.get("TORCHDYNAMO_DISABLE")
            os.environ["TORCHDYNAMO_DISABLE"] = "1"
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                runs = {}
                for name, resume in (("full", None), ("resumed", str(root / "full" / "checkpoint-2"))):
                    snapshots = Snapshots()
                    args = make_args(
                        root / name, optim="gpa", gpa_base_optim=base, max_steps=4, save_strategy="steps",
                        save_steps=2, lr_scheduler_type="cosine",
                    )  # fmt: skip
                    trainer = GPATrainer(
                        model=lowbit_llama(), args=args, train_dataset=TokenDataset(16, seed=1), callbacks=[snapshots]
                    )
                    trainer.train(resume_from_checkpoint=resume)
                    runs[name] = (trainer, snapshots)
            finally:
                torch.set_num_threads(threads)
                if old is None:
                    os.environ.pop("TORCHDYNAMO_DISABLE")
                else:
                    os.environ["TORCHDYNAMO_DISABLE"] = old
            cache[base] = runs
        return cache[base]

    return get


@pytest.mark.parametrize("base", ["adamw_torch_8bit", "adamw_torch_4bit"])
def test_trainer_low_bit_base_saves_x_and_resumes_bitwise(base: str, trainer_runs) -> None:
    """--optim gpa --gpa_base_optim adamw_torch_8bit/4bit trains, saves x, resumes bitwise, holds less than AdamW."""
    from safetensors.torch import load_file

    from hf_gpa.checkpoint import unwrap_gpa_optimizer

    runs = trainer_runs(base)
    (full, full_snaps), (_, resumed_snaps) = runs["full"], runs["resumed"]
    gpa = unwrap_gpa_optimizer(full.optimizer)
    assert isinstance(gpa, GPA)
    expected = {"adamw_torch_8bit": "AdamW8bit", "adamw_torch_4bit": "AdamW4bit"}[base]
    assert type(gpa.base_optimizer).__name__ == expected
    for step in (2, 4):
        x_file = load_file(os.path.join(full.args.output_dir, f"checkpoint-{step}", "model.safetensors"))
        for name, x in full_snaps.saved_x[step].items():
            if name in x_file:
                assert torch.equal(x_file[name], x), name
        assert max((x_file[n] - full_snaps.saved_y[step][n]).abs().max().item() for n in x_file) > 1e-4
    for name, y in full_snaps.y[4].items():
        assert torch.equal(resumed_snaps.y[4][name], y), name
    weights = sum(p.numel() for p in full.model.parameters())
    assert state_bytes(gpa) < 8 * weights  # fp32 AdamW: m and v, 8 bytes per weight


@pytest.mark.parametrize("saver", ["adamw_torch", "adamw_torch_8bit"])
def test_trainer_adopts_a_run_into_a_low_bit_base_keeping_its_low_bit_moments(saver, tmp_path, eager):
    """--optim adamw_torch (or adamw_torch_8bit) saved at step 2, resumed with --optim gpa --gpa_base_optim
    adamw_torch_8bit: the adopted m, v are 8-bit, as a fresh GPA(AdamW8bit) keeps them (not fp32 m and v)."""
    from helpers import TokenDataset, make_args

    from hf_gpa.checkpoint import unwrap_gpa_optimizer
    from hf_gpa.trainer import GPATrainer

    common = dict(max_steps=2, save_strategy="steps", save_steps=2, gpa_mu_x=None, gpa_mu_y=0.7)
    stock = make_args(tmp_path / "stock", optim=saver, **common)
    GPATrainer(model=lowbit_llama(), args=stock, train_dataset=TokenDataset(16, seed=1)).train()
    args = make_args(tmp_path / "gpa", optim="gpa", gpa_base_optim="adamw_torch_8bit", **{**common, "max_steps": 3})
    trainer = GPATrainer(model=lowbit_llama(), args=args, train_dataset=TokenDataset(16, seed=1))
    trainer.train(resume_from_checkpoint=str(tmp_path / "stock" / "checkpoint-2"))
    gpa = unwrap_gpa_optimizer(trainer.optimizer)
    weight = trainer.model.model.layers[0].mlp.up_proj.weight
    assert gpa.state[weight]["base"]["step"].item() == 3
    assert type(gpa.state[weight]["base"]["exp_avg"]).__name__ == "OptimState8bit"
    weights = sum(p.numel() for p in trainer.model.parameters())
    # z 4 bytes, m and v about 1 each, the eval-mode residual 1 (the trainer ends at x); fp32 m and v would be 13
    assert state_bytes(gpa) < 8 * weights
