"""DiLoCo in one process: single-worker DiLoCo against an explicit transcription of the paper's Algorithm 2 and the
plain loop of ``diloco_simulation`` (also streaming), its argument checks, the fragments, the layout a state records.
Across processes: tests/test_diloco_distributed.py."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_simulation import ADAMW_KW, FRAGMENTS, OUTER_LR, OUTER_MOMENTUM, rank_rows, simulate
from distributed_workers import build_mlp, mse

from hf_gpa import DiLoCo
from hf_gpa.optim import saved_diloco_layout
from hf_gpa.optim.diloco.compression import chunk_numel, compress, decompress, outer_payload_bytes, outer_sent_bytes
from hf_gpa.optim.diloco.fragments import fragment_due, fragment_of_each
from hf_gpa.optim.diloco.rules import check_fragment_sizes, check_outer_dtype


def _grad(y: torch.Tensor, t: int) -> torch.Tensor:
    return torch.sin(3 * y + t) + 0.3 * y


def _bf16_diloco(size: int, seed: int, inner_steps: int, steps: int) -> tuple[torch.nn.Parameter, DiLoCo]:
    """A bf16 weight of ``size`` random entries (from ``seed``) and DiLoCo(AdamW, lr 1e-2) over it, after ``steps``
    steps on `_grad` (taken in float32)."""
    w = torch.nn.Parameter(torch.randn(size, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16))
    opt = DiLoCo([w], base=torch.optim.AdamW, inner_steps=inner_steps, lr=1e-2)
    for t in range(steps):
        w.grad = _grad(w.detach().float(), t).to(torch.bfloat16)
        opt.step()
    return w, opt


def test_matches_algorithm_2() -> None:
    """Inner AdamW steps, then every H steps the outer Nesterov step on the pseudo-gradient and the reset."""
    h, outer_lr, mu, steps = 4, 0.7, 0.9, 30
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(6, 5, generator=gen, dtype=torch.float64)

    # Algorithm 2, written out: inner weights x, slow weights x_tilde, outer buffer b.
    x = torch.nn.Parameter(init.clone())
    inner = torch.optim.AdamW([x], lr=1e-2, weight_decay=0.1, foreach=False)
    x_tilde, b = init.clone(), torch.zeros_like(init)
    for t in range(1, steps + 1):
        x.grad = _grad(x.detach(), t)
        inner.step()  # x^(t+1) = (1 - lr wd) x^(t) + lr d^(t)
        if t % h == 0:
            with torch.no_grad():
                p = x_tilde - x  # pseudo-gradient
                b = mu * b + p  # outer momentum
                x_tilde = x_tilde - outer_lr * (mu * b + p)  # Nesterov step (with the updated buffer)
                x.copy_(x_tilde)  # re-initialize the inner weights

    w = torch.nn.Parameter(init.clone())
    opt = DiLoCo(
        [w],
        base=torch.optim.AdamW,
        inner_steps=h,
        outer_lr=outer_lr,
        outer_momentum=mu,
        lr=1e-2,
        weight_decay=0.1,
        foreach=False,
    )
    for t in range(1, steps + 1):
        w.grad = _grad(w.detach(), t)
        opt.step()
    torch.testing.assert_close(w.detach(), x.detach(), rtol=0, atol=1e-12)
    opt.eval()  # evaluation weights: the slow weights
    torch.testing.assert_close(w.detach(), x_tilde, rtol=0, atol=1e-12)


def test_outer_step_is_torch_nesterov_sgd_on_pseudo_gradients() -> None:
    """The outer update equals torch.optim.SGD(nesterov=True) fed the pseudo-gradients (an independent oracle)."""
    h, steps = 3, 12
    init = torch.randn(10, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    w = torch.nn.Parameter(init.clone())
    opt = DiLoCo([w], base=torch.optim.SGD, inner_steps=h, outer_lr=0.5, outer_momentum=0.8, lr=0.05)
    slow = torch.nn.Parameter(init.clone())
    outer = torch.optim.SGD([slow], lr=0.5, momentum=0.8, nesterov=True)
    inner = init.clone()
    for t in range(1, steps + 1):
        g = _grad(w.detach(), t)
        w.grad = g
        opt.step()
        inner = inner - 0.05 * g
        if t % h == 0:
            slow.grad = slow.detach() - inner
            outer.step()
            inner = slow.detach().clone()
    torch.testing.assert_close(w.detach(), inner, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"inner_steps": 0}, "inner_steps"),
        ({"inner_steps": 2.5}, "inner_steps"),
        ({"outer_lr": 0.0}, "outer_lr"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
        ({"base": "adamw"}, "base"),
        ({"lr": -1.0}, "learning rate"),
    ],
)
def test_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    """Every out-of-range DiLoCo argument raises a ValueError naming it."""
    with pytest.raises(ValueError, match=match):
        DiLoCo([torch.nn.Parameter(torch.zeros(3))], **kwargs)


def _least_squares_loss_at_eval_weights(dtype: torch.dtype, steps: int = 300, cosine: bool = False) -> float:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(128, 32, generator=gen) / 32**0.5
    b = a @ torch.randn(32, generator=gen)
    w = torch.nn.Parameter(torch.zeros(32, dtype=dtype))
    opt = DiLoCo([w], base=torch.optim.AdamW, inner_steps=8, lr=1e-2)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps) if cosine else None
    for _ in range(steps):
        w.grad = (2 * a.T @ (a @ w.detach().float() - b) / len(b)).to(dtype)
        opt.step()
        if schedule is not None:
            schedule.step()
    opt.eval()
    return ((a @ w.detach().float() - b) ** 2).mean().item()


def test_bf16_outer_weights_are_float32_and_match_the_fp32_run() -> None:
    """bf16 parameters: outer weights and momentum in float32, so the loss at the outer weights is the fp32 run's."""
    fp32, bf16 = (_least_squares_loss_at_eval_weights(d) for d in (torch.float32, torch.bfloat16))
    assert bf16 <= 1.1 * fp32, (bf16, fp32)  # with bf16 outer state: 0.0230 against 0.0125


def test_bf16_under_a_cosine_schedule_matches_the_fp32_run() -> None:
    """bf16 parameters under a decaying lr (600 steps, H = 8): the inner weights are stepped in float32, so the loss
    at the outer weights is the fp32 run's (with bf16 inner weights: 0.177 against 0.0025)."""
    fp32, bf16 = (
        _least_squares_loss_at_eval_weights(d, steps=600, cosine=True) for d in (torch.float32, torch.bfloat16)
    )
    assert bf16 <= 1.1 * fp32, (bf16, fp32)


def test_bf16_eval_and_train_restore_both_weights_bitwise() -> None:
    """eval() shows the float32 outer weights rounded; train() gives back the inner weights; the outer stay float32."""
    w, opt = _bf16_diloco(size=40, seed=2, inner_steps=3, steps=7)
    state = opt.state[w]
    assert state["outer"].dtype == state["outer_momentum_buffer"].dtype == torch.float32
    inner, outer = w.detach().clone(), state["outer"].clone()
    opt.eval()
    assert torch.equal(w.detach(), outer.to(torch.bfloat16)) and not torch.equal(w.detach(), inner)
    opt.train()
    assert torch.equal(w.detach(), inner) and torch.equal(state["outer"], outer)
    assert torch.equal(state["inner_fp32"].to(torch.bfloat16), inner)


def _adamw_run(params: list[torch.nn.Parameter]) -> dict:
    adamw = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    for t in range(5):
        for p in params:
            p.grad = _grad(p.detach(), t)
        adamw.step()
    return adamw.state_dict()


def test_adopted_adamw_state_continues_when_the_parameters_have_no_grad() -> None:
    """Resuming an AdamW state (no .grad yet, as after a restart): the inner steps continue AdamW at step 6."""
    init = torch.randn(6, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ref = torch.nn.Parameter(init.clone())
    saved = _adamw_run([ref])
    w = torch.nn.Parameter(ref.detach().clone())
    opt = DiLoCo([w], base=torch.optim.AdamW, inner_steps=100, lr=1e-2, weight_decay=0.1)
    assert w.grad is None
    opt.load_state_dict(copy.deepcopy(saved))  # torch's loaders may alias the tensors they load
    adamw = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1)
    adamw.load_state_dict(saved)
    for t in range(5, 8):
        w.grad, ref.grad = _grad(w.detach(), t), _grad(ref.detach(), t)
        opt.step()
        adamw.step()
    assert opt.state[w]["base"]["step"].item() == 8
    torch.testing.assert_close(w.detach(), ref.detach(), rtol=0, atol=1e-13)


def test_bf16_outer_weights_written_in_eval_mode_are_kept() -> None:
    """A write into the outer weights while in eval mode (bf16) becomes the float32 outer weights, as in fp32."""
    w, opt = _bf16_diloco(size=10, seed=4, inner_steps=2, steps=3)
    inner, outer = w.detach().clone(), opt.state[w]["outer"].clone()
    opt.eval()
    with torch.no_grad():
        w[:2] = 0.5
    opt.train()
    assert torch.equal(w.detach(), inner)
    assert opt.state[w]["outer"][:2].tolist() == [0.5, 0.5] and torch.equal(opt.state[w]["outer"][2:], outer[2:])


def test_bf16_parameter_written_in_train_mode_wins_over_its_float32_inner_weights() -> None:
    """A write into a bf16 parameter in train mode (a load, clipping) becomes its float32 inner weights: eval() and
    train() keep it, and the next step starts from it."""
    w, opt = _bf16_diloco(size=10, seed=4, inner_steps=4, steps=2)
    with torch.no_grad():
        w[:3] = 0.25
    written = w.detach().clone()
    opt.eval()
    opt.train()
    assert torch.equal(w.detach(), written)
    assert opt.state[w]["inner_fp32"][:3].tolist() == [0.25] * 3
    w.grad = torch.zeros_like(w)
    opt.param_groups[0]["lr"] = 0.0
    opt.step()
    assert torch.equal(w.detach(), written)


# ---------------------------------------------------------------- workers, fragments, the layout (one process)


def _run(optimizer: DiLoCo, model: torch.nn.Module, steps: int) -> list[dict[str, list[torch.Tensor]]]:
    """Full-batch inner steps on the simulation's data; inner weights, outer weights and momentum after each."""
    history = []
    for step in range(steps):
        optimizer.zero_grad()
        mse(model, *rank_rows(step, 0, 1, torch.float32)).backward()
        optimizer.step()
        history.append(
            {
                "inner": [p.detach().clone() for p in model.parameters()],
                "outer": [optimizer.state[p]["outer"].clone() for p in model.parameters()],
                "momentum": [optimizer.state[p]["outer_momentum_buffer"].clone() for p in model.parameters()],
            }
        )
    return history


def _diloco(model: torch.nn.Module, **kwargs: Any) -> DiLoCo:
    return DiLoCo(model.parameters(), outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM, **{**ADAMW_KW, **kwargs})


@pytest.mark.parametrize("num_fragments", [1, 2, 3])
def test_single_worker_equals_the_plain_loop_bitwise(num_fragments: int) -> None:
    """One worker, P = 1 (today's DiLoCo) and streaming P = 2, 3: every inner weight, outer weight and momentum equals
    the plain loop's (``diloco_simulation``: torch's AdamW, the outer Nesterov step, each fragment at its offset)."""
    h, steps = 6, 14
    expected = simulate(num_workers=1, island_size=1, inner_steps=h, num_fragments=num_fragments, steps=steps)
    model = build_mlp(torch.float32)
    history = _run(_diloco(model, inner_steps=h, num_fragments=num_fragments), model, steps)
    for step, (held, want) in enumerate(zip(history, expected), start=1):
        for key, values in (("inner", want.inner[0]), ("outer", want.outer), ("momentum", want.momentum)):
            assert all(torch.equal(a, b) for a, b in zip(held[key], values)), (step, key)


def test_the_fragments_of_the_mlp_are_the_simulation_s() -> None:
    """The split of the MLP's 6 tensors (90, 15, 135, 9, 9, 1 elements) that the simulation writes out."""
    numels = [p.numel() for p in build_mlp(torch.float32).parameters()]
    for num_fragments, expected in FRAGMENTS.items():
        assert fragment_of_each(numels, num_fragments) == expected


def test_fragments_are_contiguous_nonempty_and_balanced() -> None:
    """For random tensor sizes: P contiguous runs, each at least one tensor; a run exceeds its share 1/P of the total
    by at most one tensor (the one whose middle lies in the share)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        n = int(torch.randint(1, 12, (1,), generator=gen))
        numels = torch.randint(0, 50, (n,), generator=gen).mul(torch.randint(0, 2, (n,), generator=gen) * 20 + 1)
        numels = numels.tolist()
        p = int(torch.randint(1, n + 1, (1,), generator=gen))
        fragments = fragment_of_each(numels, p)
        assert fragments[0] == 0 and fragments[-1] == p - 1
        assert all(b - a in (0, 1) for a, b in zip(fragments, fragments[1:])), (numels, p, fragments)
        total = sum(numels)
        for k in range(p):
            sizes = [s for s, f in zip(numels, fragments) if f == k]
            assert sizes and sum(sizes) <= total / p + max(numels) + 1e-9, (numels, p, fragments)


@pytest.mark.parametrize(("inner_steps", "num_fragments"), [(8, 1), (8, 4), (8, 3), (5, 5)])
def test_each_fragment_synchronises_once_per_period_at_its_own_step(inner_steps: int, num_fragments: int) -> None:
    """Over a period each fragment is due at exactly one step and no two at the same step (the peak is one
    fragment); P = 1 is due every H-th step, as single-worker DiLoCo."""
    for start in (1, 3 * inner_steps + 1):
        period = range(start, start + inner_steps)
        due = {k: [t for t in period if fragment_due(k, t, inner_steps, num_fragments)] for k in range(num_fragments)}
        assert all(len(steps) == 1 for steps in due.values()), due
        assert len({steps[0] for steps in due.values()}) == num_fragments
    assert [t for t in range(1, 20) if fragment_due(0, t, inner_steps, 1)] == list(range(inner_steps, 20, inner_steps))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_fragments": 0}, "Invalid num_fragments: 0 .must be an integer >= 1"),
        ({"num_fragments": 2.5}, "Invalid num_fragments"),
        ({"num_fragments": True}, "Invalid num_fragments"),
        ({"num_fragments": 7}, r"Invalid num_fragments: 7 \(must lie in \[1, 6\]: the parameters are 6 tensors"),
        ({"num_fragments": 4, "inner_steps": 3}, r"num_fragments: 4 \(must lie in \[1, inner_steps = 3\]"),
        ({"inner_steps": 0}, "Invalid inner_steps: 0"),
        ({"num_workers": 2}, "Invalid num_workers: 2 .more than one worker needs distributed=True"),
        ({"distributed": True}, "Invalid distributed: True .torch.distributed is not initialised"),
        ({"distributed": "yes"}, "Invalid distributed"),
    ],
)
def test_rejects_bad_worker_arguments(kwargs: dict, match: str) -> None:
    """H < 1, P < 1, P above the number of tensors or above H, M without distributed, distributed without a process
    group: a ValueError naming the argument and its allowed range, before anything is created."""
    with pytest.raises(ValueError, match=match):
        _diloco(build_mlp(torch.float32), **kwargs)


def test_an_added_group_with_fewer_inner_steps_than_fragments_is_refused() -> None:
    """add_param_group with inner_steps < P raises naming both, and the group is not added."""
    model = build_mlp(torch.float32)
    opt = _diloco(model, inner_steps=4, num_fragments=3)
    with pytest.raises(ValueError, match=r"num_fragments: 3 \(must lie in \[1, inner_steps = 2\]"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "inner_steps": 2})
    assert len(opt.param_groups) == 1


@pytest.fixture
def group_of_one(tmp_path: Path) -> Iterator[Any]:
    """torch.distributed initialised in this process as a gloo group of one (destroyed after the test)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_a_process_group_of_one_is_the_single_worker_bitwise(group_of_one: Any) -> None:
    """process_group=<a group of one process> runs one worker: bitwise the single-worker DiLoCo (P = 2), whose
    layout it records; a copy shares the group, pickling refuses."""
    steps = 9
    model = build_mlp(torch.float32)
    opt = _diloco(model, inner_steps=4, num_fragments=2, process_group=group_of_one)
    assert (opt.layout.world_size, opt.layout.num_workers, opt.layout.island_size) == (1, 1, 1)
    assert opt.layout.outer_group is None  # one worker: nothing to average
    grouped = _run(opt, model, steps)
    plain_model = build_mlp(torch.float32)
    plain = _run(_diloco(plain_model, inner_steps=4, num_fragments=2), plain_model, steps)
    for a, b in zip(grouped, plain):
        assert all(torch.equal(x, y) for key in a for x, y in zip(a[key], b[key]))
    assert saved_diloco_layout(opt.state_dict()) == {
        "world_size": 1, "num_workers": 1, "num_fragments": 2, "worker": 0,
    }  # fmt: skip
    assert copy.deepcopy(opt).layout.island_group is opt.layout.island_group
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(opt)


def test_distributed_on_a_single_process_is_refused(group_of_one: Any) -> None:
    """distributed=True where the default group has one process, and num_workers that does not divide it: a
    ValueError naming the argument."""
    with pytest.raises(ValueError, match=r"Invalid distributed: True on a single process \(world size 1\)"):
        _diloco(build_mlp(torch.float32), distributed=True)
    with pytest.raises(ValueError, match=r"Invalid num_workers: 2 \(must divide the world size 1"):
        _diloco(build_mlp(torch.float32), process_group=group_of_one, num_workers=2)


def test_dtensor_parameters_across_processes_only_on_the_island_mesh(group_of_one: Any) -> None:
    """FSDP2 shards (DTensor parameters) with a DiLoCo across processes: taken on a 1-D mesh over the island (here
    the one process), refused by name on a 2-D (HSDP) mesh, and refused by `GPADiLoCo` (not supported on shards
    yet). The 4-process runs are in tests/test_diloco_distributed.py."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_gpa import GPADiLoCo

    model = build_mlp(torch.float32)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    optimizer = _diloco(model, process_group=group_of_one, inner_steps=2)
    _run(optimizer, model, 2)  # an outer step on the shards
    hsdp = build_mlp(torch.float32)
    fully_shard(hsdp, mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("worker", "shard")))
    with pytest.raises(ValueError, match=r"Invalid params: a DTensor parameter \(FSDP2\) on a 2-D device mesh"):
        _diloco(hsdp, process_group=group_of_one)
    with pytest.raises(ValueError, match=r"DTensor parameters \(FSDP2 inside the islands\) with GPADiLoCo"):
        GPADiLoCo(model.parameters(), process_group=group_of_one)


def _trained_state(**kwargs: Any) -> dict[str, Any]:
    model = build_mlp(torch.float32)
    opt = _diloco(model, inner_steps=4, **kwargs)
    _run(opt, model, 5)
    return opt.state_dict()


@pytest.mark.parametrize(
    ("saved", "match"),
    [
        (
            {"world_size": 4, "num_workers": 4},
            r"saved with the world size \(processes\) = 4, this optimizer runs with 1",
        ),
        ({"num_workers": 2}, r"saved with num_workers \(M\) = 2"),
        ({"num_fragments": 2}, r"saved with num_fragments \(P\) = 2, this optimizer runs with 1"),
        ({"worker": 1}, "holds worker 1's inner weights"),
    ],
)
def test_a_state_saved_on_another_layout_is_refused_before_anything_changes(saved: dict, match: str) -> None:
    """A state dict whose recorded layout differs (world size, M, P, worker): a ValueError naming it, and the
    optimizer's state and groups are left as they were."""
    state = _trained_state()
    for group in state["param_groups"]:
        group["diloco_layout"] = {**group["diloco_layout"], **saved}
    model = build_mlp(torch.float32)
    opt = _diloco(model, inner_steps=4)
    _run(opt, model, 2)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(state)
    after = opt.state_dict()
    assert before["param_groups"] == after["param_groups"]
    assert all(torch.equal(before["state"][i][k], after["state"][i][k]) for i in before["state"] for k in ("outer",))


def test_the_layout_travels_only_in_the_state_dict() -> None:
    """state_dict() records the layout in every param group; the live groups never hold it, also after a load; a
    DiLoCo state without it loads as a single worker's (P = 1)."""
    state = _trained_state()
    assert all(g["diloco_layout"]["num_fragments"] == 1 for g in state["param_groups"])
    model = build_mlp(torch.float32)
    opt = _diloco(model, inner_steps=4)
    opt.load_state_dict(copy.deepcopy(state))
    assert all("diloco_layout" not in g for g in opt.param_groups)
    for group in state["param_groups"]:
        del group["diloco_layout"]
    opt.load_state_dict(copy.deepcopy(state))
    with pytest.raises(ValueError, match=r"num_fragments \(P\) = 1, this optimizer runs with 2"):
        _diloco(build_mlp(torch.float32), inner_steps=4, num_fragments=2).load_state_dict(state)


_CAST_KW = dict(base=torch.optim.AdamW, inner_steps=2, lr=1e-2, weight_decay=0.1)


def _cast_run(dtype: torch.dtype) -> tuple[torch.nn.Parameter, DiLoCo]:
    """DiLoCo(AdamW) over a weight of ``dtype`` after 3 steps (an outer step among them)."""
    w = torch.nn.Parameter(torch.randn(12, generator=torch.Generator().manual_seed(6)).to(dtype))
    opt = DiLoCo([w], **_CAST_KW)
    _cast_steps(opt, w, 0, 3)
    return w, opt


def _cast_steps(opt: DiLoCo, w: torch.Tensor, start: int, stop: int) -> None:
    for t in range(start, stop):  # gradients that do not depend on the weight's dtype
        w.grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(100 + t)).to(w.dtype)
        opt.step()


@pytest.mark.parametrize("how", ["live", "loaded"])
@pytest.mark.parametrize(
    "source, target",
    [
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.float32, torch.float64),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float64),
    ],
    ids=str,
)
def test_a_cast_model_steps_on_as_a_run_of_its_new_dtype(source: torch.dtype, target: torch.dtype, how: str) -> None:
    """DiLoCo(AdamW) whose parameters are cast (``model.bfloat16()``, ``.half()``, ``.double()``, ``.float()``), live
    or by loading the state into a cast copy of the model: the next steps are bitwise those of a run of the new dtype
    given the state's values, the inner weights being the float32 copy (exact) where the parameter was bf16/fp16 and
    the cast parameter otherwise (every step raised torch's "expected dtype float for 'end'")."""
    w, opt = _cast_run(source)
    state = opt.state[w]
    inner = state.get("inner_fp32", w.detach()).clone()
    values = {k: state[k].clone() for k in ("outer", "outer_momentum_buffer")}
    base = {k: v.clone() for k, v in state["base"].items()}
    if how == "live":
        w.data = w.data.to(target)
        cast, cast_opt = w, opt
    else:
        cast = torch.nn.Parameter(w.detach().to(target))
        cast_opt = DiLoCo([cast], **_CAST_KW)
        cast_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    half = target in (torch.bfloat16, torch.float16)
    ref = torch.nn.Parameter(inner.to(target))
    ref_opt = DiLoCo([ref], **_CAST_KW)
    ref_opt.init_state()
    for key, value in values.items():
        ref_opt.state[ref][key].copy_(value)
    for key, value in base.items():
        ref_opt.state[ref]["base"][key].copy_(value)
    ref_opt.param_groups[0]["inner_step"] = opt.param_groups[0]["inner_step"]
    _cast_steps(cast_opt, cast, 3, 8)
    _cast_steps(ref_opt, ref, 3, 8)
    assert torch.equal(cast.detach(), ref.detach())
    mine, theirs = cast_opt.state[cast], ref_opt.state[ref]
    keys = {"outer", "outer_momentum_buffer", "base"} | ({"inner_fp32"} if half else set())
    assert set(mine) == set(theirs) == keys
    for key in set(theirs) - {"base"}:
        assert mine[key].dtype == theirs[key].dtype and torch.equal(mine[key], theirs[key]), key
    for key, value in theirs["base"].items():
        assert mine["base"][key].dtype == value.dtype and torch.equal(mine["base"][key], value), key


def test_a_cast_in_eval_mode_keeps_both_weights() -> None:
    """eval(), the model cast (bf16 -> fp32, then fp32 -> bf16), train(): the inner weights come back exactly as the
    float32 values they were (the float32 copy of a bf16 parameter, an fp32 parameter itself) and the outer weights
    as exactly as the cast left them."""
    w, opt = _cast_run(torch.bfloat16)
    inner, outer = opt.state[w]["inner_fp32"].clone(), opt.state[w]["outer"].clone()
    opt.eval()
    w.data = w.data.float()
    opt.train()
    assert torch.equal(w.detach(), inner) and torch.equal(opt.state[w]["outer"], outer)
    assert "inner_fp32" not in opt.state[w]
    opt.eval()
    assert torch.equal(w.detach(), outer)
    w.data = w.data.to(torch.bfloat16)
    opt.train()
    assert torch.equal(opt.state[w]["inner_fp32"], inner) and torch.equal(w.detach(), inner.to(torch.bfloat16))
    assert torch.equal(opt.state[w]["outer"], outer.to(torch.bfloat16).float())  # what the cast left of them
    _cast_steps(opt, w, 3, 5)


def test_a_float64_state_into_float32_parameters_is_refused_before_anything_changes() -> None:
    """fp64 outer weights, momentum and AdamW moments cannot be held exactly by an fp32 parameter's state: the next
    step raises a ValueError naming the parameter and both dtypes, and nothing changed."""
    w, opt = _cast_run(torch.float64)
    w.data = w.data.float()
    before = w.detach().clone()
    saved = copy.deepcopy(opt.state_dict())
    w.grad = torch.ones_like(w)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] .*float64.*float32"):
        opt.step()
    assert torch.equal(w.detach(), before)
    assert all(torch.equal(a, b) for a, b in zip(_tensors(opt.state_dict()), _tensors(saved)))


def _tensors(obj: Any) -> list[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        return [t for key in sorted(obj, key=str) for t in _tensors(obj[key])]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    return []


# ---------------------------------------------------------------- the compressed outer all-reduce's wire format


@pytest.mark.parametrize("outer_dtype", ["bfloat16", "int8"])
def test_a_compressed_payload_has_the_announced_bytes_and_decompresses_to_what_the_sender_kept(outer_dtype) -> None:
    """A flat bucket of 600 elements (int8: blocks of 256, 256, 88): the payload has outer_payload_bytes' bytes (2 n in
    bf16; n + 4 x 3 in int8), its decompression is bitwise what the sender kept as sent, and the error is within half
    a step of the dtype (bf16: 2**-8 relative, its unit roundoff; int8: half the block's scale)."""
    values = torch.randn(600, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 10, 600)
    payload, kept = compress(values, outer_dtype)
    assert payload.numel() * payload.element_size() == outer_payload_bytes(600, 4, outer_dtype)
    assert outer_payload_bytes(600, 4, outer_dtype) == {"bfloat16": 1200, "int8": 612}[outer_dtype]
    assert torch.equal(decompress(payload, values, outer_dtype), kept)
    error = (kept - values).abs()
    if outer_dtype == "bfloat16":
        assert bool((error <= values.abs() * 2.0**-8).all())
    else:
        for block in range(3):
            part = slice(256 * block, 256 * (block + 1))
            assert bool((error[part] <= values[part].abs().max() / 127 / 2 * (1 + 1e-6)).all())


@pytest.mark.parametrize("outer_dtype", ["bfloat16", "int8"])
def test_values_a_compressed_dtype_holds_are_sent_exactly(outer_dtype) -> None:
    """Integers within +-127, each int8 block holding 127 (scale 1), and an all-zero block (scale 0: zeros): sent
    exactly, no residual left."""
    blocks = [torch.arange(-127.0, 128.0), torch.zeros(1), torch.tensor([127.0, -3.0, 5.0]), torch.zeros(253)]
    values = torch.cat([*blocks, torch.zeros(256)])
    _, kept = compress(values, outer_dtype)
    assert torch.equal(kept, values)


def test_the_bytes_sent_per_bucket_are_the_hand_computed_ones() -> None:
    """A float32 bucket of n = 10,240 elements (40 int8 blocks). M = 2: float32's ring all-reduce sends 2 (M - 1) / M
    x 40,960 = 40,960 bytes, the all-gather one payload: bf16 20,480, int8 10,240 + 4 x 40 = 10,400. M = 4: float32
    2 x 3 / 4 x 40,960 = 61,440; the chunks hold 2,560 elements (bf16: 10,240 / 4; int8: 10 blocks), sent 2 (M - 1) =
    6 times: bf16 6 x 5,120 = 30,720 (1/2 of float32's), int8 6 x (2,560 + 40) = 15,600 (0.254). A bucket of 259
    elements at M = 4 in int8: one block per chunk, 6 x 260 = 1,560."""
    n = 10_240
    assert [outer_sent_bytes(n, 4, dtype, 2) for dtype in ("float32", "bfloat16", "int8")] == [40_960, 20_480, 10_400]
    assert chunk_numel(n, "bfloat16", 4) == chunk_numel(n, "int8", 4) == 2_560
    assert [outer_sent_bytes(n, 4, dtype, 4) for dtype in ("float32", "bfloat16", "int8")] == [61_440, 30_720, 15_600]
    assert (chunk_numel(259, "int8", 4), outer_sent_bytes(259, 4, "int8", 4)) == (256, 1_560)
    assert (chunk_numel(259, "bfloat16", 4), outer_sent_bytes(259, 4, "bfloat16", 4)) == (65, 780)
    assert outer_sent_bytes(n, 8, "float32", 4) == 122_880  # float64 outer weights


def test_outer_dtype_refusals_name_the_argument() -> None:
    """An unknown dtype, a compressed one for a single worker, int8 with a fragment under one block: a ValueError
    naming the argument (and the fragments); a single-worker DiLoCo refuses a compressed outer dtype at
    construction."""
    with pytest.raises(ValueError, match=r"Invalid outer_dtype: 'fp8' \(one of float32, bfloat16, int8\)"):
        check_outer_dtype("fp8")
    with pytest.raises(ValueError, match=r"Invalid outer_dtype: 'bfloat16' with a single worker"):
        DiLoCo(build_mlp(torch.float32).parameters(), outer_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"Invalid outer_dtype: 'int8' with num_fragments = 2: a fragment holds 255"):
        check_fragment_sizes("int8", [300, 255])
    check_fragment_sizes("int8", [256, 256])
    check_fragment_sizes("bfloat16", [1, 1])
    assert check_outer_dtype("int8", 2) == "int8" and check_outer_dtype("bfloat16", 2) == "bfloat16"
