"""The report of ``benchmarks.powered_table``, from its JSON record alone: where the runs were made, the tuning (each
method's search, the configurations it evaluated, its pick, any pick on an edge of what was tried, the cost), the
final runs per seed on the held-out windows, the paired differences with their 95% intervals, the steps each
method's seed-mean curve saves to reach AdamW's final loss and AdamW's to reach the method's, with bootstrap
intervals that count the resamples that never reach it, and which differences the data decides.
``python -m benchmarks.powered_table --stage report`` regenerates ``powered_table.md`` and ``powered_table.png``.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from benchmarks.paired_stats import (
    CurveSaving,
    Interval,
    decided_together,
    mean_interval,
    paired_differences,
    steps_saved_bootstrap,
    steps_to_target,
)
from benchmarks.paper_recipe import LABELS
from benchmarks.report import bitwise_differences, environment_text, environments_of

#: The paper's step saving of GPA-AdamW over AdamW on Llama-160M (Table 1), set beside the measured interval.
PAPER_SAVING = 0.0871
#: Resamples of the seeds behind each bootstrap interval (fixed draws: the report is reproducible).
RESAMPLES = 10_000


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


def _finite_curve(run: dict[str, Any], budget: int) -> bool:
    return run["steps"] and run["steps"][-1] == budget and all(v is not None and math.isfinite(v) for v in run["val"])


def curve_savings(data: dict[str, Any], method: str, seeds: list[int]) -> dict[str, Any]:
    """Both directions of the seed-mean step saving between ``method`` and AdamW over ``seeds`` (`paired_stats.
    steps_saved_bootstrap`): ``to_adamw``, the share of the steps ``method``'s mean curve saves to reach AdamW's mean
    final loss; ``adamw_to``, AdamW's to reach ``method``'s. A seed whose run of either method diverged has no curve
    and is left out (``left_out``)."""
    finals, budget = final_runs(data), data["workload"]["steps"]
    kept = [s for s in seeds if _finite_curve(finals[method][s], budget) and _finite_curve(finals["adamw"][s], budget)]
    result: dict[str, Any] = {"seeds": kept, "left_out": sorted(set(seeds) - set(kept)), "to_adamw": None}
    result["adamw_to"] = None
    if len(kept) < 2:
        return result
    steps = finals["adamw"][kept[0]]["steps"]
    if any(finals[m][s]["steps"] != steps for m in (method, "adamw") for s in kept):
        raise ValueError(f"{method} and AdamW are not evaluated at the same steps; the mean curves need them")
    curves = [finals[method][s]["val"] for s in kept]
    adamw = [finals["adamw"][s]["val"] for s in kept]
    result["to_adamw"] = steps_saved_bootstrap(curves, adamw, steps, budget, resamples=RESAMPLES)
    result["adamw_to"] = steps_saved_bootstrap(adamw, curves, steps, budget, resamples=RESAMPLES)
    return result


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
            "per_seed": reached,  # descriptive: how many seeds reach AdamW's final loss of the same seed
            "censored": [s for s, r in reached.items() if r.censored],
            **curve_savings(data, method, seeds),
        }
    return summary


def _config_text(config: dict[str, Any]) -> str:
    return ", ".join(f"{axis} {value:g}" for axis, value in config.items() if axis != "score")


def _saving_sentence(saving: CurveSaving, who: str, target: str) -> str:
    said = f"{who}'s seed-mean curve to {target}'s seed-mean final loss: {saving.text()} of the steps saved"
    never = f"{100 * saving.never:.0f}% of the resamples never reach it"
    if saving.decided:
        return f"{said} ({never}): **decided**, {who} needs fewer steps."
    if saving.high is None:
        return f"{said} ({never}): **decided**, {who} needs more steps than the budget."
    if saving.estimate is None:
        return (
            f"{said} ({never}): **not decided**; {who}'s mean curve ends above the target, by how many steps is "
            "unknown."
        )
    return f"{said} ({never}): **not decided** (the interval reaches below 0)."


def _together(summary: dict[str, Any]) -> list[str]:
    """The final-loss differences decided each at 95% that stay decided read together (`holm`: a 5% chance of any
    false decision among them all), and the ones that do not."""
    intervals = {m: d["interval"] for m, d in summary["gpa_minus"].items() if d["interval"] is not None}
    together = dict(zip(intervals, decided_together(list(intervals.values()))))
    alone = [m for m, interval in intervals.items() if interval.decided]
    if not alone:
        return []
    kept = [f"GPA-AdamW minus {LABELS[m]}" for m in alone if together[m]]
    lost = [f"GPA-AdamW minus {LABELS[m]}" for m in alone if not together[m]]
    text = (
        f"Read together, with a 5% chance of any false decision among the {len(intervals)} final-loss differences "
        "(Holm's step-down): "
    )
    text += f"{_listed(kept, 'stays', 'stay')} decided" if kept else "none stays decided"
    if lost:
        text += f"; {_listed(lost, 'does', 'do')} not"
    return [text + "."]


def _listed(names: list[str], one: str, many: str) -> str:
    """``names`` joined with commas, then the verb that agrees with how many there are."""
    return f"{', '.join(names)} {one if len(names) == 1 else many}"


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
    lines += _together(summary)
    for method, steps in summary["steps"].items():
        if steps["to_adamw"] is None:
            continue
        lines.append(_saving_sentence(steps["to_adamw"], LABELS[method], "AdamW"))
        lines.append(_saving_sentence(steps["adamw_to"], "AdamW", LABELS[method]))
    gpa = summary["steps"].get("gpa", {}).get("to_adamw")
    if gpa is not None:
        low = -math.inf if gpa.low is None else gpa.low
        high = -math.inf if gpa.high is None else gpa.high
        paper = f"The paper's {100 * PAPER_SAVING:.2f}% (Llama-160M, 262K-token batches, 36,622 steps)"
        if not low <= PAPER_SAVING <= high:
            lines.append(f"{paper} lies outside GPA-AdamW's interval here.")
        elif gpa.decided:
            lines.append(f"{paper} lies inside GPA-AdamW's interval here, which also decides a saving.")
        else:
            lines.append(
                f"{paper} is neither confirmed nor excluded here: GPA-AdamW's interval holds it, but also no saving."
            )
    return lines


def environment_lines(data: dict[str, Any]) -> list[str]:
    """Where the runs were made, and whether they can be compared bit for bit."""
    envs = environments_of(data)
    if not envs:
        return ["Measured on: " + environment_text(data.get("environment", {})) + " (no run yet)."]
    runs_in = {i: 0 for i in range(len(envs))}
    for run in data["runs"]:
        env = environments_of(data, [run])[0]
        runs_in[envs.index(env)] += 1
    if len(envs) == 1:
        return [
            f"Measured on: {environment_text(envs[0])}. A run repeats bit for bit only on the same CPU instruction "
            "set, torch, Python, threads and code; on another instruction set its loss drifts (see "
            "docs/benchmarks.md, the drift across instruction sets)."
        ]
    lines = [f"Runs made in {len(envs)} environments (compare runs bitwise only within one):", ""]
    for i, env in enumerate(envs):
        differs = bitwise_differences(env, envs[0]) if i else []
        lines.append(
            f"- {runs_in[i]} runs: {environment_text(env)}"
            + (f" (differs in {', '.join(differs)})" if differs else "")
        )
    return lines


def cost_lines(data: dict[str, Any]) -> list[str]:
    """Runs recorded, core-hours spent, and the plan's estimate at the measured mean run time."""
    plan = data["plan"]
    runs = data["runs"]
    if not runs:
        return ["No run recorded yet."]
    methods = _methods(data)
    budget = plan.get("budget")
    tuning_runs = sum(1 for run in runs if run["spec"]["phase"] == "tune")
    planned = budget * len(methods) * len(plan["tuning_seeds"]) + len(plan["seeds"]) * len(methods)
    cpu = [run.get("cpu_s", run["wall_s"]) for run in runs]  # records without cpu_s: their wall time
    mean_s, wall_s = statistics.fmean(cpu), statistics.fmean(run["wall_s"] for run in runs)
    return [
        f"Runs: {len(runs)} recorded ({tuning_runs} tuning, {len(runs) - tuning_runs} final) of {planned} planned "
        f"({budget} configurations x {len(methods)} methods x {len(plan['tuning_seeds'])} tuning seeds + "
        f"{len(plan['seeds'])} seeds x {len(methods)} methods; a search that runs out of new configurations before "
        f"its budget would plan fewer). Mean run {mean_s:.0f} s of CPU on one thread (wall {wall_s:.0f} s on a shared "
        f"machine); spent {sum(cpu) / 3600:.2f} core-hours, the plan {planned * mean_s / 3600:.1f} at that rate."
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


def tuning_lines(data: dict[str, Any]) -> list[str]:
    """The tuning table (configurations evaluated, pick, moves, edges) and every configuration each search scored."""
    plan, tuning = data["plan"], data.get("tuning", {})
    lines = [
        "## Tuning",
        "",
        f"Seeds {plan['tuning_seeds']} (never final seeds), scored on the {data['workload']['val_windows']} "
        f"validation windows (the final runs are reported on others); every method's search evaluates "
        f"{plan.get('budget')} distinct configurations: one axis at a time from the middle of its grid, an axis whose "
        "best is on a movable edge slid one point past it, then every axis refined at half the spacing around the "
        "best; the pick is the lowest score (mean final validation loss over the tuning seeds) of all.",
        "",
        "| Method | configurations evaluated | pick (score) | slides, refinements | pick on an edge of what was tried "
        "|",
        "|---|---|---|---|---|",
    ]
    details = []
    for method in _methods(data):
        if method not in tuning:
            done = sum(1 for run in data["runs"] if run["spec"]["phase"] == "tune" and run["spec"]["method"] == method)
            lines.append(f"| {LABELS[method]} | — | not tuned yet ({done} tuning runs recorded) | — | — |")
            continue
        t = tuning[method]
        slides = [m for m in t["moves"] if m.startswith("slide")]
        refines = [m for m in t["moves"] if m.startswith("refine")]
        moves = f"slides {len(slides)}" + (
            ": " + "; ".join(f"`{m[len('slide ') :]}`" for m in slides) if slides else ""
        )
        moves += f"; refinements {len(refines)}"
        edges = "; ".join(e["extend"] for e in t["edges"]) or "none"
        lines.append(
            f"| {LABELS[method]} | {t['evaluated']} | {_config_text(t['selected'])} ({t['score']:.4f}) | {moves} | "
            f"{edges} |"
        )
        scored = sorted(t["scores"], key=lambda c: c["score"])
        details.append(
            f"- {LABELS[method]}, best first: " + "; ".join(f"{_config_text(c)} = {c['score']:.4f}" for c in scored)
        )
    counts = {LABELS[m]: tuning[m]["evaluated"] for m in _methods(data) if m in tuning}
    if counts:
        equal = "equal" if len(set(counts.values())) == 1 else "**not equal**"
        lines += ["", f"Configurations evaluated ({equal}): " + ", ".join(f"{k} {v}" for k, v in counts.items()) + "."]
    if details:
        lines += ["", "Every configuration evaluated, with its score:", "", *details]
    return lines


def markdown(data: dict[str, Any]) -> str:
    """The whole report as markdown."""
    w = data["workload"]
    held_out = w.get("held_out_windows", 0)
    windows = (
        f"tuning runs evaluated on {w['val_windows']} fixed validation windows, final runs on {held_out} held-out "
        "windows of the same split that share no token with them"
        if held_out
        else f"evaluated on {w['val_windows']} fixed windows"
    )
    lines = [
        f"Workload: Llama d={w['hidden_size']} L={w['num_layers']} ff={w['intermediate_size']} vocab "
        f"{w['vocab_size']} ({data.get('parameters', '?')} parameters), seq {w['seq_len']} x batch {w['batch_size']}, "
        f"{w['steps']} steps, weight decay {w['weight_decay']}, every {w['eval_every']} steps {windows} (DiLoCo at "
        f"outer-step boundaries: its H divides {w['eval_every']}).",
        *_schedule_free_note(data),
        "",
        *environment_lines(data),
        "",
        *cost_lines(data),
        "",
        *tuning_lines(data),
    ]
    summary = summarize(data)
    seeds = summary["seeds"]
    lines += ["", "## Final runs", ""]
    if not seeds:
        return "\n".join([*lines, "No seed has finished for every method yet."]) + "\n"
    finals = final_runs(data)
    methods = _methods(data)
    lines += [
        f"Seeds {seeds} (each: the same initial weights and batches for every method); final loss on the "
        f"{'held-out' if held_out else 'validation'} windows:",
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
        "Steps saved, as the paper measures them: the step at which a method's seed-mean curve first reaches the "
        "other method's seed-mean final loss (linear between evaluations), as a share of the "
        f"{w['steps']} steps; both directions, so that a reader sees the symmetry. The 95% interval is a paired "
        f"bootstrap over the seeds ({RESAMPLES:,} resamples, both mean curves and the crossing recomputed in each). A "
        "mean curve that never reaches the target within the budget saves less than nothing by an amount the runs "
        "cannot tell: such a resample ranks below every reaching one, and an estimate or bound that falls among them "
        "reads *never*. The last column counts, per seed, the runs that reach AdamW's final loss of the same seed.",
        "",
        "| Method | to AdamW's final loss: saved [95%] | resamples never reaching | AdamW to its final loss: saved "
        "[95%] | resamples never reaching | seeds reaching AdamW's loss of the same seed |",
        "|---|---|---|---|---|---|",
    ]
    for method, steps in summary["steps"].items():
        n = len(steps["per_seed"])
        to, back = steps["to_adamw"], steps["adamw_to"]
        left = f" ({steps['left_out']} left out: diverged)" if steps["left_out"] else ""
        lines.append(
            f"| {LABELS[method]}{left} | {to.text() if to else '—'} | {f'{100 * to.never:.0f}%' if to else '—'} | "
            f"{back.text() if back else '—'} | {f'{100 * back.never:.0f}%' if back else '—'} | "
            f"{n - len(steps['censored'])}/{n} |"
        )
    lines += ["", "## What the data decides", "", *[f"- {line}" for line in decisions(summary)]]
    return "\n".join(lines) + "\n"


def plot(data: dict[str, Any], path: Path) -> None:
    """Left: GPA minus each method (final loss), per seed and the 95% interval. Right: the seed-mean step savings
    both ways, with their bootstrap intervals (a bound among the never-reaching resamples drawn to the axis' floor)."""
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
    left.set_ylabel("GPA-AdamW minus method, final loss")
    floor = -10.0  # where "never reached" is drawn (a reached saving is >= 0)
    for i, steps in enumerate(summary["steps"].values()):
        for offset, saving, color in ((-0.12, steps["to_adamw"], "tab:blue"), (0.12, steps["adamw_to"], "tab:orange")):
            if saving is None:
                continue
            low, high = (floor if v is None else 100 * v for v in (saving.low, saving.high))
            mid = floor if saving.estimate is None else 100 * saving.estimate
            right.plot([i + offset] * 2, [low, high], color=color, lw=2)
            right.scatter([i + offset], [mid], color=color, zorder=3)
    right.axhline(0, color="grey", lw=0.8)
    right.axhline(floor, color="grey", ls="--", lw=0.8)
    right.axhline(100 * PAPER_SAVING, color="grey", ls=":", lw=0.8, label="paper, Llama-160M")
    right.plot([], [], color="tab:blue", label="method to AdamW's final loss")
    right.plot([], [], color="tab:orange", label="AdamW to the method's final loss")
    right.set_xticks(range(len(summary["steps"])), [LABELS[m] for m in summary["steps"]], fontsize=7)
    right.set_ylabel(f"% of the steps saved (dashed, {floor:.0f}: never reached)")
    right.legend(fontsize=7)
    fig.suptitle(f"{len(summary['seeds'])} seeds, 95% intervals (right: bootstrap over seeds)", fontsize=9)
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
