#!/usr/bin/env python
"""DiLoCo or GPA across replica groups on torchft: the groups go on when one is lost, and one that starts late or
restarts heals from a live one. One replica group is one run of this script (one process, on its own machine or
beside the others), and torchft's lighthouse keeps the quorum of the groups.

Each group trains a causal language model (a small Llama from a config by default) with the base AdamW on its own
shard of the data, and every ``--inner_steps`` H steps the groups average their pseudo-gradients and take the outer
step, DiLoCo's Nesterov step or GPA's primal averaging (``hf_gpa.optim.DiLoCo`` / ``GPADiLoCo`` with
``hf_gpa.optim.diloco.TorchftSync``). With no failure the run is our own run across workers, bitwise. With no data
named, nothing needs the network: the Python standard library's sources (:mod:`hf_gpa.data`) and the locally trained
tokenizer of run_clm_gpa.py.

**The data position is the inner step**: group g of ``--num_replica_groups`` G reads rows g, g + G, g + 2 G, ... of
a fixed shuffle of the training blocks, batch t at inner step t. A group that (re)joins heals its peers' inner step
and reads its own shard from there, where it would be in a run without failures; while it is away its rows go unread.

**Why a script and not** `GPATrainer` (``--diloco_distributed``): a group that (re)joins heals at its first quorum,
which comes after the optimizer exists, but transformers' Trainer sets its global step, epoch, the batches to skip
and its lr scheduler before it builds the optimizer (``_init_training_state``, from a checkpoint only): a healed group
would run its peers' weights with its own step 0 (schedule, data, ``max_steps`` more steps than its peers, then wait
for a quorum that never comes). Its data must be sharded by the fixed replica group and positioned by the healed inner
step, where accelerate shards by the ranks of one torch.distributed world, and the Trainer's DiLoCo across workers
(``hf_gpa.workers``) assumes that one world of W processes. Hosting it would lean on the Trainer's internals
(a callback that joins at ``on_train_begin`` and sets the global step and scheduler, a sampler that reads the position
at ``__iter__``); docs/fault_tolerance.md says what the script does instead.

Run (the lighthouse on one machine, then one group per machine; ``--min_replicas``: the fewest groups a sync may
average, the lighthouse's and the groups' alike)::

    torchft_lighthouse --min_replicas 2 --bind [::]:29510
    python run_diloco_torchft.py --lighthouse http://LIGHTHOUSE_HOST:29510 --replica_group 0 \\
        --num_replica_groups 3 --output_dir outputs/ft-0
    # ... --replica_group 1 and 2 on the other machines; restart a lost one with the same command

Each group writes ``metrics.jsonl`` (a line per logging and evaluation step), ``syncs.json`` (one record per outer
sync: its quorum, all-reduce and commit seconds, the groups it averaged, whether this group healed in it),
``all_results.json`` and, from group 0, the evaluation weights (``save_pretrained``, the outer weights; GPA: x).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_gpa.extras import requires_extra

with requires_extra("run_diloco_torchft.py", "examples"):  # transformers, tokenizers; torchft: when a group connects
    import torch
    from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, get_scheduler

    from hf_gpa.data import get_default_tokenizer, load_stdlib_texts
    from hf_gpa.example_args import RefusedArgument, run_main
    from hf_gpa.optim import DiLoCo, GPADiLoCo, check_mu_x, check_outer_lr, check_outer_momentum
    from hf_gpa.optim.diloco import check_outer_mu_y
    from hf_gpa.optim.diloco.torchft_sync import (
        DEFAULT_CONNECT_TIMEOUT_S,
        DEFAULT_MAX_RETRIES,
        DEFAULT_QUORUM_TIMEOUT_S,
        DEFAULT_TIMEOUT_S,
        TorchftSync,
        replica_group_id,
    )

logger = logging.getLogger(__name__)

#: The default model: a 2-layer Llama (hidden size 128) with the tokenizer's vocabulary, tied embeddings.
DEFAULT_LLAMA_CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
OPTIMIZERS = ("diloco", "gpa")


@dataclass
class ReplicaGroupArguments:
    """Which replica group this run is and how it meets the others (torchft)."""

    replica_group: int = field(metadata={"help": "This group's number in [0, --num_replica_groups)."})
    num_replica_groups: int = field(
        default=3,
        metadata={"help": "The groups of the run without failures (>= 1): each reads its own 1/G of the data."},
    )
    lighthouse: str = field(
        default_factory=lambda: os.environ.get("TORCHFT_LIGHTHOUSE", "http://localhost:29510"),
        metadata={"help": "The lighthouse's address, http://HOST:PORT (default: $TORCHFT_LIGHTHOUSE, else :29510)."},
    )
    min_replicas: int = field(
        default=2,
        metadata={"help": "The fewest groups an outer sync may average, in [1, --num_replica_groups]; give the "
                  "lighthouse the same --min_replicas."},
    )  # fmt: skip
    timeout_s: float = field(
        default=DEFAULT_TIMEOUT_S, metadata={"help": "Seconds for a collective, a commit vote or a heal (> 0)."}
    )
    quorum_timeout_s: float = field(
        default=DEFAULT_QUORUM_TIMEOUT_S,
        metadata={"help": "Seconds a group waits for its quorum (> 0): more than one period of H inner steps, which "
                  "a (re)joining group waits for its peers' next outer sync."},
    )  # fmt: skip
    connect_timeout_s: float = field(
        default=DEFAULT_CONNECT_TIMEOUT_S, metadata={"help": "Seconds to reach the lighthouse at the start (> 0)."}
    )
    max_retries: int = field(
        default=DEFAULT_MAX_RETRIES,
        metadata={"help": "How many times a sync whose commit failed is sent again before the run stops (>= 0)."},
    )

    def __post_init__(self) -> None:
        if self.num_replica_groups < 1:
            raise RefusedArgument(f"--num_replica_groups must be at least 1, got {self.num_replica_groups}")
        if not 0 <= self.replica_group < self.num_replica_groups:
            raise RefusedArgument(
                f"--replica_group must lie in [0, {self.num_replica_groups - 1}] (--num_replica_groups "
                f"{self.num_replica_groups}), got {self.replica_group}"
            )
        if not 1 <= self.min_replicas <= self.num_replica_groups:
            raise RefusedArgument(
                f"--min_replicas must lie in [1, {self.num_replica_groups}] (--num_replica_groups), got "
                f"{self.min_replicas}"
            )


@dataclass
class TrainingArguments:
    """What this group trains, and how."""

    output_dir: str = field(metadata={"help": "Where this group writes its metrics, syncs and results."})
    optimizer: str = field(default="gpa", metadata={"help": f"The outer algorithm: one of {', '.join(OPTIMIZERS)}."})
    max_steps: int = field(default=300, metadata={"help": "Inner steps of the run (>= 1), every group's."})
    inner_steps: int = field(default=8, metadata={"help": "H, the inner steps between outer syncs (>= 1)."})
    learning_rate: float = field(default=3e-3, metadata={"help": "The inner AdamW's peak learning rate (> 0)."})
    weight_decay: float = field(default=0.1, metadata={"help": "The inner AdamW's weight decay (>= 0)."})
    warmup_ratio: float = field(default=0.1, metadata={"help": "Linear warmup, as a part of --max_steps, in [0, 1)."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping (> 0; 0: none)."})
    outer_lr: float | None = field(
        default=None, metadata={"help": "The outer lr (unset: the optimizer's default across workers)."}
    )
    outer_momentum: float = field(default=0.9, metadata={"help": "DiLoCo's outer Nesterov momentum in [0, 1)."})
    mu_x: float = field(default=0.9, metadata={"help": "GPA's averaging constant of x per outer step, in [0, 1)."})
    mu_y: float = field(default=0.9, metadata={"help": "GPA's interpolation constant of y, in [0, 1]."})
    batch_size: int = field(default=8, metadata={"help": "Blocks per inner step and group (>= 1)."})
    block_size: int = field(default=128, metadata={"help": "Tokens per block (>= 2)."})
    train_tokens: int = field(
        default=1_000_000, metadata={"help": "Tokens of the training text, split into blocks (>= one block)."}
    )
    eval_steps: int = field(
        default=25, metadata={"help": "Evaluate the outer weights (GPA: x) every N inner steps (0: at the end)."}
    )
    eval_blocks: int = field(default=64, metadata={"help": "Validation blocks of every evaluation (>= 1)."})
    logging_steps: int = field(default=10, metadata={"help": "Log the training loss every N inner steps (>= 1)."})
    seed: int = field(default=0, metadata={"help": "The model's initial weights and the data's shuffle."})
    tokenizer_vocab_size: int = field(default=4096, metadata={"help": "The local tokenizer's vocabulary (>= 258)."})
    config_overrides: str | None = field(
        default=None, metadata={"help": "Overrides of the default Llama config, 'key=value,key=value'."}
    )

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise RefusedArgument(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        for name, low in (
            ("max_steps", 1), ("inner_steps", 1), ("batch_size", 1), ("block_size", 2), ("eval_blocks", 1),
            ("logging_steps", 1), ("eval_steps", 0), ("tokenizer_vocab_size", 258),
        ):  # fmt: skip
            if getattr(self, name) < low:
                raise RefusedArgument(f"--{name} must be at least {low}, got {getattr(self, name)}")
        if self.train_tokens < self.block_size * self.batch_size:
            raise RefusedArgument(
                f"--train_tokens must be at least --block_size x --batch_size = {self.block_size * self.batch_size}, "
                f"got {self.train_tokens}"
            )
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise RefusedArgument(f"--learning_rate must be a finite number > 0, got {self.learning_rate}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise RefusedArgument(f"--warmup_ratio must lie in [0, 1), got {self.warmup_ratio}")
        try:  # the optimizer's own checks, with the flags' names, before any work
            if self.outer_lr is not None:
                check_outer_lr(self.outer_lr, "--outer_lr")
            check_outer_momentum(self.outer_momentum, "--outer_momentum")
            check_mu_x(self.mu_x, "--mu_x")
            check_outer_mu_y(self.mu_y, "--mu_y")
        except ValueError as error:
            raise RefusedArgument(str(error)) from None


def parse_args(argv: Sequence[str] | None = None) -> tuple[ReplicaGroupArguments, TrainingArguments]:
    """Parse the command line (``argv``: the flags, default ``sys.argv[1:]``); a bad value is refused by name."""
    parser = HfArgumentParser((ReplicaGroupArguments, TrainingArguments))
    group, training = parser.parse_args_into_dataclasses(args=argv)
    return group, training


class Shards:
    """The training blocks, shuffled once (``seed``), and each group's batch at each inner step: group g of G reads
    rows g, g + G, ... of the shuffle, ``batch_size`` of them at inner step t, from row t * batch_size on (around
    again at the end); and the validation blocks."""

    def __init__(self, args: TrainingArguments, tokenizer: Any) -> None:
        self.args = args
        self.train = self._blocks(load_stdlib_texts("train"), tokenizer, args.train_tokens)
        order = torch.randperm(len(self.train), generator=torch.Generator().manual_seed(args.seed))
        self.train = self.train[order]
        self.validation = self._blocks(load_stdlib_texts("validation"), tokenizer, args.eval_blocks * args.block_size)

    def _blocks(self, texts: list[str], tokenizer: Any, tokens: int) -> torch.Tensor:
        """The first ``tokens`` tokens of ``texts`` (in a fixed shuffled order, each ended by EOS), in blocks."""
        order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(self.args.seed + 1)).tolist()
        ids: list[int] = []
        for i in order:
            ids += tokenizer(texts[i])["input_ids"] + [tokenizer.eos_token_id]
            if len(ids) >= tokens:
                break
        size = self.args.block_size
        usable = min(len(ids), tokens) // size * size
        return torch.tensor(ids[:usable]).view(-1, size)

    def batch(self, group: int, groups: int, step: int) -> torch.Tensor:
        shard = self.train[group::groups]
        rows = (torch.arange(self.args.batch_size) + step * self.args.batch_size) % len(shard)
        return shard[rows]


def build_model(args: TrainingArguments, tokenizer: Any) -> LlamaForCausalLM:
    config = LlamaConfig(**DEFAULT_LLAMA_CONFIG, vocab_size=len(tokenizer))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, name, tokenizer.eos_token_id)
    if args.config_overrides:
        config.update_from_string(args.config_overrides)
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def build_optimizer(args: TrainingArguments, model: torch.nn.Module, sync: TorchftSync) -> DiLoCo | GPADiLoCo:
    common = dict(
        inner_steps=args.inner_steps, outer_lr=args.outer_lr, sync=sync, lr=args.learning_rate,
        weight_decay=args.weight_decay,
    )  # fmt: skip
    if args.optimizer == "diloco":
        return DiLoCo(model.parameters(), outer_momentum=args.outer_momentum, **common)
    return GPADiLoCo(model.parameters(), mu_x=args.mu_x, mu_y=args.mu_y, **common)


@torch.no_grad()
def evaluate(model: torch.nn.Module, optimizer: Any, shards: Shards) -> float:
    """The validation loss at the evaluation weights (the outer weights; GPA: x), the same on every group."""
    optimizer.eval()
    model.eval()
    try:
        losses = [
            float(model(input_ids=block, labels=block).loss)
            for block in shards.validation.split(shards.args.batch_size)
        ]
    finally:
        model.train()
        optimizer.train()
    return sum(losses) / len(losses)


class Metrics:
    """``metrics.jsonl`` of the group: one JSON line per record, flushed at once (a group may be killed)."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a")  # noqa: SIM115 -- closed by close()

    def write(self, **record: Any) -> None:
        self.file.write(json.dumps({**record, "time": time.time()}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train this replica group; returns its results (``all_results.json``)."""
    group_args, args = parse_args(argv)
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO, stream=sys.stdout
    )
    # torchft logs every quorum and commit at INFO (Python and Rust): warnings only, unless RUST_LOG says otherwise.
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("RUST_LOG", "warn")
    started = time.time()
    replica = replica_group_id(group_args.replica_group, group_args.num_replica_groups)
    # The Manager first: from here on the group heartbeats, and the lighthouse waits for it at the first quorum.
    with TorchftSync.connect(
        group_args.lighthouse,
        replica,
        min_replicas=group_args.min_replicas,
        timeout_s=group_args.timeout_s,
        quorum_timeout_s=group_args.quorum_timeout_s,
        connect_timeout_s=group_args.connect_timeout_s,
        max_retries=group_args.max_retries,
    ) as sync:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        tokenizer = get_default_tokenizer(vocab_size=args.tokenizer_vocab_size)
        shards = Shards(args, tokenizer)
        model = build_model(args, tokenizer)
        optimizer = build_optimizer(args, model, sync)
        warmup = int(args.warmup_ratio * args.max_steps)
        scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=warmup, num_training_steps=args.max_steps)
        sync.heal_also("lr_scheduler", scheduler)
        logger.info(
            f"Replica group {replica} of {group_args.num_replica_groups}: {args.optimizer}, H = {args.inner_steps}, "
            f"{sum(p.numel() for p in model.parameters()):,} parameters, {len(shards.train)} training blocks; "
            f"joining through the lighthouse at {group_args.lighthouse}"
        )
        sync.join()
        joined_at = optimizer.param_groups[0]["inner_step"]
        if joined_at:  # it joined its peers' outer sync, which ends their optimizer.step(): their scheduler steps next
            scheduler.step()
        joined = time.time()
        logger.info(f"Joined at inner step {joined_at} ({joined - started:.1f} s after the start)")
        metrics = Metrics(out / "metrics.jsonl")
        metrics.write(event="joined", step=joined_at, healed=sync.records[-1].healed if sync.records else False)
        try:
            while (step := optimizer.param_groups[0]["inner_step"]) < args.max_steps:
                batch = shards.batch(group_args.replica_group, group_args.num_replica_groups, step)
                loss = model(input_ids=batch, labels=batch).loss
                loss.backward()
                if args.max_grad_norm > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                if (step + 1) % args.logging_steps == 0:
                    metrics.write(step=step + 1, loss=loss.item(), lr=scheduler.get_last_lr()[0])
                if args.eval_steps and (step + 1) % args.eval_steps == 0:
                    metrics.write(step=step + 1, eval_loss=evaluate(model, optimizer, shards))
            optimizer.synchronize()  # the steps since the last outer sync (collective: every group of the quorum)
            eval_loss = evaluate(model, optimizer, shards)
            metrics.write(step=args.max_steps, eval_loss=eval_loss, event="end")
        finally:
            metrics.close()
            (out / "syncs.json").write_text(json.dumps([dataclasses.asdict(r) for r in sync.records], indent=1))
        results = {
            "replica_group": replica,
            "eval_loss": eval_loss,
            "steps": args.max_steps,
            "joined_at_step": joined_at,
            "healed": any(r.healed for r in sync.records),
            "outer_steps": optimizer.outer_traffic.outer_steps,
            "outer_bytes": optimizer.outer_traffic.outer_bytes,
            "train_seconds": time.time() - joined,
        }
        (out / "all_results.json").write_text(json.dumps(results, indent=1))
        if group_args.replica_group == 0:
            optimizer.eval()  # the evaluation weights into the model
            model.save_pretrained(out)
            tokenizer.save_pretrained(out)
            optimizer.train()
        logger.info(f"Done: eval loss {eval_loss:.4f} at the outer weights; results in {out}")
    return results


if __name__ == "__main__":
    run_main(main)
