#!/usr/bin/env python
"""Causal language model pre-training (or fine-tuning) with the GPA optimizer.

This is transformers' ``examples/pytorch/language-modeling/run_clm.py`` with two names changed
(``TrainingArguments`` -> ``GPATrainingArguments``, ``Trainer`` -> ``GPATrainer``), an offline default for every
input, and the paper's training recipe as the default. Every run_clm flag works as there; GPA adds
``--gpa_mu_x``/``--gpa_inner_steps``, ``--gpa_mu_y``, ``--gpa_averaging`` and ``--gpa_base_optim``.

With no dataset and no model named, the script needs no network:

* data: the Python standard library's own source files (:mod:`hf_gpa.data`), split into train and validation by
  a stable hash of each file's path;
* tokenizer: a byte-level BPE trained locally on the train split (cached under ``~/.cache/hf_gpa``);
* model: a small Llama built from a config (:data:`DEFAULT_LLAMA_CONFIG`);
* training: :data:`EMBEDDED_DEFAULTS` (400 steps of 8 x 256 tokens), a few minutes on 2 CPU cores.

Defaults: :data:`GPA_RECIPE_DEFAULTS` (the paper's recipe) always, :data:`EMBEDDED_DEFAULTS` when no
``--dataset_name``/``--train_file``/``--validation_file`` is given. ``hf_gpa.example_args`` says how the scripts
apply their defaults (a flag given always wins) and what else they share.

Examples::

    python run_clm_gpa.py --output_dir outputs/clm-gpa                     # the embedded default
    python run_clm_gpa.py --output_dir outputs/clm-adamw --optim adamw_torch  # the same run with AdamW
    python run_clm_gpa.py --model_name_or_path gpt2 --dataset_name wikitext \\
        --dataset_config_name wikitext-2-raw-v1 --learning_rate 5e-5 --output_dir /tmp/test-clm
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, ClassVar

from hf_gpa.extras import requires_extra

with requires_extra("run_clm_gpa.py", "examples"):  # without it, stop here with the pip command that installs it
    import datasets
    import evaluate
    import torch
    import transformers
    from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict, load_dataset
    from transformers import (
        CONFIG_MAPPING,
        MODEL_FOR_CAUSAL_LM_MAPPING,
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        EvalPrediction,
        LlamaConfig,
        PreTrainedConfig,
        PreTrainedTokenizerBase,
        default_data_collator,
        set_seed,
    )
    from transformers.testing_utils import CaptureLogger

    from hf_gpa import GPATrainer, GPATrainingArguments
    from hf_gpa.data import get_default_tokenizer, load_stdlib_texts
    from hf_gpa.example_args import (
        GPA_RECIPE_DEFAULTS,
        DataArguments,
        HubArguments,
        apply_config_overrides,
        check_model_source,
        parse_with_defaults,
        run_example,
        run_main,
        size_in_parameters,
    )
    from hf_gpa.metrics import ACCURACY

logger = logging.getLogger(__name__)

MODEL_CONFIG_CLASSES = list(MODEL_FOR_CAUSAL_LM_MAPPING.keys())
MODEL_TYPES = tuple(conf.model_type for conf in MODEL_CONFIG_CLASSES)


#: Sizing of the embedded default (stdlib corpus, small Llama): a few minutes on 2 CPU cores, with a clearly
#: falling loss. Applied unless the flag is given, and only when no dataset or data file is named.
EMBEDDED_DEFAULTS: dict[str, Any] = {
    "max_steps": 400,
    "learning_rate": 3e-3,
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 16,
    "block_size": 256,
    "logging_steps": 10,
    "save_strategy": "no",
    # A 400-step run needs a shorter averaging window than the paper's H = 32 (mu_x = 0.9967) tuned for ~10^4
    # steps: with H = 4, mu_x = 0.9 ** (1 / 4) = 0.974 and the initial weights have decayed out of x after 400 steps.
    "gpa_inner_steps": 4,
}

#: The default model: a 4-layer Llama (2,557,632 parameters with the default 4096-token vocabulary).
DEFAULT_LLAMA_CONFIG: dict[str, Any] = {
    "hidden_size": 192,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
#: How --help names the default model.
DEFAULT_MODEL_TEXT = (
    f"a small Llama ({DEFAULT_LLAMA_CONFIG['num_hidden_layers']} layers, hidden size "
    f"{DEFAULT_LLAMA_CONFIG['hidden_size']}, {DEFAULT_LLAMA_CONFIG['num_attention_heads']} attention heads, tied "
    "embeddings) with the tokenizer's vocabulary"
)


@dataclass
class ModelArguments(HubArguments):
    """Which model/config/tokenizer to fine-tune, or train from scratch."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": (
                "The model checkpoint for weights initialization. Leave unset to train a model from scratch "
                f"(by default {DEFAULT_MODEL_TEXT})."
            )
        },
    )
    model_type: str | None = field(
        default=None,
        metadata={
            "help": (
                "If training from scratch, the model type whose default config to use, one of: "
                + ", ".join(MODEL_TYPES)
                + f". Unset: {DEFAULT_MODEL_TEXT}."
            )
        },
    )
    config_overrides: str | None = field(
        default=None,
        metadata={
            "help": (
                "Override some existing default config settings when a model is trained from scratch. Example: "
                "hidden_size=64,num_hidden_layers=2"
            )
        },
    )
    tokenizer_name: str | None = field(
        default=None,
        metadata={
            "help": (
                "Pretrained tokenizer name or path if not the same as model_name. Unset (and no "
                "--model_name_or_path): a byte-level BPE trained locally on the embedded stdlib corpus."
            )
        },
    )
    tokenizer_vocab_size: int = field(
        default=4096,
        metadata={"help": "Vocabulary size of the locally trained default tokenizer (ignored otherwise)."},
    )
    tokenizer_train_bytes: int = field(
        default=4_000_000,
        metadata={"help": "How many characters of the train split the default tokenizer is trained on."},
    )
    use_fast_tokenizer: bool = field(
        default=True,
        metadata={"help": "Whether to use one of the fast tokenizer (backed by the tokenizers library) or not."},
    )
    dtype: str | None = field(
        default=None,
        metadata={
            "help": (
                "Override the default `torch.dtype` and load the model under this dtype. If `auto` is passed, the "
                "dtype will be automatically derived from the model's weights."
            ),
            "choices": ["auto", "bfloat16", "float16", "float32"],
        },
    )

    def __post_init__(self) -> None:
        check_model_source(self, MODEL_TYPES, "causal-LM")
        if self.tokenizer_vocab_size < 258:
            raise ValueError(f"--tokenizer_vocab_size must be at least 258, got {self.tokenizer_vocab_size}")
        if self.tokenizer_train_bytes <= 0:
            raise ValueError(f"--tokenizer_train_bytes must be positive, got {self.tokenizer_train_bytes}")


@dataclass
class DataTrainingArguments(DataArguments):
    """What data to train and evaluate on. No dataset or file: the embedded stdlib source corpus."""

    data_source_flags: ClassVar[tuple[str, ...]] = (*DataArguments.data_source_flags, "train_file", "validation_file")

    train_file: str | None = field(
        default=None, metadata={"help": "The input training data file (a text, json or csv file)."}
    )
    validation_file: str | None = field(
        default=None,
        metadata={"help": "An optional input evaluation data file to evaluate the perplexity on (a text file)."},
    )
    streaming: bool = field(default=False, metadata={"help": "Enable streaming mode"})
    block_size: int | None = field(
        default=None,
        metadata={
            "help": (
                "Optional input sequence length after tokenization. The training dataset will be truncated in block "
                "of this size for training. Default to the model max input length for single sentence inputs "
                "(take into account special tokens); 256 for the embedded default."
            )
        },
    )
    overwrite_cache: bool = field(
        default=False, metadata={"help": "Overwrite the cached training and evaluation sets"}
    )
    validation_split_percentage: int = field(
        default=5,
        metadata={
            "help": "The percentage of the train set used as validation set in case there's no validation split"
        },
    )
    preprocessing_num_workers: int | None = field(
        default=None, metadata={"help": "The number of processes to use for the preprocessing."}
    )
    keep_linebreaks: bool = field(
        default=True, metadata={"help": "Whether to keep line breaks when using TXT files or not."}
    )

    def __post_init__(self) -> None:
        if self.streaming:
            datasets_major = int(datasets.__version__.split(".")[0])
            if datasets_major < 2:
                raise ValueError("The streaming feature requires `datasets>=2.0.0`")
        for flag in ("train_file", "validation_file"):
            path = getattr(self, flag)
            if path is not None and path.split(".")[-1] not in ("csv", "json", "txt"):
                raise ValueError(f"--{flag} should be a csv, a json or a txt file, got {path!r}")
        if not 0 < self.validation_split_percentage < 100:
            raise ValueError(
                f"--validation_split_percentage must lie in (0, 100), got {self.validation_split_percentage}"
            )
        if self.block_size is not None and self.block_size < 2:
            raise ValueError(f"--block_size must be at least 2, got {self.block_size}")


def parse_args(
    argv: Sequence[str] | None = None,
) -> tuple[ModelArguments, DataTrainingArguments, GPATrainingArguments]:
    """Parse the command line (or one JSON file), filling in the script's defaults for flags not given."""
    return parse_with_defaults(ModelArguments, DataTrainingArguments, GPA_RECIPE_DEFAULTS, EMBEDDED_DEFAULTS, argv)


def load_raw_datasets(
    model_args: ModelArguments, data_args: DataTrainingArguments
) -> DatasetDict | IterableDatasetDict:
    """The train and validation splits as named by the flags, with a "text" column for the embedded corpus."""
    if data_args.uses_embedded_data:
        logger.info("No dataset given: using the Python standard library's source files (hf_gpa.data)")
        raw = DatasetDict(
            {split: Dataset.from_dict({"text": load_stdlib_texts(split)}) for split in ("train", "validation")}
        )
        # Files come sorted by path; shuffle them once so that --max_train_samples takes a mix of packages.
        raw["train"] = raw["train"].shuffle(seed=0).flatten_indices()
        if data_args.streaming:
            return IterableDatasetDict({split: dataset.to_iterable_dataset() for split, dataset in raw.items()})
        return raw

    common: dict[str, Any] = {"cache_dir": model_args.cache_dir, "token": model_args.token}
    if data_args.dataset_name is not None:
        name, config_name = data_args.dataset_name, data_args.dataset_config_name
        raw = load_dataset(
            name,
            config_name,
            streaming=data_args.streaming,
            trust_remote_code=model_args.trust_remote_code,
            **common,
        )
        loader_args: dict[str, Any] = {
            "path": name,
            "name": config_name,
            "streaming": data_args.streaming,
            "trust_remote_code": model_args.trust_remote_code,
        }
    else:
        data_files: dict[str, str] = {}
        dataset_args: dict[str, Any] = {}
        if data_args.train_file is not None:
            data_files["train"] = data_args.train_file
        if data_args.validation_file is not None:
            data_files["validation"] = data_args.validation_file
        extension = next(iter(data_files.values())).split(".")[-1]
        if extension == "txt":
            extension = "text"
            dataset_args["keep_linebreaks"] = data_args.keep_linebreaks
        raw = load_dataset(extension, data_files=data_files, streaming=data_args.streaming, **dataset_args, **common)
        loader_args = {"path": extension, "data_files": data_files, "streaming": data_args.streaming, **dataset_args}

    # If no validation data is there, validation_split_percentage is used to divide the dataset.
    if "validation" not in raw:
        if "train" not in raw:
            raise ValueError("No train split to take a validation split from: pass --validation_file or a dataset")
        pct = data_args.validation_split_percentage
        raw["validation"] = load_dataset(split=f"train[:{pct}%]", **loader_args, **common)
        raw["train"] = load_dataset(split=f"train[{pct}%:]", **loader_args, **common)
    return raw


def build_config(model_args: ModelArguments, tokenizer: PreTrainedTokenizerBase) -> PreTrainedConfig:
    """The model config: pretrained, a stock model type's default, or the small default Llama."""
    if model_args.config_name:
        return AutoConfig.from_pretrained(model_args.config_name, **model_args.pretrained_kwargs)
    if model_args.model_name_or_path:
        return AutoConfig.from_pretrained(model_args.model_name_or_path, **model_args.pretrained_kwargs)
    if model_args.model_type is None:
        config = LlamaConfig(**DEFAULT_LLAMA_CONFIG)
    else:
        config = CONFIG_MAPPING[model_args.model_type]()
    logger.warning("You are instantiating a new config instance from scratch.")
    # A model trained from scratch gets exactly the tokenizer's vocabulary and special tokens.
    config.vocab_size = len(tokenizer)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(tokenizer, name, None) is not None:
            setattr(config, name, getattr(tokenizer, name))
    apply_config_overrides(config, model_args.config_overrides, logger)
    return config


def build_tokenizer(model_args: ModelArguments) -> PreTrainedTokenizerBase:
    """The tokenizer: pretrained when named (or when a model is), else the locally trained stdlib BPE."""
    tokenizer_kwargs: dict[str, Any] = {"use_fast": model_args.use_fast_tokenizer, **model_args.pretrained_kwargs}
    name = model_args.tokenizer_name or model_args.model_name_or_path
    if name:
        return AutoTokenizer.from_pretrained(name, **tokenizer_kwargs)
    logger.info(f"No tokenizer given: using a byte-level BPE ({model_args.tokenizer_vocab_size}) trained on stdlib")
    return get_default_tokenizer(
        vocab_size=model_args.tokenizer_vocab_size, max_train_bytes=model_args.tokenizer_train_bytes
    )


def _split(
    lm_datasets: DatasetDict | IterableDatasetDict, name: str, flag: str, max_samples: int | None, streaming: bool
) -> Dataset | IterableDataset:
    """The split ``name`` that ``flag`` (--do_train, --do_eval) needs, cut to its first ``max_samples`` examples."""
    if name not in lm_datasets:
        raise ValueError(f"{flag} requires a {name} dataset")
    dataset = lm_datasets[name]
    if max_samples is not None:
        if streaming:
            dataset = dataset.take(max_samples)
        else:
            dataset = dataset.select(range(min(len(dataset), max_samples)))
    return dataset


def _accuracy_metrics(cache_dir: str | None) -> tuple[Callable[..., torch.Tensor], Callable[[EvalPrediction], dict]]:
    """Next-token accuracy, computed by the local `evaluate` accuracy module (no Hub access)."""
    metric = evaluate.load(ACCURACY, cache_dir=cache_dir)

    def preprocess_logits_for_metrics(logits: torch.Tensor | tuple[torch.Tensor, ...], labels: torch.Tensor) -> Any:
        if isinstance(logits, tuple):
            # Depending on the model and config, logits may contain extra tensors, like past_key_values.
            logits = logits[0]
        return logits.argmax(dim=-1)

    def compute_metrics(eval_preds: EvalPrediction) -> dict[str, float]:
        preds, labels = eval_preds
        # preds have the same shape as the labels, after the argmax(-1) has been calculated by
        # preprocess_logits_for_metrics but we need to shift the labels
        labels = labels[:, 1:].reshape(-1)
        preds = preds[:, :-1].reshape(-1)
        return metric.compute(predictions=preds, references=labels)

    return preprocess_logits_for_metrics, compute_metrics


def build_model(model_args: ModelArguments, config: PreTrainedConfig, tokenizer: PreTrainedTokenizerBase) -> Any:
    """The model: pretrained when named, else built from ``config``; its embeddings grown to the tokenizer's size."""
    if model_args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(
            model_args.model_name_or_path,
            config=config,
            **model_args.pretrained_kwargs,
            dtype=model_args.dtype,
        )
    else:
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=model_args.trust_remote_code)
        logger.info(f"Training new model from scratch - {size_in_parameters(model)}")
    # We resize the embeddings only when necessary to avoid index errors.
    embedding_size = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > embedding_size:
        model.resize_token_embeddings(len(tokenizer))
    return model


def tokenize(
    raw_datasets: DatasetDict | IterableDatasetDict,
    tokenizer: PreTrainedTokenizerBase,
    data_args: DataTrainingArguments,
    training_args: GPATrainingArguments,
) -> DatasetDict | IterableDatasetDict:
    """Every text tokenized (its text column dropped), as run_clm.py does."""
    split_for_columns = "train" if training_args.do_train else "validation"
    column_names = list(raw_datasets[split_for_columns].features)
    text_column_name = "text" if "text" in column_names else column_names[0]

    # since this will be pickled to avoid _LazyModule error in Hasher force logger loading before tokenize_function
    tok_logger = transformers.utils.logging.get_logger("transformers.tokenization_utils_base")

    def tokenize_function(examples: Mapping[str, list[str]]) -> Any:
        with CaptureLogger(tok_logger) as cl:
            output = tokenizer(examples[text_column_name])
        # clm input could be much much longer than block_size
        if "Token indices sequence length is longer than the" in cl.out:
            tok_logger.warning(
                "^^^^^^^^^^^^^^^^ Please ignore the warning above - this long input will be chunked into smaller bits"
                " before being passed to the model."
            )
        return output

    with training_args.main_process_first(desc="dataset map tokenization"):
        if data_args.streaming:
            return raw_datasets.map(tokenize_function, batched=True, remove_columns=column_names)
        return raw_datasets.map(
            tokenize_function,
            batched=True,
            num_proc=data_args.preprocessing_num_workers,
            remove_columns=column_names,
            load_from_cache_file=not data_args.overwrite_cache,
            desc="Running tokenizer on dataset",
        )


def block_size_of(
    data_args: DataTrainingArguments, tokenizer: PreTrainedTokenizerBase, config: PreTrainedConfig
) -> int:
    """The length of the training blocks: --block_size (at most the tokenizer's and the model's maximum), else the
    tokenizer's maximum length, capped at 1024 and at the model's positions."""
    max_pos_embeddings = getattr(config, "max_position_embeddings", None) or 1024
    if data_args.block_size is None:
        block_size = tokenizer.model_max_length
        if block_size > max_pos_embeddings:
            logger.warning(
                f"The tokenizer picked seems to have a very large `model_max_length` ({tokenizer.model_max_length}). "
                f"Using block_size={min(1024, max_pos_embeddings)} instead. You can change that default value by "
                "passing --block_size xxx."
            )
            block_size = min(1024, max_pos_embeddings)
        return block_size
    if data_args.block_size > tokenizer.model_max_length:
        logger.warning(
            f"The block_size passed ({data_args.block_size}) is larger than the maximum length for the model "
            f"({tokenizer.model_max_length}). Using block_size={tokenizer.model_max_length}."
        )
    block_size = min(data_args.block_size, tokenizer.model_max_length)
    if block_size > max_pos_embeddings:
        raise ValueError(
            f"--block_size {block_size} exceeds the model's max_position_embeddings ({max_pos_embeddings})"
        )
    return block_size


def group_into_blocks(
    tokenized_datasets: DatasetDict | IterableDatasetDict,
    block_size: int,
    data_args: DataTrainingArguments,
    training_args: GPATrainingArguments,
) -> DatasetDict | IterableDatasetDict:
    """All texts concatenated and cut into blocks of ``block_size`` tokens, labels = inputs, as run_clm.py does."""

    def group_texts(examples: Mapping[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        # Concatenate all texts.
        concatenated_examples = {k: list(chain(*examples[k])) for k in examples}
        total_length = len(concatenated_examples[next(iter(examples))])
        # We drop the small remainder, and if the total_length < block_size we exclude this batch and return an
        # empty dict. We could add padding if the model supported it instead of this drop.
        total_length = (total_length // block_size) * block_size
        # Split by chunks of max_len.
        result = {
            k: [t[i : i + block_size] for i in range(0, total_length, block_size)]
            for k, t in concatenated_examples.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    # Note that with `batched=True`, this map processes 1,000 texts together, so group_texts throws away a remainder
    # for each of those groups of 1,000 texts.
    with training_args.main_process_first(desc="grouping texts together"):
        if data_args.streaming:
            return tokenized_datasets.map(group_texts, batched=True)
        return tokenized_datasets.map(
            group_texts,
            batched=True,
            num_proc=data_args.preprocessing_num_workers,
            load_from_cache_file=not data_args.overwrite_cache,
            desc=f"Grouping texts in chunks of {block_size}",
        )


def build_trainer(
    model_args: ModelArguments, data_args: DataTrainingArguments, training_args: GPATrainingArguments
) -> GPATrainer:
    """The trainer `main` runs: the seeded model, the tokenizer, the datasets in blocks, the accuracy metric."""
    # Set seed before initializing model.
    set_seed(training_args.seed)

    raw_datasets = load_raw_datasets(model_args, data_args)
    tokenizer = build_tokenizer(model_args)
    config = build_config(model_args, tokenizer)
    model = build_model(model_args, config, tokenizer)
    tokenized = tokenize(raw_datasets, tokenizer, data_args, training_args)
    lm_datasets = group_into_blocks(tokenized, block_size_of(data_args, tokenizer, config), data_args, training_args)

    train_dataset = eval_dataset = None
    if training_args.do_train:
        train_dataset = _split(lm_datasets, "train", "--do_train", data_args.max_train_samples, data_args.streaming)
    preprocess_logits_for_metrics = compute_metrics = None
    if training_args.do_eval:
        eval_dataset = _split(lm_datasets, "validation", "--do_eval", data_args.max_eval_samples, data_args.streaming)
        preprocess_logits_for_metrics, compute_metrics = _accuracy_metrics(model_args.cache_dir)

    return GPATrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        # Data collator will default to DataCollatorWithPadding, so we change it.
        data_collator=default_data_collator,
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics,
    )


def add_perplexity(metrics: dict[str, float]) -> None:
    """``perplexity`` = exp(``eval_loss``), inf where that overflows."""
    try:
        metrics["perplexity"] = math.exp(metrics["eval_loss"])
    except OverflowError:
        metrics["perplexity"] = float("inf")


def model_card_kwargs(model_args: ModelArguments, data_args: DataTrainingArguments) -> dict[str, Any]:
    """What the model card says of the base model, the task and the dataset."""
    kwargs: dict[str, Any] = {"finetuned_from": model_args.model_name_or_path, "tasks": "text-generation"}
    if data_args.dataset_name is not None:
        kwargs["dataset_tags"] = data_args.dataset_name
        if data_args.dataset_config_name is not None:
            kwargs["dataset_args"] = data_args.dataset_config_name
            kwargs["dataset"] = f"{data_args.dataset_name} {data_args.dataset_config_name}"
        else:
            kwargs["dataset"] = data_args.dataset_name
    elif data_args.uses_embedded_data:
        kwargs["dataset"] = "Python standard library source (hf_gpa.data)"
    return kwargs


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Run the script on ``argv`` (default: ``sys.argv[1:]``); returns the metrics written to all_results.json."""
    return run_example(parse_args(argv), build_trainer, model_card_kwargs, logger, add_eval_metrics=add_perplexity)


if __name__ == "__main__":
    run_main(main)  # ends the process group under accelerate launch / torchrun, also when main() raises
