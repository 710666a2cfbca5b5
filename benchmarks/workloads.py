"""What the benchmarks run on, in one place: Llama configurations and their parameter lists, the Trainer's two
parameter groups, the token windows of the embedded corpus, the least-squares problem, and every optimizer built
through the one ``--optim`` table.

Why this module exists: several benchmarks step the same Llama parameter list, train the same tiny Llama on the
same corpus, or build the same optimizer; each of them takes it from here, so that a figure of one benchmark and a
figure of another speak of the same workload. Every optimizer a benchmark compares as a *training recipe* is built as
`GPATrainer` builds it: `hf_gpa.optim_table.optimizer_cls_and_kwargs` on a `GPATrainingArguments` holding the
``--optim`` flags (`optimizer_from_flags`). Only a benchmark that measures one optimizer class by itself (step_time's
for-loop, foreach and fused variants of a class) calls a class directly.

transformers is imported inside the functions that need it: the tests import the least-squares problem from here
with torch alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_gpa.optim import GPAAdamW

# ---- Llama configurations and their parameter lists ----

#: LlamaConfig fields of the parameter lists the optimizer benchmarks step (shapes read on the meta device).
LLAMA_SIZES: dict[str, dict[str, Any]] = {
    "llama58m": dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, intermediate_size=1376,
                     num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False),
    "small": dict(vocab_size=4000, hidden_size=256, num_hidden_layers=4, intermediate_size=688,
                  num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    # 219 tiny tensors (as many as the 374M Llama's): the step is host work, which this size shows on any device.
    "host_bound": dict(vocab_size=256, hidden_size=64, num_hidden_layers=24, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    # A 135M-parameter Llama shape (vocabulary 32000, width 768, 12 layers, MLP 2048, untied head).
    "llama135m": dict(vocab_size=32000, hidden_size=768, num_hidden_layers=12, intermediate_size=2048,
                      num_attention_heads=12, num_key_value_heads=12, tie_word_embeddings=False),
    # Llama 3.2 1B: grouped-query attention (8 KV heads), tied embeddings; 1.24B parameters in 146 tensors.
    "llama1b": dict(vocab_size=128256, hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                    num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
}  # fmt: skip


def llama_config(fields: str | Mapping[str, Any]) -> Any:
    """The ``LlamaConfig`` of a size of `LLAMA_SIZES` or of explicit fields; no special tokens (the models are built
    from scratch and fed token ids)."""
    from transformers import LlamaConfig

    fields = LLAMA_SIZES[fields] if isinstance(fields, str) else fields
    return LlamaConfig(**{"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **fields})


def llama(fields: str | Mapping[str, Any], seed: int | None = None, device: str | torch.device | None = None) -> Any:
    """A ``LlamaForCausalLM`` of ``fields`` (see `llama_config`), initialised from ``seed`` (torch's global seed)."""
    from transformers import LlamaForCausalLM

    config = llama_config(fields)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return LlamaForCausalLM(config)


def llama_named_shapes(size: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of the Llama ``size``, in ``model.named_parameters()`` order, without
    allocating it (the model is built on the meta device)."""
    return [(name, tuple(p.shape)) for name, p in llama(size, device="meta").named_parameters()]


def llama_shapes(size: str) -> list[tuple[int, ...]]:
    """Parameter shapes of the Llama ``size``, in ``model.parameters()`` order, without allocating it."""
    return [shape for _, shape in llama_named_shapes(size)]


#: LlamaSpec's fields under their LlamaConfig names (the others are named alike).
_CONFIG_NAMES = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "seq_len": "max_position_embeddings",
    "tie_embeddings": "tie_word_embeddings",
}


@dataclass(frozen=True)
class LlamaSpec:
    """A small Llama trained from scratch by a benchmark: the fields a run records (its JSON keeps them flat)."""

    #: the byte-level BPE's vocabulary (tokenizer and embedding)
    vocab_size: int = 512
    #: width, depth, attention heads (as many key-value heads) and the SwiGLU MLP's width
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 64
    #: tokens per training window (the model's context)
    seq_len: int = 64
    tie_embeddings: bool = True

    def llama_fields(self) -> dict[str, Any]:
        """The ``LlamaConfig`` fields of this Llama (multi-head attention, context ``seq_len``)."""
        fields = {_CONFIG_NAMES.get(f.name, f.name): getattr(self, f.name) for f in dataclasses.fields(LlamaSpec)}
        return {**fields, "num_key_value_heads": self.num_heads}

    def build(self, seed: int) -> Any:
        """The model, initialised from ``seed``."""
        return llama(self.llama_fields(), seed)


# ---- the Trainer's parameter groups ----


def is_decayed(shape: Sequence[int]) -> bool:
    """Whether the Trainer decays a parameter of these Llama models: every weight matrix and embedding (2-D) does;
    the norm weights (1-D; these models have no biases) do not. This is the split of
    ``Trainer.get_decay_parameter_names`` for them (tests/test_benchmarks.py holds it to a GPATrainer's groups)."""
    return len(shape) >= 2


def trainer_groups(params: Sequence[torch.Tensor], weight_decay: float) -> list[dict[str, Any]]:
    """``params`` as the Trainer groups them: weight decay on the weights, none on the norm weights (`is_decayed`),
    in this order, an empty group left out."""
    groups = [
        {"params": [p for p in params if is_decayed(p.shape)], "weight_decay": weight_decay},
        {"params": [p for p in params if not is_decayed(p.shape)], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


# ---- optimizers, through the --optim table ----


def training_args(**flags: Any) -> Any:
    """A `GPATrainingArguments` holding ``flags`` (``optim=...`` and the flags it reads), which checks them as the
    command line does; nothing is written anywhere (it only names an output folder)."""
    from hf_gpa import GPATrainingArguments

    return GPATrainingArguments(output_dir=os.devnull, report_to=[], **flags)


def optimizer_cls_and_kwargs(flags: Mapping[str, Any], model: torch.nn.Module | None = None) -> tuple[type, dict]:
    """The optimizer class and keyword arguments ``--optim flags["optim"]`` with ``flags`` stands for: the entry of
    the one ``--optim`` table (`hf_gpa.optim_table.optimizer_cls_and_kwargs`), as the Trainer reads it."""
    from hf_gpa.optim_table import optimizer_cls_and_kwargs as table

    return table(training_args(**flags), model)


def optimizer_from_flags(
    flags: Mapping[str, Any],
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    model: torch.nn.Module | None = None,
    *,
    weight_decay: float | None = None,
    **overrides: Any,
) -> torch.optim.Optimizer:
    """The optimizer ``--optim flags["optim"]`` builds with ``flags``, as the Trainer builds it: the class and keyword
    arguments of `hf_gpa.optim_table.optimizer_cls_and_kwargs`, given ``params`` (a list of tensors or of groups)
    unless the table builds its own groups (the Muon families, from ``model``).

    ``weight_decay``: one weight decay on every group, those of the table included (the paper bench's recipe decays
    every tensor); None keeps the groups' own. ``overrides`` replace or add keyword arguments of the table's, for a
    benchmark that varies one of them (``state_dtype``, a base class).
    """
    cls, kwargs = optimizer_cls_and_kwargs(flags, model)
    return optimizer_from_entry(cls, kwargs, params, weight_decay=weight_decay, **overrides)


def optimizer_from_entry(
    cls: type,
    kwargs: Mapping[str, Any],
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    *,
    weight_decay: float | None = None,
    **overrides: Any,
) -> torch.optim.Optimizer:
    """The optimizer of an entry of the ``--optim`` table (the class and keyword arguments `optimizer_cls_and_kwargs`
    returns), built as `optimizer_from_flags` builds it: for a process that received the entry from another one and
    need not import the Trainer's modules (a spawned benchmark process)."""
    kwargs = {**kwargs, **overrides}
    groups = list(kwargs.pop("params", params))
    if not groups or not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    if weight_decay is not None:
        groups = [{**group, "weight_decay": weight_decay} for group in groups]
    return cls(groups, **kwargs)


# ---- the embedded corpus as token windows ----


def token_windows(
    vocab_size: int,
    seq_len: int,
    val_windows: int | None,
    corpus: str = "stdlib",
    max_train_chars: int | None = None,
    cache_dir: Path | None = None,
    held_out: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train windows, validation windows) of ``corpus`` ("stdlib", "site-packages" or a directory of .py files,
    split by file; `hf_gpa.data`), tokenized by the locally trained byte-level BPE of ``vocab_size``.

    Each split's token stream (documents joined by EOS) is cut into ``seq_len`` windows; the validation windows are a
    fixed, evenly spaced subset of ``val_windows`` (`evenly_spaced`; None: every one). ``max_train_chars`` reads only
    the first documents of the train split up to that many characters. The streams are cached (tokenizing the whole
    train split takes ~15 s).

    ``held_out`` > 0: the second tensor is instead ``held_out`` windows of the validation split that share no token
    with the validation windows (`held_out_picks`, the powered table's), on which a benchmark reports what it tuned on
    the others. (The DiLoCo regime picks its own, `held_out_windows`: each record keeps the windows it was made on.)
    """
    from hf_gpa.data import corpus_root, get_default_tokenizer, load_stdlib_texts
    from hf_gpa.data.stdlib_corpus import corpus_fingerprint, default_cache_dir

    cache = (cache_dir or default_cache_dir()) / "paper_table"
    cache.mkdir(parents=True, exist_ok=True)
    root = corpus_root(corpus)
    tokenizer = get_default_tokenizer(vocab_size=vocab_size, root=root)
    streams = {}
    for split in ("train", "validation"):
        limit = max_train_chars if split == "train" else None
        path = cache / f"{split}-v{vocab_size}-c{limit}-{corpus_fingerprint(split, root)}.pt"
        if path.is_file():
            streams[split] = torch.load(path)
            continue
        texts = load_stdlib_texts(split, root)
        if limit is not None:
            kept, total = [], 0
            for text in texts:
                if total >= limit:
                    break
                kept.append(text)
                total += len(text)
            texts = kept
        ids: list[int] = []
        for encoded in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
            ids += [*encoded, tokenizer.eos_token_id]
        streams[split] = torch.tensor(ids, dtype=torch.int32)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save(streams[split], tmp)
        tmp.replace(path)
    train = streams["train"][: streams["train"].numel() // seq_len * seq_len].view(-1, seq_len)
    val_all = streams["validation"][: streams["validation"].numel() // seq_len * seq_len].view(-1, seq_len)
    if held_out:
        return train, val_all[held_out_picks(val_all.shape[0], val_windows, held_out)]
    return train, (val_all if val_windows is None else val_all[evenly_spaced(val_all.shape[0], val_windows)])


def evenly_spaced(total: int, count: int) -> torch.Tensor:
    """``count`` indices evenly spaced over ``range(total)``, the first and the last included: which validation
    windows `token_windows` keeps."""
    return torch.linspace(0, total - 1, count).round().long()


def held_out_windows(
    vocab_size: int,
    seq_len: int,
    val_windows: int,
    count: int,
    corpus: str = "stdlib",
    max_train_chars: int | None = None,
    cache_dir: Path | None = None,
) -> torch.Tensor:
    """The DiLoCo regime's held-out windows: ``count`` windows of the validation split that are none of
    `token_windows`' ``val_windows``, evenly spaced over the others, where a setting picked on the validation windows
    is reported."""
    _, every = token_windows(vocab_size, seq_len, None, corpus, max_train_chars, cache_dir)
    kept = torch.ones(every.shape[0], dtype=torch.bool)
    kept[evenly_spaced(every.shape[0], val_windows)] = False
    others = every[kept]
    if not 0 < count <= others.shape[0]:
        raise ValueError(f"Invalid held-out windows: {count} (the validation split holds {others.shape[0]} others)")
    return others[evenly_spaced(others.shape[0], count)]


def held_out_picks(total: int, val_windows: int, count: int) -> torch.Tensor:
    """The powered table's held-out windows: the indices of ``count`` windows among ``total``, evenly spaced over the
    ``val_windows - 1`` windows midway between two consecutive validation windows (`evenly_spaced`), so none is a
    validation window and each lies as far from them as the spacing allows (windows of one split, so of the same
    files, but no shared token)."""
    picks = evenly_spaced(total, val_windows)
    if not 1 <= count <= val_windows - 1 or bool((picks[1:] - picks[:-1] < 2).any()):
        raise ValueError(
            f"Invalid held-out windows: {count} (1 to {val_windows - 1}, between {val_windows} validation windows "
            f"at least 2 apart among {total})"
        )
    midway = (picks[:-1] + picks[1:]) // 2
    return midway[torch.linspace(0, val_windows - 2, count).round().long()]


def batch_order(num_windows: int, batch_size: int, steps: int, seed: int) -> torch.Tensor:
    """Window indices of every batch, shape (steps, batch_size): a function of the seed only, so every optimizer
    with the same seed sees identical batches in identical order (one epoch without repeats while it lasts)."""
    generator = torch.Generator().manual_seed(10_000 + seed)
    needed = steps * batch_size
    perms = [torch.randperm(num_windows, generator=generator) for _ in range(math.ceil(needed / num_windows))]
    return torch.cat(perms)[:needed].view(steps, batch_size)


# ---- the noisy least-squares problem (the precision tests and bf16_lowmem_study) ----


def least_squares_problem(seed: int = 0, noise: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    """(a, b, the generator that then draws the batches): 256 x 16 least squares, targets with ``noise`` std."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(256, 16, generator=gen)
    b = a @ torch.randn(16, generator=gen)
    if noise:
        b = b + noise * torch.randn(256, generator=gen)
    return a, b, gen


def least_squares_x(
    dtype: torch.dtype,
    impl: dict,
    mu_y: float = 0.3,
    steps: int = 400,
    optimizer: type = GPAAdamW,
    *,
    lr: float = 0.05,
    mu_x: float = 0.98,
    noise: float = 0.0,
) -> torch.Tensor:
    """x after a cosine-scheduled GPAAdamW (or GPA) run on least squares (seed 0); the loss is computed in float32."""
    a, b, gen = least_squares_problem(0, noise)
    w = torch.nn.Parameter(torch.zeros(16, dtype=dtype))
    opt = optimizer([w], lr=lr, mu_x=mu_x, mu_y=mu_y, **impl)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    for _ in range(steps):
        idx = torch.randint(0, 256, (32,), generator=gen)
        opt.zero_grad()
        ((a[idx] @ w.float() - b[idx]) ** 2).mean().backward()
        opt.step()
        sched.step()
    opt.eval()
    return w.detach().float()
