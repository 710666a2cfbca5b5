"""GPU checks: the optimizers' CUDA step, GPATrainer with --bf16 on CUDA, and run_clm_gpa.py under accelerate launch.

Every test that needs a GPU is marked ``gpu`` and skipped where CUDA is missing, so the default run skips them cleanly;
on a GPU machine ``python -m pytest -m gpu`` runs exactly these (``benchmarks/gpu_suite.sh`` runs them with the
benchmarks). The accelerate-launch scenario also runs on CPU, marked ``slow`` (``python -m pytest -m slow
tests/test_gpu.py``), so that its command lines and comparisons are exercised where no GPU is: there the FSDP2 config
runs as plain CPU processes (accelerate enables its FSDP plugin only on accelerators) and the DDP one over gloo.
The benchmarks' ``--device`` handling is checked on CPU in a fraction of a second.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from launching import launch_env, run_logged
from safetensors.torch import load_file
from tensors import random_params

from hf_gpa import GPA, GPAAdamW

REPO = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device: run `python -m pytest -m gpu` on a GPU machine")


def gpu(test: Callable) -> Callable:
    """Mark ``test`` as a GPU test: selected by ``-m gpu``, skipped without CUDA."""
    return pytest.mark.gpu(needs_cuda(test))


# ---------------------------------------------------------------- the CUDA step against the for-loop ground truth

# Sizes around block boundaries and one tensor far larger than a block, in three groups with their own settings.
SHAPES = [(0,), (1,), (7,), (1023,), (4097,), (257, 129), (64, 3, 3), (70_001,)]
KW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, mu_x=0.9, mu_y=0.7)
STEPS = 5

CANDIDATES: dict[str, Callable[[list[dict]], torch.optim.Optimizer]] = {
    "gpa_adamw_default": lambda groups: GPAAdamW(groups, **KW),  # fused=None: Triton on CUDA where triton imports
    "gpa_adamw_fused": lambda groups: GPAAdamW(groups, **KW, fused=True),
    "gpa_adamw_foreach": lambda groups: GPAAdamW(groups, **KW, foreach=True),
    "gpa_adamw_fused_float32_state": lambda groups: GPAAdamW(groups, **KW, fused=True, state_dtype="float32"),
    "gpa_adamw_fused_base": lambda groups: GPA(groups, base=torch.optim.AdamW, **KW, fused=True),
    "gpa_foreach_base": lambda groups: GPA(groups, base=torch.optim.AdamW, **KW, foreach=True),
}


def _groups(params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    return [
        {"params": params[:4]},
        {"params": params[4:6], "weight_decay": 0.0, "mu_x": 0.8, "mu_y": 0.9},
        {"params": params[6:], "lr": 3e-2, "mu_y": 1.0},
    ]


def _grads(dtype: torch.dtype, device: str) -> list[list[torch.Tensor]]:
    """Fixed gradients per step, independent of the weights (so that both runs see exactly the same ones)."""
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in SHAPES] for _ in range(STEPS)]


def _train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], grads: list[list[torch.Tensor]]) -> None:
    for t, step_grads in enumerate(grads):
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        for k, group in enumerate(opt.param_groups):
            group["lr"] = KW["lr"] * (1 + k) * (0.5 + 0.5 * math.cos(math.pi * t / STEPS))  # a changing schedule
        opt.step()


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable bfloat16 values lie between a and b (0: equal), across zero too."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)  # sign-magnitude -> a monotone integer scale

    return (ordered(a) - ordered(b)).abs()


def _compare_with_forloop(name: str, dtype: torch.dtype, device: str) -> None:
    """``name`` against the for-loop on ``device``, 5 steps from the same weights and gradients, at y and x."""
    grads = _grads(dtype, device)
    ref_params = random_params(SHAPES, dtype, draw_dtype=torch.float32, device=device)
    params = random_params(SHAPES, dtype, draw_dtype=torch.float32, device=device)
    # GPA's wrapper keeps y and z of bf16 parameters in float32: its for-loop twin is GPAAdamW(state_dtype="float32")
    state = {"state_dtype": "float32"} if name.endswith(("_base", "float32_state")) else {}
    ref = GPAAdamW(_groups(ref_params), **KW, foreach=False, **state)
    opt = CANDIDATES[name](_groups(params))
    _train(ref, ref_params, grads)
    _train(opt, params, grads)
    for i, (p, r) in enumerate(zip(params, ref_params)):
        assert p.dtype == r.dtype == dtype
        if dtype == torch.bfloat16:
            ulps = ulp_distance(p.detach(), r.detach()).flatten()
            far = (ulps > 1).nonzero().flatten()  # 1 ulp: the rounding of y alone
            assert far.numel() == 0, (
                f"parameter {i} {tuple(p.shape)}: {far.numel()} elements over 1 ulp (max {int(ulps.max())}), "
                f"first at flat indices {far[:12].tolist()}"
            )
        else:
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    if dtype == torch.float32:
        y = [p.detach().clone() for p in params]
        ref.eval()
        opt.eval()
        for p, r in zip(params, ref_params):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)  # x, recovered on the device
        opt.train()
        assert all(torch.equal(p, q) for p, q in zip(params, y))  # y comes back bitwise


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CANDIDATES))
def test_cuda_step_matches_forloop(name: str, dtype: torch.dtype) -> None:
    """Each CUDA path (default, fused, foreach, GPA wrapper) equals the for-loop: fp32 to rounding, bf16 to 1 ulp."""
    _compare_with_forloop(name, dtype, "cuda")


@gpu
@pytest.mark.parametrize("lr", ["float", "cpu_tensor", "cuda_tensor"])
def test_cuda_default_step_never_synchronizes(lr: str) -> None:
    """GPAAdamW's default CUDA step makes no host synchronisation (no .item(), .cpu() or blocking copy), any lr."""
    params = random_params(SHAPES, device="cuda")
    lr_value = {"float": 1e-2, "cpu_tensor": torch.tensor(1e-2), "cuda_tensor": torch.tensor(1e-2, device="cuda")}[lr]
    opt = GPAAdamW(_groups(params), **{**KW, "lr": lr_value})
    grads = _grads(torch.float32, "cuda")
    for p, g in zip(params, grads[0]):
        p.grad = g
    opt.step()  # the first step builds state and compiles kernels: one-time work may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(p).all() for p in params)


def _cuda_kernel_launches(step: Callable[[], Any]) -> int:
    """The number of CUDA kernels ``step`` launches (memory copies and sets not counted), by torch's profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return sum(1 for e in kernels if not e.name.lower().startswith(("memcpy", "memset")))


@gpu
def test_cuda_default_step_is_a_few_launches_per_bucket() -> None:
    """The default CUDA step updates 64 tensors of one dtype in a few kernel launches, far fewer than foreach's."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(int(n),) for n in torch.randint(1, 100_000, (64,), generator=gen)]
    launches = {}
    for name, flags in (("default", {}), ("foreach", {"foreach": True})):
        params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = GPAAdamW(params, **KW, **flags)
        opt.step()  # state and kernel compilation outside the count
        launches[name] = _cuda_kernel_launches(opt.step)
    assert launches["foreach"] >= 8, launches  # the profiler sees the kernels at all
    assert launches["default"] <= 6 and 2 * launches["default"] < launches["foreach"], launches


# ---------------------------------------------------------------- GPATrainer with --bf16 (autocast) on CUDA


TRAINER_DEVICE = "cuda"  # the scenario below also runs on "cpu" (CPU autocast), which is how it was checked


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Any]]:
    """A 6-step bf16 run on CUDA with evaluations every 2 steps and saves at 3 and 6, and one resumed at step 3.

    ``full_determinism`` makes the CUDA kernels (attention backward, embedding gradients) deterministic, which a
    bitwise comparison of two runs needs; the global switch is turned off again afterwards.
    """
    from helpers import run_llama

    root = tmp_path_factory.mktemp("bf16_cuda")

    def run(name: str, resume: str | None = None) -> tuple[Any, Any]:
        overrides = dict(bf16=True, full_determinism=True, eval_strategy="steps", eval_steps=2)
        overrides["use_cpu"] = TRAINER_DEVICE == "cpu"
        return run_llama(root / name, resume, **overrides)

    try:
        runs = {"full": run("full")}
        runs["resumed"] = run("resumed", resume=str(root / "full" / "checkpoint-3"))
        yield runs
    finally:
        torch.use_deterministic_algorithms(False)


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """The causal-LM loss of ``model`` on ``ids`` under bf16 autocast, as the Trainer evaluates it."""
    model = model.to(TRAINER_DEVICE).eval()
    ids = ids.to(TRAINER_DEVICE)
    with torch.no_grad(), torch.autocast(TRAINER_DEVICE, dtype=torch.bfloat16):
        return model(input_ids=ids, labels=ids).loss.item()


@gpu
def test_bf16_cuda_checkpoints_hold_x(bf16_runs: dict) -> None:
    """With --bf16 on CUDA every checkpoint's model.safetensors is x in fp32 (bitwise), not y; y is kept."""
    from helpers import assert_equal_dicts, max_abs_diff
    from transformers import LlamaForCausalLM

    trainer, snapshots = bf16_runs["full"]
    assert trainer.args.device.type == TRAINER_DEVICE and trainer.accelerator.mixed_precision == "bf16"
    for step in (3, 6):
        path = Path(trainer.args.output_dir) / f"checkpoint-{step}"
        x_file = {k: v.to(TRAINER_DEVICE) for k, v in load_file(path / "model.safetensors").items()}
        assert {t.dtype for t in x_file.values()} == {torch.float32}
        assert_equal_dicts(x_file, snapshots.saved_x[step])
        assert max_abs_diff(x_file, snapshots.saved_y[step]) > 1e-4
        assert_equal_dicts(snapshots.saved_y[step], snapshots.y[step])  # the save left y in place
        loaded = LlamaForCausalLM.from_pretrained(path).to(TRAINER_DEVICE)
        assert_equal_dicts({n: p.detach() for n, p in loaded.named_parameters()}, snapshots.saved_x[step])


@gpu
def test_bf16_cuda_evaluation_runs_at_x(bf16_runs: dict) -> None:
    """The step-6 evaluation's loss is the loss of checkpoint-6's x under bf16 autocast, not the loss at y."""
    from helpers import tiny_llama
    from transformers import LlamaForCausalLM

    trainer, snapshots = bf16_runs["full"]
    ids = trainer.eval_dataset.ids
    logged = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e and e["step"] == 6]
    at_x = _loss(LlamaForCausalLM.from_pretrained(Path(trainer.args.output_dir) / "checkpoint-6"), ids)
    at_y = tiny_llama()
    at_y.load_state_dict({n: t.cpu() for n, t in snapshots.y[6].items()})
    assert logged == [pytest.approx(at_x, rel=1e-5)]
    assert abs(_loss(at_y, ids) - at_x) > 1e-4  # x and y are told apart by the loss


@gpu
def test_bf16_cuda_resume_continues_bitwise(bf16_runs: dict) -> None:
    """Resuming the bf16 CUDA run at step 3 gives bitwise the uninterrupted run's losses and y at steps 4-6."""
    from helpers import assert_equal_dicts, train_losses

    (full, full_snaps), (resumed, resumed_snaps) = bf16_runs["full"], bf16_runs["resumed"]
    full_losses, resumed_losses = train_losses(full), train_losses(resumed)
    assert_equal_dicts(resumed_snaps.at_start[1], full_snaps.y[3])
    for step in (4, 5, 6):
        assert resumed_losses[step] == full_losses[step], step
        assert_equal_dicts(resumed_snaps.y[step], full_snaps.y[step])


# ---------------------------------------------------------------- run_clm_gpa.py under accelerate launch

CONFIGS = REPO / "configs"
LAUNCH_TIMEOUT_S = 300  # a tiny run takes 10-40 s; past this it is a hang, not slowness
TINY_LLAMA = "hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=2,num_key_value_heads=2"
VOCAB, TOKENIZER_BYTES = 512, 300_000
CLM_FLAGS: dict[str, object] = {
    "validation_split_percentage": 10,
    "max_steps": 6,
    "save_strategy": "steps",
    "save_steps": 3,
    "logging_steps": 1,
    "per_device_train_batch_size": 4,
    "per_device_eval_batch_size": 4,
    "block_size": 32,
    "max_eval_samples": 8,
    "learning_rate": 1e-2,
    "gpa_mu_x": 0.5,  # a short memory: x, y and the initial weights are far apart after 6 steps
    "gpa_mu_y": 0.7,
    "tokenizer_vocab_size": VOCAB,
    "tokenizer_train_bytes": TOKENIZER_BYTES,
    "config_overrides": TINY_LLAMA,
    "seed": 0,
    "full_determinism": "true",  # deterministic CUDA kernels: the resumed run must match bitwise
    "report_to": "none",
    "disable_tqdm": "true",
}
# One process of FSDP2 or DDP against a plain single-process run: the same global batch, so x agrees up to the
# order of the (1-rank) gradient reduction.
LAUNCH_TOL = dict(rtol=1e-4, atol=1e-5)
LAUNCHES = [
    pytest.param("fsdp2", "cuda", marks=[pytest.mark.gpu, needs_cuda], id="fsdp2-cuda"),
    pytest.param("ddp", "cuda", marks=[pytest.mark.gpu, needs_cuda], id="ddp-cuda"),
    pytest.param("fsdp2", "cpu", marks=pytest.mark.slow, id="fsdp2-cpu"),
    pytest.param("ddp", "cpu", marks=pytest.mark.slow, id="ddp-cpu"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clm_commands(config: str, device: str, corpus: Path, out: Path) -> dict[str, list[str]]:
    """The three runs of one scenario: plain single process (the oracle), launched, and launched + resumed at 3."""
    flags = [item for name, value in CLM_FLAGS.items() for item in (f"--{name}", str(value))]
    flags += ["--train_file", str(corpus)] + (["--use_cpu", "true"] if device == "cpu" else [])
    script = [str(REPO / "run_clm_gpa.py"), *flags]
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1"]
    launcher += ["--config_file", str(CONFIGS / f"accelerate_{config}.yaml"), "--main_process_port", str(_free_port())]
    return {
        "single": [sys.executable, *script, "--output_dir", str(out / "single")],
        "full": [*launcher, *script, "--output_dir", str(out / "full")],
        "resumed": [*launcher, *script, "--output_dir", str(out / "resumed"), "--resume_from_checkpoint",
                    str(out / "full" / "checkpoint-3")],
    }  # fmt: skip


@pytest.fixture(scope="module")
def clm_launches(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """Runs (once per config and device) the three commands of :func:`clm_commands`; returns their output root."""
    done: dict[tuple[str, str], Path] = {}
    root = tmp_path_factory.mktemp("clm_launch")
    cache = root / "hf_gpa_cache"
    corpus = root / "corpus.txt"

    def get(config: str, device: str) -> Path:
        if (config, device) in done:
            return done[(config, device)]
        for module in ("datasets", "evaluate"):  # imported by run_clm_gpa.py; GPU images often lack them
            pytest.importorskip(module, reason=f"run_clm_gpa.py needs {module}: pip install -e '.[examples]'")
        from hf_gpa.data import get_default_tokenizer, load_stdlib_texts

        if not corpus.exists():  # about 60 KB of stdlib source: plenty of 32-token blocks for 6 steps of 4
            corpus.write_text("".join(load_stdlib_texts("train")[:40])[:60_000])
            get_default_tokenizer(vocab_size=VOCAB, cache_dir=cache, max_train_bytes=TOKENIZER_BYTES)  # built once
        out = root / f"{config}-{device}"
        env = {**os.environ, "HF_GPA_CACHE": str(cache), "HF_DATASETS_CACHE": str(root / "datasets_cache")}
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
        env.update(TOKENIZERS_PARALLELISM="false")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        if device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""  # also on a GPU machine
        out.mkdir()
        for name, cmd in clm_commands(config, device, corpus, out).items():
            run_logged(cmd, out / f"{name}.log", env, LAUNCH_TIMEOUT_S, cwd=REPO)
        done[(config, device)] = out
        return out

    return get


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias: name kept}: the state-dict names that share a tensor with an earlier name (a tied output head)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = tensor.untyped_storage().data_ptr()
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


@pytest.mark.parametrize(("config", "device"), LAUNCHES)
def test_launch_saves_the_full_x(clm_launches: Callable, config: str, device: str) -> None:
    """Under accelerate launch (1 process) every saved model.safetensors is the full x of a plain run, loadable."""
    from transformers import AutoModelForCausalLM

    out = clm_launches(config, device)
    fsdp = config == "fsdp2" and device == "cuda"  # accelerate ignores the FSDP plugin without an accelerator
    for saved in ("checkpoint-3", "checkpoint-6", "."):
        actual, expected = (load_file(out / run / saved / "model.safetensors") for run in ("full", "single"))
        model, info = AutoModelForCausalLM.from_pretrained(out / "full" / saved, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"]
        # FSDP2's full state dict holds a tied weight once per name, each gathered into its own tensor, so
        # save_pretrained keeps lm_head.weight beside the embedding: the stock Trainer writes the same file
        # (test_stock_fsdp2_save_keeps_the_tied_alias), and from_pretrained ties it again.
        assert actual.keys() == expected.keys() | (tied_aliases(model) if fsdp else set())
        for name in actual:
            source = name if name in expected else tied_aliases(model)[name]
            assert actual[name].shape == expected[source].shape, name  # gathered, not a shard
            torch.testing.assert_close(actual[name], expected[source], **LAUNCH_TOL)
        loaded = model.state_dict()
        assert all(torch.equal(loaded[name], tensor) for name, tensor in actual.items())
    x3, x6 = (load_file(out / "single" / saved / "model.safetensors") for saved in ("checkpoint-3", "checkpoint-6"))
    moved = max((x6[n] - x3[n]).abs().max().item() for n in x6)
    assert moved > 100 * LAUNCH_TOL["atol"]  # the tolerance is far below what three training steps change
    optimizer_files = {p.name for p in (out / "full" / "checkpoint-3").iterdir() if p.name.startswith("optimizer")}
    assert optimizer_files == ({"optimizer.bin"} if fsdp else {"optimizer.pt"})  # FSDP's own optimizer saver ran


def test_stock_fsdp2_save_keeps_the_tied_alias(tmp_path: Path) -> None:
    """The stock Trainer's FSDP2 save path (full state dict, then save_pretrained), on 2 CPU ranks over gloo, writes
    a tied model's lm_head.weight beside the embedding, which from_pretrained loads without missing or unexpected
    keys: the file GPATrainer's FSDP2 save (the stock save inside ``_at_x``) is held to on CUDA above."""
    from transformers import AutoModelForCausalLM

    worker = Path(__file__).with_name("fsdp2_save_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker)]
    run_logged([*cmd, str(tmp_path)], tmp_path / "launch.log", launch_env(REPO), what="stock FSDP2 save")
    facts = json.loads((tmp_path / "facts.json").read_text())
    written = load_file(tmp_path / "stock" / "model.safetensors")
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "stock", output_loading_info=True)
    assert facts["tied"] and tied_aliases(model) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert set(written) == set(facts["state_keys"]) == set(model.state_dict())  # the alias is kept, nothing else
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.equal(written["lm_head.weight"], written["model.embed_tokens.weight"])
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied again on loading


@pytest.mark.parametrize(("config", "device"), LAUNCHES)
def test_launch_resume_ends_bitwise_equal(clm_launches: Callable, config: str, device: str) -> None:
    """A launched run resumed from checkpoint-3 logs the same losses and ends with bitwise the same saved x."""
    out = clm_launches(config, device)
    for saved in ("checkpoint-6", "."):
        full, resumed = (load_file(out / run / saved / "model.safetensors") for run in ("full", "resumed"))
        assert full.keys() == resumed.keys()
        assert all(torch.equal(full[n], resumed[n]) for n in full), saved

    def losses(run: str) -> dict[int, float]:
        state = json.loads((out / run / "trainer_state.json").read_text())
        return {e["step"]: e["loss"] for e in state["log_history"] if "loss" in e}

    full_losses, resumed_losses = losses("full"), losses("resumed")
    assert sorted(full_losses) == list(range(1, 7))
    assert all(resumed_losses[step] == full_losses[step] for step in (4, 5, 6)), (full_losses, resumed_losses)


# ---------------------------------------------------------------- the benchmarks' --device argument, on CPU


@pytest.mark.skipif(CUDA, reason="checks the refusal where CUDA is missing")
@pytest.mark.parametrize("script", ["step_time", "throughput", "memory_table", "paper_table"])
@pytest.mark.parametrize("device", ["cuda", "tpu", "cuda:x"])
def test_benchmark_refuses_an_unusable_device(
    script: str, device: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """--device cuda without CUDA, or a device name torch does not know, stops at parsing with a message naming it."""
    import importlib

    module = importlib.import_module(f"benchmarks.{script}")
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--device", device])
    assert exit_info.value.code == 2
    assert "argument --device:" in capsys.readouterr().err  # argparse's report of a rejected value


@gpu
@pytest.mark.parametrize("name", ["AdamW8bit", "PagedAdamW8bit"])
def test_gpa_around_bitsandbytes_8bit(name: str) -> None:
    """GPA around bitsandbytes' 8-bit AdamW (and its paged variant) on CUDA: mu_x = 0 is the base bitwise, eval()/
    train() are exact, and GPA's state (z in float32 + the base's 8-bit m, v) is below fp32 AdamW's 8 bytes."""
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    base = getattr(bnb.optim, name)
    shapes = [(256, 256), (256,)]  # bitsandbytes keeps tensors under 4096 elements in 32 bits

    def params() -> list[torch.nn.Parameter]:
        g = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(s, generator=g).cuda()) for s in shapes]

    def run(opt: torch.optim.Optimizer, ps: list[torch.nn.Parameter]) -> None:
        for step in range(3):
            g = torch.Generator().manual_seed(10 + step)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).cuda()
            opt.step()

    ours, theirs = params(), params()
    run(GPA(ours, base=base, lr=1e-2, mu_x=0.0, mu_y=0.7), ours)
    run(base(theirs, lr=1e-2), theirs)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))

    ps = params()
    opt = GPA(ps, base=base, lr=1e-2, mu_x=0.9, mu_y=0.7)
    run(opt, ps)
    y = [p.detach().clone() for p in ps]
    opt.eval()
    opt.train()
    assert all(torch.equal(a, b) for a, b in zip(ps, y))
    state = sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for t in [*s.values(), *s.get("base", {}).values()]
        if torch.is_tensor(t) and t.dim() > 0
    )
    assert state < 8 * sum(p.numel() for p in ps)


@pytest.mark.parametrize(("given", "current", "expected"), [("cuda", 0, "cuda:0"), ("cuda", 1, "cuda:1"),
                                                            ("cuda:1", 0, "cuda:1"), ("cpu", 0, "cpu")])  # fmt: skip
def test_benchmark_device_comes_back_indexed(
    given: str, current: int, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--device cuda is the current CUDA device by index, which torch.cuda.set_device accepts (a bare "cuda" it
    refuses with "Expected a torch.device with a specified index"); CUDA is mocked, 2 devices."""
    from benchmarks.devices import device_arg

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    device = device_arg(given)
    assert device == expected
    if device != "cpu":
        # the check torch.cuda.set_device makes first, before it touches the driver
        assert torch.cuda._utils._get_device_index(torch.device(device)) == int(expected[-1])
    with pytest.raises(Exception, match="Expected a torch.device with a specified index"):
        torch.cuda._utils._get_device_index(torch.device("cuda"))  # what throughput.py was handed before


def test_benchmark_device_beyond_the_count_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """--device cuda:2 with 2 CUDA devices (mocked) stops at parsing with the count named."""
    import argparse

    from benchmarks.devices import device_arg

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(argparse.ArgumentTypeError, match="only 2 CUDA device"):
        device_arg("cuda:2")
