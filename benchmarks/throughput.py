"""End-to-end training throughput: ``GPATrainer`` with ``--optim gpa_adamw`` against the stock ``Trainer`` with
``--optim adamw_torch_fused``, on the same model, data and arguments, measured side by side in one run.

Why this file exists: the optimizer step of GPA costs a little more than AdamW's (one more state tensor), and
``GPATrainer`` adds mode switches around evaluation and saving; what a user pays is the ratio of tokens per second
of the whole training step (data, forward, backward, clipping, optimizer, scheduler, callbacks). The two trainers
take turns (rounds alternate the order, ABBA), each round trains a fresh copy of the same initial model for
``--steps`` steps, and the tokens/s of a round is timed from the end of step ``--warmup`` to the last step, so
one-time costs (kernel load or compile, allocator warm-up, dataloader start) are left out; on CUDA the device is
synchronized at the two steps that bound the window, so queued work is counted. The table reports the median over
rounds and the ratio of medians; a benchmark, never a test (run it on a quiet machine).

On CUDA the default setup is a ~110M-parameter Llama (width 768, 12 layers, tied embeddings, vocabulary 32000) on
sequences of 1024 x batch 16 (16K tokens per step) in bf16 autocast (``--bf16``, fp32 weights): a realistic GPU
step, so that the optimizer's share of it is what a user sees.

    python -m benchmarks.throughput --threads 1              # CPU: Llama 2.9M, seq 128, batch 8
    python -m benchmarks.throughput --quick                  # a quick look (tiny model, few steps)
    python -m benchmarks.throughput --device cuda            # GPU: Llama 110M, seq 1024, batch 16, bf16 autocast
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks import report, workloads
from benchmarks.devices import device_arg

logger = logging.getLogger("throughput")


@dataclass(frozen=True)
class Setup(workloads.LlamaSpec):
    """The shared model (a Llama: `workloads.LlamaSpec`), data and loop; both trainers get exactly this."""

    batch_size: int = 8
    #: steps of each training run; tokens/s is timed after the first ``warmup`` of them
    steps: int = 25
    warmup: int = 5
    #: runs of each trainer, in alternating order
    rounds: int = 6
    #: torch threads (None: torch's default); 1 gives steadier numbers on a shared machine.
    threads: int | None = None
    #: bf16 autocast (the Trainer's --bf16); the weights and the optimizer stay in fp32.
    bf16: bool = False


#: The CPU default: a 2.9M-parameter Llama, seq 128 x batch 8.
CPU_SETUP = Setup(vocab_size=8192, hidden_size=128, num_layers=4, intermediate_size=344, seq_len=128,
                  tie_embeddings=False)  # fmt: skip
QUICK = Setup(vocab_size=512, hidden_size=32, num_layers=2, intermediate_size=64, seq_len=64, tie_embeddings=False,
              batch_size=4, steps=8, warmup=2, rounds=2)  # fmt: skip
#: The GPU default: 110M parameters, 16K tokens per step, bf16 autocast.
CUDA_SETUP = Setup(vocab_size=32000, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=2048,
                   seq_len=1024, batch_size=16, steps=30, warmup=10, rounds=4, tie_embeddings=True,
                   bf16=True)  # fmt: skip


class _Windows(torch.utils.data.Dataset):
    """Fixed token windows as causal-LM examples (labels = input_ids, the model shifts them)."""

    def __init__(self, windows: torch.Tensor) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.windows[index].long()
        return {"input_ids": ids, "labels": ids}


def _dataset(setup: Setup) -> _Windows:
    from hf_gpa.data import get_default_tokenizer, load_stdlib_texts

    tokenizer = get_default_tokenizer(vocab_size=setup.vocab_size)
    needed = (setup.steps * setup.batch_size + 1) * setup.seq_len
    ids: list[int] = []
    for text in load_stdlib_texts("train"):
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(ids) >= needed:
            break
    stream = torch.tensor(ids[: len(ids) // setup.seq_len * setup.seq_len])
    return _Windows(stream.view(-1, setup.seq_len))


class _StepClock:
    """A TrainerCallback that stamps the end of every optimizer step.

    On CUDA it first waits for the device at the two steps that bound the timed window (``sync_steps``), so the
    window holds all the work queued in it, and nowhere else (a wait at every step would stall the host's run-ahead).
    """

    def __init__(self, sync_steps: tuple[int, ...] = ()) -> None:
        from transformers import TrainerCallback

        clock = self

        class _Callback(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if state.global_step in sync_steps:
                    torch.cuda.synchronize()
                clock.stamps.append(time.perf_counter())

        self.stamps: list[float] = []
        self.callback = _Callback()


def _train_once(
    name: str, setup: Setup, model: torch.nn.Module, dataset: _Windows, out_dir: str, device: str = "cpu"
) -> float:
    """Train a fresh copy of ``model`` with trainer ``name``; tokens/s after the warm-up steps."""
    from transformers import Trainer, TrainingArguments

    from hf_gpa import GPATrainer, GPATrainingArguments

    common: dict[str, Any] = dict(
        output_dir=out_dir,
        max_steps=setup.steps,
        per_device_train_batch_size=setup.batch_size,
        learning_rate=3e-3,
        weight_decay=0.1,
        adam_beta1=0.9,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, setup.steps // 10),
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=device == "cpu",
        bf16=setup.bf16,
        dataloader_num_workers=0,
        seed=0,
    )
    if name == "gpa_adamw":
        args = GPATrainingArguments(optim="gpa_adamw", gpa_inner_steps=32, gpa_mu_y=0.7, **common)
        trainer_cls: type[Trainer] = GPATrainer
    else:
        args = TrainingArguments(optim="adamw_torch_fused", **common)
        trainer_cls = Trainer
    clock = _StepClock(sync_steps=(setup.warmup, setup.steps) if device != "cpu" else ())
    trainer = trainer_cls(model=copy.deepcopy(model), args=args, train_dataset=dataset, callbacks=[clock.callback])
    trainer.train()
    timed = clock.stamps[setup.warmup - 1 :]
    return (len(timed) - 1) * setup.batch_size * setup.seq_len / (timed[-1] - timed[0])


def measure(setup: Setup, device: str = "cpu") -> dict[str, Any]:
    """Per-round tokens/s of both trainers, their medians, the ratio of medians and the median per-round ratio."""
    if setup.threads:
        torch.set_num_threads(setup.threads)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))  # the Trainer trains on the current CUDA device
    dataset = _dataset(setup)
    model = setup.build(seed=0)
    names = ("adamw_torch_fused", "gpa_adamw")
    with tempfile.TemporaryDirectory() as tmp:
        train = partial(_train_once, setup=setup, model=model, dataset=dataset, out_dir=tmp, device=device)
        train("gpa_adamw")  # untimed: kernel load or compile, caches
        rates = report.interleaved_rounds({name: partial(train, name) for name in names}, setup.rounds).samples
    for name, values in rates.items():
        logger.info("%-18s tokens/s by round: %s", name, " ".join(f"{v:.0f}" for v in values))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    ratios = [g / a for g, a in zip(rates["gpa_adamw"], rates["adamw_torch_fused"])]
    return {
        "setup": asdict(setup),
        "parameters": sum(p.numel() for p in model.parameters()),
        "device": report.device_name(device),
        "torch_threads": torch.get_num_threads(),
        "tokens_per_s": rates,
        "median_tokens_per_s": medians,
        "ratio_of_medians": medians["gpa_adamw"] / medians["adamw_torch_fused"],
        "median_round_ratio": statistics.median(ratios),
    }


def table(result: dict[str, Any]) -> str:
    """A markdown table of the medians and the ratio."""
    med = result["median_tokens_per_s"]
    lines = [
        f"{result['parameters'] / 1e6:.1f}M-parameter Llama, seq {result['setup']['seq_len']} x batch "
        f"{result['setup']['batch_size']}{', bf16 autocast' if result['setup'].get('bf16') else ''}, "
        f"{result['setup']['rounds']} rounds on {result['device']}, {result['torch_threads']} threads",
        "",
        "| trainer | optim | median tokens/s |",
        "|---|---|---|",
        f"| Trainer | adamw_torch_fused | {med['adamw_torch_fused']:.0f} |",
        f"| GPATrainer | gpa_adamw | {med['gpa_adamw']:.0f} |",
        "",
        f"ratio of medians (GPATrainer / Trainer): **{result['ratio_of_medians']:.3f}**; median per-round ratio "
        f"{result['median_round_ratio']:.3f}",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, measure, print the table and write it with the raw numbers as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda[:N] (default: cpu)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/throughput"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cuda = args.device.startswith("cuda")
    setup = QUICK if args.quick else CUDA_SETUP if cuda else CPU_SETUP
    if cuda:
        setup = Setup(**{**asdict(setup), "bf16": True})
    overrides = {k: v for k, v in (("rounds", args.rounds), ("steps", args.steps), ("threads", args.threads)) if v}
    setup = Setup(**{**asdict(setup), **overrides})
    result = measure(setup, args.device)
    text = table(result)
    print(text)
    report.write_outputs(args.out_dir, "throughput" if args.device == "cpu" else "throughput_cuda", result, text)


if __name__ == "__main__":
    main()
