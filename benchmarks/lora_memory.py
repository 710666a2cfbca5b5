"""Optimizer state memory of `--optim gpa_adamw` against AdamW when only LoRA adapters train.

A Llama-shaped model (by default 135M parameters: vocabulary 32000, width 768, 12 layers, MLP 2048) gets LoRA adapters
on q/k/v/o; each optimizer, built from its ``--optim`` value as the Trainer builds it, takes one step on the adapters
with random gradients, and the table reports the bytes of its per-parameter state (z, m, v for GPA-AdamW; m, v for
AdamW) against the bytes of the trainable parameters. Only the adapters carry state: the frozen base costs nothing
extra. A measurement, never a test.

    python -m benchmarks.lora_memory            # rank 16
    python -m benchmarks.lora_memory --rank 64
"""

from __future__ import annotations

import argparse

import torch

from benchmarks import report, workloads

MIB = 2**20


def main(argv: list[str] | None = None) -> None:
    import peft

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank r (default: 16)")
    parser.add_argument("--size", choices=sorted(workloads.LLAMA_SIZES), default="llama135m", help="the Llama shape")
    args = parser.parse_args(argv)
    lora = peft.LoraConfig(r=args.rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = peft.get_peft_model(workloads.llama(args.size, seed=0), lora)
    trainable = [p for p in model.parameters() if p.requires_grad]
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    adapter_bytes = sum(p.numel() * p.element_size() for p in trainable)
    print(f"model: {model_bytes / MIB:.0f} MiB; LoRA r={args.rank} adapters: {adapter_bytes / MIB:.1f} MiB")
    rows = []
    for optim in ("gpa_adamw", "adamw_torch"):
        optimizer = workloads.optimizer_from_flags({"optim": optim, "learning_rate": 1e-4}, trainable)
        for p in trainable:
            p.grad = torch.randn_like(p)
        optimizer.step()
        size = report.state_bytes(optimizer)
        rows.append([optim, f"{size / MIB:.1f}", f"{size / adapter_bytes:.2f}", f"{size / model_bytes:.3f}"])
    print(report.markdown_table(["optimizer", "state (MiB)", "x trainable", "x whole model"], rows, right=(1, 2, 3)))


if __name__ == "__main__":
    main()
