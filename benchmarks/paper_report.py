"""The paper comparison's report, from its JSON record alone: the speedup arithmetic, the tables (final validation
loss per method and H, every configuration, x / y / z at the end, budgets side by side) and the plots (validation
curves, speedup per H). ``python -m benchmarks.paper_table --report-only`` regenerates them.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.paper_recipe import BASELINE, LABELS, METHODS, WITH_H
from benchmarks.report import environment_text, environments_of


def steps_to_reach(steps: Sequence[float], losses: Sequence[float], target: float) -> float | None:
    """The first step at which the curve reaches ``target``, linearly interpolated between evaluation points.

    The curve starts at the first evaluation point; None if it never gets to ``target``.
    """
    for i, (step, loss) in enumerate(zip(steps, losses)):
        if loss is None or not math.isfinite(loss):
            return None
        if loss <= target:
            if i == 0:
                return float(step)
            prev_step, prev_loss = steps[i - 1], losses[i - 1]
            return prev_step + (prev_loss - target) / (prev_loss - loss) * (step - prev_step)
    return None


def speedup(steps: Sequence[float], losses: Sequence[float], target: float, total_steps: float) -> float | None:
    """The paper's speedup: percentage fewer steps than ``total_steps`` to reach ``target`` (None if never)."""
    reached = steps_to_reach(steps, losses, target)
    return None if reached is None else 100.0 * (1.0 - reached / total_steps)


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _group_full(runs: Sequence[dict[str, Any]]) -> dict[tuple[str, int | None], list[dict[str, Any]]]:
    groups: dict[tuple[str, int | None], list[dict[str, Any]]] = {}
    for run in runs:
        spec = run["spec"]
        if spec["phase"] == "full":
            groups.setdefault((spec["method"], spec["inner_steps"]), []).append(run)
    for group in groups.values():
        group.sort(key=lambda run: run["spec"]["seed"])
    return groups


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Everything the table and plots show, computed from the JSON record.

    Speedup per seed is measured against the AdamW run of the same seed (identical batches and initialisation);
    ``speedup_of_mean`` is the speedup of the seed-mean curve against the mean of AdamW's final losses.
    """
    groups = _group_full(data["runs"])
    adamw = {run["spec"]["seed"]: run for run in groups.get(("adamw", None), [])}
    summary: dict[str, Any] = {"rows": []}
    for (method, inner), runs in sorted(groups.items(), key=lambda kv: (METHODS.index(kv[0][0]), kv[0][1] or 0)):
        finals = [run["final_val"] for run in runs if run["final_val"] is not None]
        finals_train = [run["val_train"][-1] for run in runs if run["val_train"] and run["val_train"][-1] is not None]
        per_seed = []
        for run in runs:
            base = adamw.get(run["spec"]["seed"])
            if base is not None and method != "adamw":
                per_seed.append(speedup(run["steps"], run["val"], base["final_val"], run["spec"]["steps"]))
        mean_curve = None
        if adamw and all(run["steps"] == runs[0]["steps"] for run in runs) and method != "adamw":
            curve = [statistics.fmean(values) for values in zip(*(run["val"] for run in runs))]
            target = statistics.fmean(run["final_val"] for run in adamw.values())
            mean_curve = speedup(runs[0]["steps"], curve, target, runs[0]["spec"]["steps"])
        reached = [value for value in per_seed if value is not None]
        summary["rows"].append(
            {
                "method": method,
                "inner_steps": inner,
                "lr": runs[0]["spec"]["lr"],
                "mu_y": runs[0]["spec"]["mu_y"],
                "seeds": len(runs),
                "final_val": _mean_std(finals),
                "final_val_train": _mean_std(finals_train) if finals_train else None,
                "speedup": _mean_std(reached) if reached else None,
                "speedup_reached": f"{len(reached)}/{len(per_seed)}",
                "speedup_of_mean": mean_curve,
            }
        )
    return summary


def _fmt(mean_std: tuple[float, float] | None, digits: int = 4, seeds: int = 2) -> str:
    if mean_std is None or not math.isfinite(mean_std[0]):
        return "—"
    if seeds == 1:
        return f"{mean_std[0]:.{digits}f} (1 seed)"
    return f"{mean_std[0]:.{digits}f} ± {mean_std[1]:.{digits}f}"


def markdown_table(data: dict[str, Any]) -> str:
    """The paper's Table 1 at our scale (final val loss per method and H), then speedup and settings per run."""
    summary = summarize(data)
    rows = summary["rows"]
    if not rows:  # a budget run with --extras-only: no pipeline, every configuration in the table of them all
        return "\n".join(all_configurations_table(data)) + "\n"
    hs = sorted({row["inner_steps"] for row in rows if row["inner_steps"] is not None})
    lines = ["| Method | " + " | ".join(f"H = {h}" for h in hs) + " |", "|---" * (len(hs) + 1) + "|"]
    for method in METHODS:
        mine = [row for row in rows if row["method"] == method]
        if not mine:
            continue
        if mine[0]["inner_steps"] is None:
            cells = [_fmt(mine[0]["final_val"], seeds=mine[0]["seeds"])] * len(hs)
        else:
            by_h = {row["inner_steps"]: row for row in mine}
            cells = [_fmt(by_h[h]["final_val"], seeds=by_h[h]["seeds"]) if h in by_h else "—" for h in hs]
        lines.append(f"| {LABELS[method]} | " + " | ".join(cells) + " |")
        if method == "gpa":
            by_h = {row["inner_steps"]: row for row in mine}
            cells = [_fmt(by_h[h]["final_val_train"], seeds=by_h[h]["seeds"]) if h in by_h else "—" for h in hs]
            lines.append("| GPA-AdamW, loss at y | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| Method | H | lr | mu_y | seeds | final val loss | speedup vs AdamW (%) | seeds reaching "
        "| speedup of mean curve (%) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        mean_curve = row["speedup_of_mean"]
        lines.append(
            f"| {LABELS[row['method']]} | {row['inner_steps'] or '—'} | {row['lr']:g} | "
            f"{'—' if row['mu_y'] is None else row['mu_y']} | {row['seeds']} | "
            f"{_fmt(row['final_val'], seeds=row['seeds'])} | "
            f"{_fmt(row['speedup'], 2, seeds=row['seeds']) if row['method'] != 'adamw' else '—'} | "
            f"{row['speedup_reached'] if row['method'] != 'adamw' else '—'} | "
            f"{'—' if mean_curve is None else f'{mean_curve:.2f}'} |"
        )
    if any(run["spec"]["phase"] == "extra" for run in data["runs"]):
        lines += ["", *all_configurations_table(data)]
    return "\n".join(lines) + "\n"


def _fmt_gain(gain: float | None) -> str:
    return "—" if gain is None else f"{gain:.2f}"


def all_configurations_table(data: dict[str, Any]) -> list[str]:
    """Every full-budget configuration, pipeline and ``--extra`` runs together, against the best AdamW of them.

    The reference AdamW is the AdamW configuration with the most seeds and, among those, the lowest mean final
    loss; speedups pair each run with that configuration's run of the same seed.
    """
    configs = _config_groups(data)
    reference = _reference_adamw(configs)
    by_seed = {run["spec"]["seed"]: run for run in reference}
    ref_lr = reference[0]["spec"]["lr"] if reference else None
    muon_reference = _reference(configs, "muon")
    muon_lr = muon_reference[0]["spec"]["lr"] if muon_reference else None
    vs_muon = f" The last column: the Muon families' mean curve against Muon at lr {muon_lr}."
    against = f"speedups against AdamW at lr {ref_lr:g}" if reference else "no AdamW run recorded, so no speedups"
    lines = [
        f"All full-budget configurations (pipeline and extra runs); {against}." + (vs_muon if muon_reference else ""),
        "",
        "| Method | H | lr | mu_y | seeds | final val loss | at y / inner | speedup vs AdamW (%) | seeds reaching "
        "| speedup of mean curve (%) |" + (" vs Muon: speedup of mean curve (%) |" if muon_reference else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if muon_reference else ""),
    ]
    order = sorted(configs, key=lambda key: (METHODS.index(key[0]), key[1] or 0, key[2], key[3] or 0))
    for method, inner, lr, mu_y in order:
        runs = configs[(method, inner, lr, mu_y)]
        finals = [run["final_val"] for run in runs]
        at_y = [run["val_train"][-1] for run in runs if run["val_train"] and run["val_train"][-1] is not None]
        gains = [
            speedup(run["steps"], run["val"], by_seed[run["spec"]["seed"]]["final_val"], run["spec"]["steps"])
            for run in runs
            if run["spec"]["seed"] in by_seed
        ]
        reached = [gain for gain in gains if gain is not None]
        mean_gain = mean_curve_speedup(runs, reference) if method != "adamw" else None
        lines.append(
            f"| {LABELS[method]} | {inner or '—'} | {lr:g} | {'—' if mu_y is None else mu_y} | {len(runs)} | "
            f"{_fmt(_mean_std(finals), seeds=len(runs))} | "
            f"{_fmt(_mean_std(at_y), seeds=len(at_y)) if at_y else '—'} | "
            f"{_fmt(_mean_std(reached), 2, seeds=len(reached)) if reached and method != 'adamw' else '—'} | "
            f"{f'{len(reached)}/{len(gains)}' if method != 'adamw' else '—'} | {_fmt_gain(mean_gain)} |"
            + (
                f" {_fmt_gain(mean_curve_speedup(runs, muon_reference) if method in WITH_H else None)} |"
                if muon_reference and BASELINE[method] == "muon"
                else (" — |" if muon_reference else "")
            )
        )
    return lines


def _best_rows(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per method, the row of lowest mean final loss among its rows with the most seeds (the selected H)."""
    most = {row["method"]: 0 for row in rows}
    for row in rows:
        most[row["method"]] = max(most[row["method"]], row["seeds"])
    best: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row["seeds"] < most[row["method"]]:
            continue
        if row["method"] not in best or row["final_val"][0] < best[row["method"]]["final_val"][0]:
            best[row["method"]] = row
    return best


def _config_groups(data: dict[str, Any]) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    """Full-budget runs (pipeline and extra) grouped by (method, H, lr, mu_y), each group sorted by seed."""
    configs: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for run in data["runs"]:
        spec = run["spec"]
        if spec["phase"] in ("full", "extra"):
            configs.setdefault((spec["method"], spec["inner_steps"], spec["lr"], spec["mu_y"]), []).append(run)
    for runs in configs.values():
        runs.sort(key=lambda run: run["spec"]["seed"])
    return configs


def best_configurations(data: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Per method, the runs of its best full-budget configuration: most seeds first, then lowest mean final loss."""
    best: dict[str, list[dict[str, Any]]] = {}
    for (method, *_), runs in _config_groups(data).items():
        rank = (-len(runs), statistics.fmean(run["final_val"] for run in runs))
        if method not in best or rank < (-len(best[method]), statistics.fmean(r["final_val"] for r in best[method])):
            best[method] = runs
    return best


def end_iterates_table(data: dict[str, Any]) -> str:
    """Per averaging family (its best configuration, seed mean): the final validation loss at x, y and z.

    With a schedule decayed to 0, y and z stop moving and x keeps averaging their last ~1 / (1 - mu_x) steps: x
    behind y or z at the end is the averaging's lag, which a longer budget or a shorter window (smaller H) shrinks.
    Empty when no run recorded z (records written before it was measured).
    """
    lines = []
    for method, runs in best_configurations(data).items():
        if not all(run.get("final_val_z") is not None for run in runs):
            continue
        keys = ("final_val", "final_val_y", "final_val_z")
        cells = [_fmt(_mean_std([run[key] for run in runs]), seeds=len(runs)) for key in keys]
        lines.append(
            f"| {LABELS[method]} | {_config_text(runs[0]['spec'])} | {len(runs)} | " + " | ".join(cells) + " |"
        )
    if not lines:
        return ""
    intro = (
        "The averaging families at the end of the run: x (what is evaluated and saved), y (where the gradients are "
        "taken) and z (the base optimizer's iterate, from the optimizer state):"
    )
    head = ["| Method | setting | seeds | final val loss at x | at y | at z |", "|---|---|---|---|---|---|"]
    return "\n".join([intro, "", *head, *lines]) + "\n"


def _plot_curves(ax: Any, chosen: dict[str, list[dict[str, Any]]], title: str) -> None:
    lows: list[float] = []
    for method in METHODS:
        if method not in chosen:
            continue
        runs = chosen[method]
        spec = runs[0]["spec"]
        steps = runs[0]["steps"]
        curve = [statistics.fmean(values) for values in zip(*(run["val"] for run in runs))]
        detail = f"lr {spec['lr']:g}" + (f", H={spec['inner_steps']}" if spec["inner_steps"] else "")
        detail += f", mu_y {spec['mu_y']:g}" if spec["mu_y"] is not None else ""
        ax.plot(steps, curve, label=f"{LABELS[method]} ({detail})")
        lows.append(min(curve))
        if method == "gpa":
            curve_y = [statistics.fmean(values) for values in zip(*(run["val_train"] for run in runs))]
            ax.plot(steps, curve_y, linestyle=":", color=ax.lines[-1].get_color(), label="GPA-AdamW at y")
    if lows:
        ax.set_ylim(min(lows) - 0.02, min(lows) + 0.45)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot_val_loss(data: dict[str, Any], path: Path) -> None:
    """Validation loss vs steps of the best setting per method (mean over seeds), as in the paper's Figure 2b.

    Left: the settings the sweep-then-select pipeline chose. Right (when there are ``--extra`` runs): the best
    full-budget configuration of each method over pipeline and extra runs.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _group_full(data["runs"])
    pipeline = {
        method: groups[(method, row["inner_steps"])] for method, row in _best_rows(summarize(data)["rows"]).items()
    }
    has_extra = any(run["spec"]["phase"] == "extra" for run in data["runs"])
    panels = [(pipeline, "Pipeline: lr picked by the short-budget sweep (mean over seeds)")] if pipeline else []
    if has_extra:
        panels.append((best_configurations(data), "Best full-budget configuration (mean over seeds)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels) + 0.5, 4.8), squeeze=False)
    for ax, (chosen, title) in zip(axes[0], panels):
        _plot_curves(ax, chosen, title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def mean_curve_speedup(runs: Sequence[dict[str, Any]], reference: Sequence[dict[str, Any]]) -> float | None:
    """Speedup of the seed-mean validation curve of ``runs`` to the mean final loss of the ``reference`` runs."""
    if not runs or not reference or any(run["steps"] != runs[0]["steps"] for run in runs):
        return None
    curve = [statistics.fmean(values) for values in zip(*(run["val"] for run in runs))]
    target = statistics.fmean(run["final_val"] for run in reference)
    return speedup(runs[0]["steps"], curve, target, runs[0]["spec"]["steps"])


def _reference_adamw(configs: dict[tuple[Any, ...], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return _reference(configs, "adamw")


def _reference(configs: dict[tuple[Any, ...], list[dict[str, Any]]], family: str) -> list[dict[str, Any]]:
    """The runs of ``family``'s configuration with the most seeds and, among those, the lowest mean final loss."""
    mine = [runs for key, runs in configs.items() if key[0] == family]
    return min(mine, key=lambda runs: (-len(runs), statistics.fmean(r["final_val"] for r in runs)), default=[])


def plot_speedup(data: dict[str, Any], path: Path) -> None:
    """Speedup over AdamW per H for DiLoCo and GPA (seed-mean curves), as in the paper's Figure 1b.

    Left: the pipeline's settings against the pipeline's AdamW. Right (when there are ``--extra`` runs): per H the
    configuration with the most seeds and lowest mean final loss, against the best AdamW configuration.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _group_full(data["runs"])
    configs = _config_groups(data)
    hs = sorted({key[1] for key in configs if key[1] is not None})
    panels = (
        [("Pipeline settings vs the pipeline's AdamW", dict(groups), groups.get(("adamw", None), []))]
        if groups
        else []
    )
    if any(run["spec"]["phase"] == "extra" for run in data["runs"]):
        best: dict[tuple[str, int | None], list[dict[str, Any]]] = {}
        for (method, inner, *_), runs in configs.items():
            rank = (-len(runs), statistics.fmean(run["final_val"] for run in runs))
            current = best.get((method, inner))
            if current is None or rank < (-len(current), statistics.fmean(r["final_val"] for r in current)):
                best[(method, inner)] = runs
        reference = _reference_adamw(configs)
        title = f"Best configuration per H vs the best AdamW (lr {reference[0]['spec']['lr']:g})" if reference else ""
        panels.append((title, best, reference))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    muon_reference = _reference(configs, "muon")
    families = [m for m in WITH_H if any(key[0] == m for key in configs)]
    width = 0.8 / max(1, len(families))
    for ax, (title, chosen, reference) in zip(axes[0], panels):
        for k, method in enumerate(families):
            base = muon_reference if BASELINE[method] == "muon" else reference
            values = []
            for h in hs:
                gain = mean_curve_speedup(chosen.get((method, h), []), base)
                values.append(0.0 if gain is None else gain)
            offset = (k - (len(families) - 1) / 2) * width
            label = LABELS[method] + (" vs Muon" if BASELINE[method] == "muon" else "")
            ax.bar([i + offset for i in range(len(hs))], values, width, label=label)
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(hs)), [str(h) for h in hs])
        ax.set_xlabel("(effective) number of inner steps H")
        ax.set_ylabel("fewer steps to the base's final loss (%)")
        ax.set_title(title + "\n(seed-mean curves; 0: never reaches it)", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _config_text(spec: dict[str, Any]) -> str:
    text = f"lr {spec['lr']:g}"
    text += f", H {spec['inner_steps']}" if spec["inner_steps"] is not None else ""
    return text + (f", mu_y {spec['mu_y']:g}" if spec["mu_y"] is not None else "")


def budgets_table(records: Sequence[dict[str, Any]]) -> str:
    """The families at several budgets side by side (one results.json each, shortest first).

    Per budget and family: its best configuration there (most seeds, then lowest mean final loss), the final
    validation loss, and the speedup of its seed-mean curve against the best AdamW of that budget (and, for the
    Muon families, against the best Muon). Then each family's best setting of the shortest budget, run at the
    longer ones (seed 0): whether the shorter budget's choice, and the ordering of the methods, still holds.
    """
    budgets = [record["workload"]["steps"] for record in records]
    best = [best_configurations(record) for record in records]
    configs = [_config_groups(record) for record in records]
    head = " | ".join(f"{b} steps: setting | seeds | final val loss | vs AdamW (%) | vs Muon (%)" for b in budgets)
    lines = [
        "Each family's best configuration at each budget (learning rate tuned at that budget; speedups of the "
        "seed-mean curve against the best AdamW / Muon of the same budget):",
        "",
        f"| Method | {head} |",
        "|---|" + "---|---|---|---|---|" * len(budgets),
    ]
    for method in METHODS:
        if not any(method in b for b in best):
            continue
        cells = []
        for chosen, groups in zip(best, configs):
            runs = chosen.get(method)
            if not runs:
                cells.append("— | — | — | — | —")
                continue
            finals = [run["final_val"] for run in runs]
            vs_adamw = mean_curve_speedup(runs, _reference(groups, "adamw")) if method != "adamw" else None
            vs_muon = (
                mean_curve_speedup(runs, _reference(groups, "muon"))
                if BASELINE[method] == "muon" and method != "muon"
                else None
            )
            cells.append(
                f"{_config_text(runs[0]['spec'])} | {len(runs)} | {_fmt(_mean_std(finals), seeds=len(runs))} | "
                f"{_fmt_gain(vs_adamw)} | {_fmt_gain(vs_muon)}"
            )
        lines.append(f"| {LABELS[method]} | " + " | ".join(cells) + " |")
    if len(records) > 1:
        lines += [
            "",
            f"The best setting at {budgets[0]} steps run for longer (seed 0; rank among the families at that budget):",
            "",
            "| Method | setting | " + " | ".join(f"{b} steps: final val loss (rank)" for b in budgets) + " |",
            "|---|---|" + "---|" * len(budgets),
        ]
        rows: dict[str, list[float | None]] = {}
        settings: dict[str, str] = {}
        for method, runs in best[0].items():
            key = (method, runs[0]["spec"]["inner_steps"], runs[0]["spec"]["lr"], runs[0]["spec"]["mu_y"])
            settings[method] = _config_text(runs[0]["spec"])
            rows[method] = [
                next((run["final_val"] for run in groups.get(key, []) if run["spec"]["seed"] == 0), None)
                for groups in configs
            ]
        for method in METHODS:
            if method not in rows:
                continue
            cells = []
            for i, value in enumerate(rows[method]):
                if value is None:
                    cells.append("—")
                    continue
                rank = 1 + sum(1 for other in rows.values() if other[i] is not None and other[i] < value)
                cells.append(f"{value:.4f} ({rank})")
            lines.append(f"| {LABELS[method]} | {settings[method]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(json_path: Path, out_dir: Path | None = None) -> str:
    """Regenerate ``table.md``, ``val_loss.png`` and ``speedup.png`` from the JSON record; returns the table."""
    data = json.loads(json_path.read_text())
    out_dir = out_dir or json_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    workload = data["workload"]
    where = f"{workload.get('device', 'cpu')}{', bf16 autocast' if workload.get('bf16') else ''}"
    header = (
        f"Workload ({workload.get('corpus', 'stdlib')} corpus, {where}): Llama d={workload['hidden_size']} "
        f"L={workload['num_layers']} ff={workload['intermediate_size']} "
        f"vocab {workload['vocab_size']}, {data.get('parameters', '?')} parameters, seq {workload['seq_len']} x "
        f"batch {workload['batch_size']}, {workload['steps']} steps "
        f"({workload['steps'] * workload['seq_len'] * workload['batch_size'] / 1e6:.2f}M tokens), "
        f"weight decay {workload['weight_decay']:g}, eval every {workload['eval_every']} steps on "
        f"{workload['val_windows']} fixed windows.\n\n"
    )
    envs = environments_of(data)
    header += "".join(f"Measured on: {environment_text(env)}.\n" for env in envs) + ("\n" if envs else "")
    table = header + markdown_table(data)
    end = end_iterates_table(data)
    if end:
        table += "\n## x, y and z at the end\n\n" + end
    longer = sorted(json_path.parent.glob("steps*/results.json"), key=lambda path: int(path.parent.name[5:]))
    if longer:  # the longer budgets (--extras-only runs written to steps<N>/), side by side with this one
        records = [data, *(json.loads(path.read_text()) for path in longer)]
        table += "\n## Budgets side by side\n\n" + budgets_table(records)
    (out_dir / "table.md").write_text(table)
    plot_val_loss(data, out_dir / "val_loss.png")
    plot_speedup(data, out_dir / "speedup.png")
    return table
