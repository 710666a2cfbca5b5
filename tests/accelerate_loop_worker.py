"""Worker for tests/test_accelerate_loop.py: a plain accelerate loop (no Trainer) with GPA on 2 CPU processes (DDP).

One launch trains STEPS steps, saving a resumable state at RESUME_STEP with `hf_gpa.accelerate_utils.save_state`,
evaluating inside `evaluation_weights` and saving the final x with `save_x_model` (and, for contrast, the plain
`accelerator.save_model`); then, in the same processes, a fresh model and optimizer load that state with
`load_state` and train the remaining steps. Last, a tiny Llama with an offline tokenizer is trained two steps and
written by `save_x_model` with its tokenizer, as transformers' ``run_clm_no_trainer.py`` writes its output. Rank 0
writes what it saw to ``full.pt``; the test compares it with a single-process run. The MLP, the global batches and
the optimizer settings are those of tests/distributed_workers.py.

It builds its `Accelerator()` as run_clm_no_trainer.py does, so it is launched as the docs say a loop is launched
on a machine without a GPU:

    ACCELERATE_USE_CPU=true accelerate launch --config_file configs/accelerate_ddp.yaml \
        tests/accelerate_loop_worker.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from distributed_workers import ADAMW_KW, GLOBAL_BATCH, TokenDataset, build_mlp, global_batch, mse
from helpers import tiny_llama

from hf_gpa.accelerate_utils import evaluation_weights, load_state, save_state, save_x_model
from hf_gpa.checkpoint import x_state_dict
from hf_gpa.optim import GPAAdamW

STEPS, RESUME_STEP = 4, 2
EVAL_STEP = 100  # the global batch the loop evaluates on (not one it trains on)
DTYPE = torch.float64  # the DDP all-reduce order is the only difference from one process


def _train(accelerator: Accelerator, model, optimizer, steps: range) -> None:
    rows = GLOBAL_BATCH // accelerator.num_processes
    for step in steps:
        inputs, targets = global_batch(step, DTYPE)
        own = slice(accelerator.process_index * rows, (accelerator.process_index + 1) * rows)
        accelerator.backward(mse(model, inputs[own], targets[own]))  # DDP averages: the global batch's gradient
        optimizer.step()
        optimizer.zero_grad()


def _y(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def word_tokenizer() -> Any:
    """A word-level tokenizer built here (no download) with the tiny Llama's 64 ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<pad>": 1, **{f"w{i}": i for i in range(2, 64)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>")


def _llama(accelerator: Accelerator, out: Path) -> dict[str, torch.Tensor]:
    """Two DDP steps of a tiny Llama; `save_x_model` with the tokenizer, as run_clm_no_trainer.py saves. Its x."""
    plain = tiny_llama()
    model, optimizer = accelerator.prepare(plain, GPAAdamW(plain.parameters(), **ADAMW_KW))
    data = TokenDataset(4 * accelerator.num_processes, seed=0)
    for step in range(2):
        batch = data[2 * step + accelerator.process_index]
        accelerator.backward(model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss)
        optimizer.step()
        optimizer.zero_grad()
    save_x_model(accelerator, model, optimizer, out / "llama", tokenizer=word_tokenizer())
    return x_state_dict(plain, optimizer)


def main(out: Path) -> None:
    torch.set_num_threads(1)
    accelerator = Accelerator()
    try:
        run(accelerator, out)
    finally:
        accelerator.end_training()  # destroys the process group, also when the run raises


def run(accelerator: Accelerator, out: Path) -> None:
    facts: dict[str, object] = {"num_processes": accelerator.num_processes}
    plain = build_mlp(DTYPE)
    model, optimizer = accelerator.prepare(plain, GPAAdamW(plain.parameters(), **ADAMW_KW))
    _train(accelerator, model, optimizer, range(RESUME_STEP))
    facts["save_state_returned"] = save_state(accelerator, optimizer, out / "state")
    facts["y_at_save"] = _y(plain)
    _train(accelerator, model, optimizer, range(RESUME_STEP, STEPS))
    facts.update(x=x_state_dict(plain, optimizer), y=_y(plain))
    inputs, targets = global_batch(EVAL_STEP, DTYPE)
    with evaluation_weights(optimizer), torch.no_grad():  # the loop's own evaluation, through the DDP model
        model.eval()
        facts["eval_loss"] = mse(model, inputs, targets).item()
    model.train()
    facts["y_after_eval"] = _y(plain)
    save_x_model(accelerator, model, optimizer, out / "x_model")
    accelerator.save_model(model, out / "plain_save_model")

    accelerator.free_memory()
    fresh = build_mlp(DTYPE)
    model, optimizer = accelerator.prepare(fresh, GPAAdamW(fresh.parameters(), **ADAMW_KW))
    load_state(accelerator, optimizer, out / "state")
    facts["y_at_load"] = _y(fresh)
    _train(accelerator, model, optimizer, range(RESUME_STEP, STEPS))
    facts.update(resumed_x=x_state_dict(fresh, optimizer), resumed_y=_y(fresh))
    accelerator.free_memory()
    facts["llama_x"] = _llama(accelerator, out)
    gathered = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(gathered, facts["y"])
    facts["ranks_agree"] = all(all(torch.equal(g[k], facts["y"][k]) for k in g) for g in gathered)
    if accelerator.is_main_process:
        torch.save(facts, out / "full.pt")
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
