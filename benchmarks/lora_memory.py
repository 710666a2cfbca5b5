"""Optimizer state memory of `--optim gpa_adamw` against AdamW when only LoRA adapters train.

A Llama-shaped model (135M parameters: vocabulary 32000, width 768, 12 layers, MLP 2048) gets LoRA adapters on
q/k/v/o; each optimizer takes one step on the adapters with random gradients, and the table reports the bytes of
its per-parameter state (z, m, v for GPA-AdamW; m, v for AdamW) against the bytes of the trainable parameters.
Only the adapters carry state: the frozen base costs nothing extra. A measurement, never a test.

    python benchmarks/lora_memory.py            # rank 16
    python benchmarks/lora_memory.py --rank 64
"""

from __future__ import annotations

import argparse

import torch

from hf_gpa import GPAAdamW

MIB = 2**20


def state_bytes(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> int:
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim() > 0)


def main() -> None:
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank r (default: 16)")
    args = parser.parse_args()
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
    )
    lora = peft.LoraConfig(r=args.rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = peft.get_peft_model(LlamaForCausalLM(config), lora)
    trainable = [p for p in model.parameters() if p.requires_grad]
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    adapter_bytes = sum(p.numel() * p.element_size() for p in trainable)
    print(f"model: {model_bytes / MIB:.0f} MiB; LoRA r={args.rank} adapters: {adapter_bytes / MIB:.1f} MiB")
    print("| optimizer | state (MiB) | x trainable | x whole model |")
    print("|---|---|---|---|")
    for name, optimizer in (
        ("gpa_adamw", GPAAdamW(trainable, lr=1e-4)),
        ("adamw_torch", torch.optim.AdamW(trainable, lr=1e-4)),
    ):
        size = state_bytes(optimizer, trainable)
        print(f"| {name} | {size / MIB:.1f} | {size / adapter_bytes:.2f} | {size / model_bytes:.3f} |")


if __name__ == "__main__":
    main()
