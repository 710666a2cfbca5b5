"""The report of ``benchmarks.powered_table``, from its JSON record alone: the tuning (each method's search, its pick,
the edges with the grid that extends them, the cost), the final runs per seed, the paired differences with their 95%
intervals, the steps to AdamW's final loss with never-reaching seeds censored at the budget, and which differences
the data decides. ``python -m benchmarks.powered_table --stage report`` regenerates ``powered_table.md`` and
``powered_table.png``.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from benchmarks.paired_stats import (
    Interval,
    mean_interval,
    paired_differences,
    steps_saved_interval,
    steps_to_target,
)
from benchmarks.paper_recipe import LABELS

#: The paper's step saving of GPA-AdamW over AdamW on Llama-160M (Table 1), set beside the measured interval.
PAPER_SAVING = 0.0871


def _methods(data: dict[str, Any]) -> list[str]:
    """The methods of the record's plan, in its order (the order of ``powered_table.METHODS``)."""
    return list(data.get("plan", {}).get("grid", {}))


def final_runs(data: dict[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    """method -> seed -> its final run."""
    finals: dict[str, dict[int, dict[str, Any]]] = {}
    for run in data["runs"]:
        if run["spec"]["phase"] == "final":
            finals.setdefault(run["spec"]["method"], {})[run["spec"]["seed"]] = run
    return finals


def complete_seeds(data: dict[str, Any]) -> list[int]:
    """The final seeds every method has finished (the ones a paired comparison can use)."""
    finals = final_runs(data)
    methods = _methods(data)
    seeds = set.intersection(*(set(finals.get(m, {})) for m in methods)) if methods else set()
    return sorted(seeds)


def _interval_or_none(values: list[float]) -> Interval | None:
    return mean_interval(values) if len(values) >= 2 else None


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """The numbers the report shows, over the complete seeds."""
    methods = _methods(data)
    finals = final_runs(data)
    seeds = complete_seeds(data)
    budget = data["workload"]["steps"]
    summary: dict[str, Any] = {"seeds": seeds, "final": {}, "gpa_minus": {}, "steps": {}}
    for method in methods:
        values = [finals[method][s]["final_val"] for s in seeds]
        finite = [v for v in values if math.isfinite(v)]
        summary["final"][method] = {
            "mean": statistics.fmean(finite) if finite else math.nan,
            "std": statistics.stdev(finite) if len(finite) > 1 else math.nan,
            "n": len(finite),
            "diverged": [s for s, v in zip(seeds, values) if not math.isfinite(v)],
        }
    if not seeds:
        return summary
    gpa = {s: finals["gpa"][s]["final_val"] for s in seeds}
    for method in methods[1:]:
        diffs = paired_differences(gpa, {s: finals[method][s]["final_val"] for s in seeds})
        finite = {s: d for s, d in diffs.items() if math.isfinite(d)}
        summary["gpa_minus"][method] = {
            "per_seed": diffs,
            "interval": _interval_or_none(list(finite.values())),
            "left_out": sorted(set(diffs) - set(finite)),  # a diverged run: named in the report, never silently
        }
    targets = {s: finals["adamw"][s]["final_val"] for s in seeds}
    for method in methods:
        if method == "adamw":
            continue
        reached = {
            s: steps_to_target(finals[method][s]["steps"], finals[method][s]["val"], targets[s], budget) for s in seeds
        }
        summary["steps"][method] = {
            "per_seed": reached,
            "censored": [s for s, r in reached.items() if r.censored],
            "steps": _interval_or_none([r.steps for r in reached.values()]),
            "saved": steps_saved_interval(list(reached.values()), budget) if len(reached) >= 2 else None,
        }
    return summary


def _config_text(config: dict[str, Any]) -> str:
    return ", ".join(f"{axis} {value:g}" for axis, value in config.items())


def decisions(summary: dict[str, Any]) -> list[str]:
    """One sentence per difference: decided (the interval excludes 0) or not."""
    lines = []
    for method, diff in summary["gpa_minus"].items():
        interval = diff["interval"]
        if interval is None:
            lines.append(f"GPA-AdamW vs {LABELS[method]}: too few seeds for an interval.")
            continue
        said = f"GPA-AdamW minus {LABELS[method]}, final loss {interval.text()} over {interval.n} seeds"
        if interval.high < 0:
            lines.append(f"{said}: **decided**, GPA-AdamW ends lower.")
        elif interval.low > 0:
            lines.append(f"{said}: **decided**, {LABELS[method]} ends lower.")
        else:
            lines.append(f"{said}: **not decided** (the interval contains 0).")
    for method, steps in summary["steps"].items():
        saved = steps["saved"]
        if saved is None:
            continue
        censored = steps["censored"]
        said = f"{LABELS[method]}, share of AdamW's steps saved to its final loss {saved.text(1, 100)}%"
        if saved.high <= 0:
            lines.append(
                f"{said}: **decided**, no steps saved ({len(censored)} of {saved.n} seeds never reach AdamW's final "
                "loss, the others reach it only at the budget)."
            )
        elif censored:
            lines.append(
                f"{said} with {len(censored)} of {saved.n} seeds never reaching it (counted as saving 0%, so the "
                "figure is an upper bound): **not decided** as a saving."
            )
        elif saved.low > 0:
            lines.append(f"{said}, every seed reaching it: **decided**, fewer steps than AdamW.")
        else:
            lines.append(f"{said}: **not decided**.")
    gpa = summary["steps"].get("gpa", {}).get("saved")
    if gpa is not None:
        inside = gpa.low <= PAPER_SAVING <= gpa.high
        lines.append(
            f"The paper's {100 * PAPER_SAVING:.2f}% (Llama-160M) lies {'inside' if inside else 'outside'} GPA-AdamW's "
            "interval here."
        )
    return lines


def cost_lines(data: dict[str, Any]) -> list[str]:
    """Runs recorded, core-hours spent, and the plan's estimate at the measured mean run time."""
    plan = data["plan"]
    runs = data["runs"]
    if not runs:
        return ["No run recorded yet."]
    tuning = data.get("tuning", {})
    methods = _methods(data)
    evaluated = {m: tuning[m].get("evaluated", tuning[m]["configurations"]) for m in methods if m in tuning}
    planned = sum(evaluated.values()) * len(plan["tuning_seeds"]) + len(plan["seeds"]) * len(methods)
    cpu = [run.get("cpu_s", run["wall_s"]) for run in runs]  # records without cpu_s: their wall time
    mean_s, wall_s = statistics.fmean(cpu), statistics.fmean(run["wall_s"] for run in runs)
    spent = f"Mean run {mean_s:.0f} s of CPU on one thread (wall {wall_s:.0f} s on a shared machine); spent " + (
        f"{sum(cpu) / 3600:.2f} core-hours"
    )
    if len(evaluated) < len(methods):
        return [f"Runs: {len(runs)} recorded; {len(evaluated)} of {len(methods)} methods tuned so far. {spent}."]
    return [
        f"Runs: {len(runs)} recorded of {planned} planned ({sum(evaluated.values())} configurations evaluated x "
        f"{len(plan['tuning_seeds'])} tuning seeds, slides included, + {len(plan['seeds'])} seeds x {len(methods)} "
        f"methods). {spent}; the plan {planned * mean_s / 3600:.1f} core-hours at that rate."
    ]


def _schedule_free_note(data: dict[str, Any]) -> list[str]:
    """What sets the two Schedule-Free rows apart, where the record has both and decays weights."""
    if not {"sf", "sf_ref"} <= set(_methods(data)) or not data["workload"]["weight_decay"]:
        return []
    return [
        "",
        f"{LABELS['sf']} and {LABELS['sf_ref']} are two optimizers, not two implementations of one: hf_gpa's decays "
        "the weights at z (the paper's Algorithm 1), schedulefree's at y. Both get a linear warm-up, then a constant "
        "lr; without weight decay they take the same steps (docs/concepts.md, tests/test_gpa.py).",
    ]


def markdown(data: dict[str, Any]) -> str:
    """The whole report as markdown."""
    w = data["workload"]
    lines = [
        f"Workload: Llama d={w['hidden_size']} L={w['num_layers']} ff={w['intermediate_size']} vocab "
        f"{w['vocab_size']} ({data.get('parameters', '?')} parameters), seq {w['seq_len']} x batch {w['batch_size']}, "
        f"{w['steps']} steps, weight decay {w['weight_decay']}, evaluated every {w['eval_every']} steps on "
        f"{w['val_windows']} fixed windows (DiLoCo at outer-step boundaries: its H divides {w['eval_every']}).",
        *_schedule_free_note(data),
        "",
        *cost_lines(data),
        "",
        "## Tuning",
        "",
        f"Seeds {data['plan']['tuning_seeds']} (never final seeds); one axis at a time from the middle of the grid; "
        "score: mean final validation loss over the tuning seeds.",
        "",
        "| Method | configurations (evaluated) | selected | search (axis: value = score) | best on an edge |",
        "|---|---|---|---|---|",
    ]
    tuning = data.get("tuning", {})
    for method in _methods(data):
        if method not in tuning:
            done = sum(1 for run in data["runs"] if run["spec"]["phase"] == "tune" and run["spec"]["method"] == method)
            lines.append(f"| {LABELS[method]} | — | not tuned yet ({done} tuning runs recorded) | — | — |")
            continue
        t = tuning[method]
        search = "; ".join(
            f"{st['axis']}: " + ", ".join(f"{v:g} = {s:.4f}" for v, s in zip(st["values"], st["scores"]))
            for st in t["stages"]
        )
        edges = "; ".join(f"{e['axis']} {e['value']:g} ({e['side']}): `{e['extend']}`" for e in t["edges"]) or "none"
        if t.get("slides"):
            edges += " (grid slid: " + "; ".join(f"`{s}`" for s in t["slides"]) + ")"
        evaluated = f" ({t['evaluated']} evaluated)" if "evaluated" in t else ""
        lines.append(
            f"| {LABELS[method]} | {t['configurations']}{evaluated} | {_config_text(t['selected'])} | {search} | "
            f"{edges} |"
        )
    summary = summarize(data)
    seeds = summary["seeds"]
    lines += ["", "## Final runs", ""]
    if not seeds:
        return "\n".join([*lines, "No seed has finished for every method yet."]) + "\n"
    finals = final_runs(data)
    methods = _methods(data)
    lines += [
        f"Seeds {seeds} (each: the same initial weights and batches for every method); final validation loss:",
        "",
        "| seed | " + " | ".join(LABELS[m] for m in methods) + " |",
        "|---" * (len(methods) + 1) + "|",
    ]
    for seed in seeds:
        lines.append(f"| {seed} | " + " | ".join(f"{finals[m][seed]['final_val']:.4f}" for m in methods) + " |")
    lines.append(
        "| mean ± std | "
        + " | ".join(f"{summary['final'][m]['mean']:.4f} ± {summary['final'][m]['std']:.4f}" for m in methods)
        + " |"
    )
    lines += [
        "",
        "Paired differences (95% Student-t intervals over the seeds):",
        "",
        "| GPA-AdamW minus | final loss: mean [95% interval] | seeds GPA lower | left out (diverged) |",
        "|---|---|---|---|",
    ]
    for method, diff in summary["gpa_minus"].items():
        interval = diff["interval"]
        lower = sum(1 for d in diff["per_seed"].values() if d < 0)
        lines.append(
            f"| {LABELS[method]} | {interval.text() if interval else '—'} | {lower}/{len(diff['per_seed'])} | "
            f"{diff['left_out'] or '—'} |"
        )
    lines += [
        "",
        "Steps to reach AdamW's final loss of the same seed (linear between evaluations; a seed that never reaches it "
        f"is censored at the budget, {w['steps']} steps, and counted there):",
        "",
        "| Method | seeds reaching | steps: mean [95% interval] | share saved: mean [95% interval] | censored seeds |",
        "|---|---|---|---|---|",
    ]
    for method, steps in summary["steps"].items():
        n = len(steps["per_seed"])
        lines.append(
            f"| {LABELS[method]} | {n - len(steps['censored'])}/{n} | "
            f"{steps['steps'].text(0, signed=False) if steps['steps'] else '—'} | "
            f"{steps['saved'].text(1, 100) + '%' if steps['saved'] else '—'} | {steps['censored'] or '—'} |"
        )
    lines += ["", "## What the data decides", "", *[f"- {line}" for line in decisions(summary)]]
    return "\n".join(lines) + "\n"


def plot(data: dict[str, Any], path: Path) -> None:
    """Left: GPA minus each method (final loss), per seed and the 95% interval. Right: share of steps saved."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarize(data)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for i, diff in enumerate(summary["gpa_minus"].values()):
        left.scatter([i] * len(diff["per_seed"]), list(diff["per_seed"].values()), s=10, alpha=0.5)
        if diff["interval"] is not None:
            iv = diff["interval"]
            left.errorbar([i + 0.15], [iv.mean], yerr=[[iv.mean - iv.low], [iv.high - iv.mean]], fmt="o", color="k")
    left.axhline(0, color="grey", lw=0.8)
    left.set_xticks(range(len(summary["gpa_minus"])), [LABELS[m] for m in summary["gpa_minus"]], fontsize=7)
    left.set_ylabel("GPA-AdamW minus method, final val loss")
    for i, steps in enumerate(summary["steps"].values()):
        if steps["saved"] is not None:
            iv = steps["saved"]
            right.errorbar([i], [100 * iv.mean], yerr=[[100 * (iv.mean - iv.low)], [100 * (iv.high - iv.mean)]],
                           fmt="o", color="k")  # fmt: skip
    right.axhline(100 * PAPER_SAVING, color="grey", ls=":", lw=0.8, label="paper, Llama-160M")
    right.set_xticks(range(len(summary["steps"])), [LABELS[m] for m in summary["steps"]], fontsize=7)
    right.set_ylabel("% of AdamW's steps saved (censored = 0)")
    right.legend(fontsize=7)
    fig.suptitle(f"{len(summary['seeds'])} seeds, 95% intervals", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(json_path: Path, out: Path) -> str:
    """Write ``powered_table.md`` (and ``powered_table.png`` once seeds are complete); return the markdown."""
    data = json.loads(json_path.read_text())
    text = markdown(data)
    out.mkdir(parents=True, exist_ok=True)
    (out / "powered_table.md").write_text(text)
    if complete_seeds(data):
        plot(data, out / "powered_table.png")
    return text
