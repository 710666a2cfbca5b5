"""`hf_gpa.accelerate_utils` in a plain accelerate loop on 2 CPU processes (DDP over gloo), against one process.

One launch of tests/accelerate_loop_worker.py as the docs launch a loop on a machine without a GPU,
``ACCELERATE_USE_CPU=true accelerate launch --config_file configs/accelerate_ddp.yaml`` (its own session, killed on
timeout, so a hang fails the test instead of blocking CI); the asserts compare its files with a single-process run.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import accelerate_loop_worker as worker
import distributed_workers as dw
import pytest
import torch
from launching import free_port, launch_env, run_logged
from safetensors.torch import load_file

from hf_gpa.checkpoint import x_state_dict
from hf_gpa.optim import GPAAdamW
from hf_gpa.optim.kernels import cpu as _kernels

F64 = dict(rtol=1e-10, atol=1e-12)  # the order of the gradient all-reduce only


@pytest.fixture(scope="module")
def loop(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One 2-process launch of the accelerate loop: its output folder and rank 0's facts."""
    _kernels.load_cpu_kernel()  # build (or find) the fused kernel here, once, not by both ranks inside the launch
    out = tmp_path_factory.mktemp("accelerate_loop")
    script = Path(worker.__file__)
    config = script.parent.parent / "configs" / "accelerate_ddp.yaml"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes=2"]
    cmd += [f"--main_process_port={free_port()}", str(script), str(out)]
    # Without ACCELERATE_USE_CPU the config's MULTI_GPU starts, on a machine without a GPU, two unrelated
    # single-process runs; the loop's own Accelerator() reads it (GPATrainer scripts take --use_cpu instead).
    env = {**launch_env(script.parent.parent, script.parent), "ACCELERATE_USE_CPU": "true"}
    run_logged(cmd, out / "launch.log", env, what="the accelerate loop")
    return out, torch.load(out / "full.pt", weights_only=True)


@pytest.fixture(scope="module")
def single_process() -> dict[str, dict[str, torch.Tensor]]:
    """x and y of the same model trained in one process on the full global batches."""
    model = dw.build_mlp(worker.DTYPE)
    optimizer = GPAAdamW(model.parameters(), **dw.ADAMW_KW)
    dw.oracle_steps(model, optimizer, range(worker.STEPS), worker.DTYPE)
    return {"x": x_state_dict(model, optimizer), "y": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol: float) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], **tol)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_save_x_model_writes_the_single_process_x(loop, single_process) -> None:
    """`save_x_model` on 2 ranks writes the x of a single-process run, where plain `save_model` writes y."""
    out, facts = loop
    assert facts["num_processes"] == 2
    saved = load_file(str(out / "x_model" / "model.safetensors"))
    _close(saved, single_process["x"], **F64)
    _equal(saved, facts["x"])
    plain = load_file(str(out / "plain_save_model" / "model.safetensors"))
    _equal(plain, facts["y"])
    assert max((plain[k] - saved[k]).abs().max().item() for k in saved) > 1e-3
    assert facts["ranks_agree"]


def test_load_state_resumes_bitwise(loop) -> None:
    """`load_state` of a `save_state` folder gives back y bitwise, and the resumed loop ends with the same x and y."""
    _, facts = loop
    _equal(facts["y_at_load"], facts["y_at_save"])
    _equal(facts["resumed_x"], facts["x"])
    _equal(facts["resumed_y"], facts["y"])


def test_save_state_returns_the_folder_as_str(loop) -> None:
    """`save_state` returns the folder it wrote as a str (its annotation), not accelerate's Path."""
    out, facts = loop
    assert type(facts["save_state_returned"]) is str and facts["save_state_returned"] == str(out / "state")


def test_loop_evaluation_inside_evaluation_weights_is_at_x(loop, single_process) -> None:
    """The recipe's evaluation line (`with evaluation_weights(optimizer):` around the loop's own evaluation, through
    the DDP model) reports x's loss, not y's, and leaves y bitwise as it was."""
    _, facts = loop
    inputs, targets = dw.global_batch(worker.EVAL_STEP, worker.DTYPE)

    def loss(state: dict[str, torch.Tensor]) -> float:
        model = dw.build_mlp(worker.DTYPE)
        model.load_state_dict(state)
        with torch.no_grad():
            return dw.mse(model, inputs, targets).item()

    assert facts["eval_loss"] == pytest.approx(loss(single_process["x"]), rel=1e-10, abs=0.0)
    assert abs(loss(single_process["y"]) - facts["eval_loss"]) > 1e-4
    _equal(facts["y_after_eval"], facts["y"])


def test_save_x_model_writes_a_from_pretrained_folder_of_x(loop) -> None:
    """`save_x_model` of a transformers model on 2 ranks writes what `from_pretrained` loads (config, weights and the
    given tokenizer), holding x bitwise, as run_clm_no_trainer.py's save_pretrained lines would write y."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, facts = loop
    folder = out / "llama"
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    _equal({k: v for k, v in loaded.state_dict().items()}, facts["llama_x"])
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer("w2 w3 w63")["input_ids"] == [2, 3, 63]
    assert tokenizer.pad_token == "<pad>"


def test_save_state_folder_holds_x(loop) -> None:
    """The model file inside a `save_state` folder holds x (a state that is only y would not be a model to keep)."""
    out, facts = loop
    model = dw.build_mlp(worker.DTYPE)
    optimizer = GPAAdamW(model.parameters(), **dw.ADAMW_KW)
    dw.oracle_steps(model, optimizer, range(worker.RESUME_STEP), worker.DTYPE)
    _close(load_file(str(out / "state" / "model.safetensors")), x_state_dict(model, optimizer), **F64)
