"""What the stock Trainer writes for a tied model under FSDP2, reproduced on CPU ranks (gloo).

Under FSDP2 `Trainer.save_model` gathers ``accelerator.get_state_dict(model)``, which is torch's
``get_model_state_dict(model, StateDictOptions(full_state_dict=True, cpu_offload=True, ...))``, and passes it to
``save_pretrained``. Accelerate turns its FSDP plugin on only on accelerators, so this worker takes the same two calls
directly on a ``fully_shard``-ed tiny Llama with tied embeddings. Run with ``torchrun --standalone``; rank 0 writes
``OUT/stock/`` (the model save) and ``OUT/facts.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard


def main(out: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)  # accelerate's get_state_dict for FSDP2
        if dist.get_rank() == 0:
            keys = sorted(state)  # save_pretrained empties the dict it is given as it writes
            model.save_pretrained(out / "stock", state_dict=state)
            (out / "facts.json").write_text(json.dumps({"tied": tied, "state_keys": keys}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
