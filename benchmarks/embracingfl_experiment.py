"""EmbracingFL vs FedAvg (all strong / dropping the weak) vs width reduction (HeteroFL), over seeds.

    .venv/bin/python benchmarks/embracingfl_experiment.py --experiment B --seeds 0 1 2 --out runs/efl-bench
    .venv/bin/python benchmarks/embracingfl_experiment.py --experiment A --alphas 0.5 --seeds 0 1 2 --docs

The spec's small-scale reproduction (``docs/algorithms/embracingfl.md`` §8) on digits with the MLP
64-64-64-64-10, every run a real ``fedfleet run ... --transport inproc`` (server, aggregators and
clients exchanging the real wire messages in one process), started from
``experiments/embracingfl_digits_mix.yaml`` with only the fleet, the algorithm and the seed changed:

* **Experiment A** (Table 2 analogue): 64 Dirichlet partitions; 8 strong + k weak devices,
  k ∈ {0, 8, 24, 56}, every present device in every round. The other 56 − k partitions are an
  ``absent`` tier (``p_online: 0``, never selected); tiers are laid over device ids in blocks, so adding
  weak devices adds data and the 8 strong devices are the same in every run of a seed.
* **Experiment B** (Tables 3/6 analogue): 32 partitions, 8 per round (25%), seven S/M/W cases.
* ``--setting fashion``: Experiments A and B from ``experiments/embracingfl_fashion.yaml`` instead
  (Fashion-MNIST, LeNet-5; A's local work 4 passes, ~12 steps), scored by ``acc5`` (the mean of the
  last 5 rounds) as every Fashion-MNIST block of the page; ``--jobs 2`` makes two runs at a time.
* ``--experiment LG``: LG-FedAvg (``experiments/lgfedavg_digits.yaml``, the Hermes digits setup) over the
  seeds: all-device personalised accuracy and the bytes against a full-model FedAvg's dense volume.

Devices differ in memory only: strong 1.0, moderate 0.70, weak 0.40 of the full model's training
footprint (fedfleet's measured bytes). Every method gets the same budgets and makes what fits:

* ``efl``: EmbracingFL, cut from the budget (moderate trains the last 3 layers, weak the last 2 — the
  spec's cuts; ``client_types: budget``);
* ``drop``: the same local procedure with partial training off: weak/moderate devices cannot hold
  the full model and are refused by admission ("FedAvg dropping the weak clients");
* ``wr-budget``: HeteroFL (static width reduction, ``shared/algorithms/heterofl.py``) with the width the
  same budget admits (r = 0.75 moderate / 0.5 weak), the memory-matched comparison;
* ``wr-paper``: HeteroFL at the paper's ratios r = 0.45 / 0.2 (grid {0.2, 0.45, 1}; the weak tier's
  budget lowered to 0.24 so that 0.2 is what fits) — *less* memory than EmbracingFL's weak devices.

Experiment B also runs two EmbracingFL variants: ``efl-tau10`` (exactly τ = 10 local steps, the
spec's procedure, instead of epochs) and ``efl-whole`` (``aggregation: whole_model``, spec §9 item 2).

All methods use unweighted averaging and the same local procedure: ``train.local_epochs`` passes of
SGD (batch 32, lr 0.01, momentum 0.9 reset every round, weight decay 1e-4) — HeteroFL trains in
epochs, so EmbracingFL runs with ``local_steps: null`` here; 5 epochs on ~47 samples (B) and 10 on
~23 (A) are ≈ 10 steps, the spec's τ. Accuracy is the global model on the central digits test split
(297 samples); the metric is the best over the 50 rounds (the paper's) and the final one.

Writes ``results.json`` and ``table_<exp>.md`` under ``--out``; with ``--docs`` replaces the block
between the ``embracingfl-results-<exp>`` markers in ``docs/algorithms/embracingfl.md``.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.orchestrator import run_inproc_once  # noqa: E402
from services.reproduce import run_in_pool  # noqa: E402
from shared.config import parse_config  # noqa: E402
from shared.results import read_rounds, replace_doc_block  # noqa: E402

DOC = ROOT / "docs" / "algorithms" / "embracingfl.md"
#: --setting -> the config every run starts from
BASES = {
    "digits": ROOT / "experiments" / "embracingfl_digits_mix.yaml",
    "fashion": ROOT / "experiments" / "embracingfl_fashion.yaml",
}
#: Experiment A's local epochs per setting: the spec's τ = 10 steps at batch 32 is ~10 passes over
#: a digits device's ~23 samples; a Fashion-MNIST device of A (6,000 images over 64) holds ~94, so 4
#: passes, ~12 steps (the Fashion case-5 runs' 2 passes over ~190 samples are ~12 steps too)
EPOCHS_A = {"digits": 10, "fashion": 4}
#: Experiment B's: 5 passes over a digits device's ~47 samples, 2 over a Fashion-MNIST one's ~190 (the
#: Fashion-MNIST case grids' setting), both ≈ 10-12 steps
EPOCHS_B = {"digits": 5, "fashion": 2}
LINK = {"uplink_bps": 5e6, "downlink_bps": 20e6, "latency_s": 0.015, "flops_per_s": 2e9}
MEMORY = {"strong": 1.0, "moderate": 0.70, "weak": 0.40}
#: wr-paper: the weak budget at which 0.2 (not 0.45) is the widest HeteroFL slice that fits
WR_PAPER_WEAK_MEMORY = 0.24
WEAK_A = (0, 8, 24, 56)
CASES_B: dict[str, tuple[int, int, int]] = {
    "case 1": (32, 0, 0),
    "case 2": (16, 16, 0),
    "case 5": (16, 0, 16),
    "case 6": (8, 0, 24),
    "case 7": (4, 0, 28),
    "case 8": (8, 8, 16),
    "case 10": (4, 4, 24),
}
METHODS = ("efl", "drop", "wr-budget", "wr-paper")


def _algorithm(method: str) -> dict[str, Any]:
    efl = {"client_types": "budget", "aggregation": "per_layer", "weighting": "uniform"}
    if method == "efl":
        return {"name": "embracingfl", "options": efl}
    if method == "drop":
        return {"name": "embracingfl", "options": {**efl, "partial_training": False}}
    if method == "efl-tau10":  # the spec's exact local procedure: τ = 10 steps whatever |D_i|
        return {"name": "embracingfl", "options": efl}  # with train.local_steps = 10 (``_config``)
    if method == "efl-whole":  # App. 6.1's "whole models are averaged" reading (spec §9 item 2)
        return {"name": "embracingfl", "options": {**efl, "aggregation": "whole_model"}}
    wr: dict[str, Any] = {"capacity": "budget", "weighting": "uniform"}
    if method == "wr-paper":
        wr["budget_grid"] = (0.2, 0.45, 1.0)
    return {"name": "heterofl", "options": wr}


def _tiers(counts: dict[str, int], method: str, absent: int = 0) -> dict[str, Any]:
    tiers: dict[str, Any] = {}
    for name in ("strong", "moderate", "weak"):
        if counts.get(name, 0) or name == "strong":
            mem = WR_PAPER_WEAK_MEMORY if (method == "wr-paper" and name == "weak") else MEMORY[name]
            tiers[name] = {"count": counts.get(name, 0), "memory_fraction": mem, **LINK}
    if absent:
        tiers["absent"] = {"count": absent, "memory_fraction": 1.0, "p_online": 0.0, **LINK}
    return tiers


def _config(
    exp: str, key: str, method: str, seed: int, alpha: float, rounds: int, setting: str = "digits"
) -> dict[str, Any]:
    cfg = yaml.safe_load(BASES[setting].read_text())
    cfg = copy.deepcopy(cfg)
    cfg["seed"] = seed
    cfg["rounds"] = rounds
    cfg["dataset"]["alpha"] = alpha
    cfg["algorithm"] = _algorithm(method)
    if exp == "A":
        weak = int(key)
        cfg.update(num_devices=64, devices_per_round=8 + weak)
        cfg["train"]["local_epochs"] = EPOCHS_A[setting]
        cfg["fleet"] = {
            "assignment": "blocks",
            "tiers": _tiers({"strong": 8, "weak": weak}, method, 56 - weak),
        }
    else:
        s, m, w = CASES_B[key]
        cfg.update(num_devices=32, devices_per_round=8)
        cfg["train"]["local_epochs"] = EPOCHS_B[setting]
        cfg["fleet"] = {
            "assignment": "shuffled",
            "tiers": _tiers({"strong": s, "moderate": m, "weak": w}, method),
        }
    # τ = 10 steps only for the tau10 rows; every other row trains local_epochs passes
    if method == "efl-tau10":
        cfg["train"]["local_steps"] = 10
    else:
        cfg["train"].pop("local_steps", None)
    prefix = "efl-bench" if setting == "digits" else f"efl-bench-{setting}"
    cfg["name"] = f"{prefix}-{exp}-a{alpha}-{key.replace(' ', '')}-{method}-s{seed}"
    return cfg


def _runs(exp: str) -> list[tuple[str, str]]:
    """(key, method) pairs: A keys are weak counts, B keys case names. All-strong runs need no
    baseline (every method is the same FedAvg there), so only ``efl`` runs them."""
    if exp == "A":
        out = [(str(k), "efl") for k in WEAK_A]
        return out + [(str(WEAK_A[-1]), m) for m in ("wr-budget", "wr-paper")]
    out = []
    for case, (_, m, w) in CASES_B.items():
        out += [(case, "efl"), (case, "efl-tau10")]
        out += [(case, x) for x in (*METHODS[1:], "efl-whole")] if m + w else []
    return out


#: the accuracy the tables and checks use: the best round (the paper's metric, the digits tables) or,
#: on Fashion-MNIST, ``acc5`` (the mean of the last 5 rounds, as every Fashion-MNIST block of the page)
METRIC = {"digits": "best", "fashion": "acc5"}
metric = "best"

#: runs executed / reused by this invocation (for the command line under each table)
COUNTS = {"executed": 0, "reused": 0}


def _provenance(started: float) -> str:
    return (
        f"{COUNTS['executed']} runs executed by this invocation in {(time.time() - started) / 60:.1f} min, "
        f"{COUNTS['reused']} reused from earlier invocations"
    )


def _execute(cfg_dict: dict[str, Any], out: Path, force: bool) -> bool:
    """Make one run (reused when finished); True if it ran. A ``--jobs`` worker's task."""
    cfg = parse_config(cfg_dict, cfg_dict["name"])
    return run_inproc_once(cfg, out / cfg.name, cfg.name, force=force)


def _execute_all(cfgs: list[dict[str, Any]], out: Path, force: bool, jobs: int) -> None:
    """Make every run, ``jobs`` at a time in their own processes (spawned: the parent has imported
    torch); counts what ran and what was reused."""
    for ran in run_in_pool(jobs, _execute, [(cfg["name"], (cfg, out, force)) for cfg in cfgs]):
        COUNTS["executed" if ran else "reused"] += 1


def _run(cfg_dict: dict[str, Any], out: Path, force: bool, count: bool = True) -> dict[str, Any]:
    ran = _execute(cfg_dict, out, force)
    if count:
        COUNTS["executed" if ran else "reused"] += 1
    run_dir = out / cfg_dict["name"]
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = read_rounds(run_dir)
    completed = [r for r in rows if r["outcome"] == "completed"]
    ups = sum(t["completed"] for t in summary["tiers"].values())
    acc = [float(r["accuracy"]) for r in rows if r.get("accuracy") not in (None, "")]
    return {
        "best": 100 * (summary["best_accuracy"] or 0.0),
        "final": 100 * (summary["final_accuracy"] or 0.0),
        "acc5": 100 * statistics.fmean(acc[-5:]) if acc else 0.0,
        "rounds_completed": summary["rounds_completed"],
        "rejected": {t: v["rejected"] for t, v in summary["tiers"].items()},
        "bytes_up_per_update": summary["bytes_up"] / max(1, ups),
        "bytes_down": summary["bytes_down"],
        "mean_cut": statistics.fmean(r["m_cut"] for r in completed if r.get("m_cut") is not None)
        if any(r.get("m_cut") is not None for r in completed)
        else None,
    }


def _stats(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _fmt(values: list[float]) -> str:
    m, s = _stats(values)
    return f"{m:.2f} ± {s:.2f}"


def _table(exp: str, alpha: float, res: dict[str, dict[str, list[dict[str, Any]]]]) -> list[str]:
    def cell(key: str, method: str, what: str = "") -> str:
        what = what or metric
        runs = res.get(key, {}).get(method)
        return _fmt([r[what] for r in runs]) if runs else "–"

    label = "weak devices (8 strong)" if exp == "A" else "case (S/M/W)"
    extra = exp == "B"
    lines = [
        f"| {label} | EmbracingFL {metric} | EFL final | FedAvg strong only (rest refused) {metric} | "
        f"WR same budget {metric} | WR paper r {metric} |"
        + (f" EFL τ=10 steps {metric} | EFL τ=10 final | EFL whole-model avg {metric} |" if extra else ""),
        "|---|---|---|---|---|---|" + ("---|---|---|" if extra else ""),
    ]
    for key in res:
        name = f"{key} ({'/'.join(map(str, CASES_B[key]))})" if exp == "B" else key
        drop = cell(key, "drop") if exp == "B" else (cell(str(WEAK_A[0]), "efl") if key != "0" else "–")
        row = (
            f"| {name} | {cell(key, 'efl')} | {cell(key, 'efl', 'final')} | {drop} | "
            f"{cell(key, 'wr-budget')} | {cell(key, 'wr-paper')} |"
        )
        if extra:
            row += (
                f" {cell(key, 'efl-tau10')} | {cell(key, 'efl-tau10', 'final')} | {cell(key, 'efl-whole')} |"
            )
        lines.append(row)
    return lines


def _mean(res: dict[str, dict[str, list[dict[str, Any]]]], key: str, method: str) -> float:
    return _stats([r[metric] for r in res[key][method]])[0]


def _checks(exp: str, res: dict[str, dict[str, list[dict[str, Any]]]]) -> list[tuple[str, str, bool | None]]:
    """(check, measured, verdict) for the spec's §8 checks (None = soft, reported only)."""
    out: list[tuple[str, str, bool | None]] = []
    if exp == "A":
        e = {k: _mean(res, str(k), "efl") for k in WEAK_A}
        top = str(WEAK_A[-1])
        wb, wp = _mean(res, top, "wr-budget"), _mean(res, top, "wr-paper")
        a1 = e[56] - e[0]
        out.append(("A1: EFL(8S+56W) − EFL(8S+0W) ≥ +4", f"{a1:+.2f}", a1 >= 4))
        out.append(("A2: EFL(8S+56W) − WR same budget ≥ +2", f"{e[56] - wb:+.2f}", e[56] - wb >= 2))
        out.append(("A2: EFL(8S+56W) − WR paper r ≥ +5", f"{e[56] - wp:+.2f}", e[56] - wp >= 5))
        steps = [e[b] - e[a] for a, b in itertools.pairwise(WEAK_A)]
        out.append(
            (
                "A3: EFL non-decreasing in weak devices (±0.5)",
                ", ".join(f"{s:+.2f}" for s in steps),
                min(steps) >= -0.5,
            )
        )
        out.append(
            (
                "A4: EFL gain from weak > WR gain (same budget / paper r)",
                f"{a1:+.2f} vs {wb - e[0]:+.2f} / {wp - e[0]:+.2f}",
                a1 > wb - e[0] and a1 > wp - e[0],
            )
        )
    else:
        b = {k: _mean(res, k, "efl") for k in CASES_B}
        out.append(
            (
                "B1: case 5 EFL within 3 pts of case 1",
                f"{b['case 5'] - b['case 1']:+.2f}",
                b["case 5"] - b["case 1"] >= -3,
            )
        )
        for case in ("case 7", "case 10"):
            d = b[case] - _mean(res, case, "wr-paper")
            out.append((f"B2: {case} EFL − WR paper r ≥ +5", f"{d:+.2f}", d >= 5))
        out.append(
            (
                "B3: EFL case 7 < case 5 < case 1",
                f"{b['case 7']:.2f} < {b['case 5']:.2f} < {b['case 1']:.2f}",
                b["case 7"] < b["case 5"] < b["case 1"],
            )
        )
        t = {k: _mean(res, k, "efl-tau10") for k in CASES_B}
        out.append(
            (
                "B1 with τ = 10 steps: case 5 within 3 pts of case 1",
                f"{t['case 5'] - t['case 1']:+.2f}",
                t["case 5"] - t["case 1"] >= -3,
            )
        )
        out.append(
            (
                "B3 with τ = 10 steps: case 7 < case 5 < case 1",
                f"{t['case 7']:.2f} < {t['case 5']:.2f} < {t['case 1']:.2f}",
                t["case 7"] < t["case 5"] < t["case 1"],
            )
        )
        diffs = [
            b[c] - _mean(res, c, "wr-budget") for c in ("case 5", "case 6", "case 7", "case 8", "case 10")
        ]
        out.append(
            (
                "B4 (soft): EFL ≥ WR same budget, cases 5–10",
                ", ".join(f"{d:+.2f}" for d in diffs),
                min(diffs) >= 0,
            )
        )
    return out


def _lg(args: argparse.Namespace, started: float) -> None:
    """LG-FedAvg over the seeds (personalised accuracy of all devices, traffic vs full-model FedAvg)."""
    rows = []
    for seed in args.seeds:
        cfg = yaml.safe_load((ROOT / "experiments" / "lgfedavg_digits.yaml").read_text())
        cfg.update(seed=seed, name=f"efl-bench-lgfedavg-s{seed}")
        if args.rounds != 50:
            cfg["rounds"] = args.rounds
        _run(cfg, args.out, args.force)
        summary = json.loads((args.out / cfg["name"] / "summary.json").read_text())
        # a full-model FedAvg moves the whole model up and down for every participant and round
        params = sum(v.size for v in np.load(args.out / cfg["name"] / "global_model.npz").values())
        fedavg_dense = 2 * 4 * params * cfg["devices_per_round"] * cfg["rounds"]
        rows.append(
            (
                100 * summary["personal_accuracy_mean"],
                100 * summary["personal_accuracy_worst"],
                (summary["dense_bytes_up"] + summary["dense_bytes_down"]) / fedavg_dense,
                (summary["bytes_up"] + summary["bytes_down"]) / 1e6,
            )
        )
    cols = list(zip(*rows, strict=True))
    lines = [
        f"Seeds {', '.join(map(str, args.seeds))}; mean ± std (per seed).",
        "",
        "| metric | value |",
        "|---|---|",
        f"| personalised accuracy, mean over all 30 devices (%) | {_fmt(list(cols[0]))} "
        f"({' / '.join(f'{v:.1f}' for v in cols[0])}) |",
        f"| worst device (%) | {_fmt(list(cols[1]))} |",
        f"| dense up+down volume vs full-model FedAvg | {_fmt(list(cols[2]))} |",
        f"| wire bytes up+down (MB) | {_fmt(list(cols[3]))} |",
        "",
        f"Command: `.venv/bin/python benchmarks/embracingfl_experiment.py --experiment LG --seeds "
        f"{' '.join(map(str, args.seeds))}` ({_provenance(started)}).",
    ]
    text = "\n".join(lines)
    print(text)
    if args.docs:
        replace_doc_block(DOC, "lgfedavg-results", text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment", choices=("A", "B", "LG"), required=True)
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.5])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "efl-bench")
    ap.add_argument("--force", action="store_true", help="redo finished runs")
    ap.add_argument("--docs", action="store_true", help="write the table into docs/algorithms/embracingfl.md")
    ap.add_argument(
        "--setting",
        choices=sorted(BASES),
        default="digits",
        help="fashion: experiments/embracingfl_fashion.yaml (Fashion-MNIST, LeNet-5) as the base; "
        "accuracy is then acc5, the mean of the last 5 rounds (Experiments A and B)",
    )
    ap.add_argument("--jobs", type=int, default=1, help="runs at once, each in its own process (A and B)")
    args = ap.parse_args()
    exp = args.experiment
    if len(set(args.seeds)) < len(args.seeds):
        ap.error("--seeds repeats a seed")
    if exp == "LG" and (args.jobs > 1 or args.setting != "digits"):
        ap.error("--jobs and --setting are for Experiments A and B")
    started = time.time()
    if exp == "LG":
        _lg(args, started)
        return
    global metric
    metric = METRIC[args.setting]
    cfgs = {
        (alpha, seed, key, method): _config(exp, key, method, seed, alpha, args.rounds, args.setting)
        for alpha in args.alphas
        for seed in args.seeds
        for key, method in _runs(exp)
    }
    if args.jobs > 1:
        _execute_all(list(cfgs.values()), args.out, args.force, args.jobs)
    blocks: list[str] = []
    all_results: dict[str, Any] = {}
    for alpha in args.alphas:
        res: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for (a, _seed, key, method), cfg in cfgs.items():
            if a == alpha:
                one = _run(cfg, args.out, args.force and args.jobs <= 1, count=args.jobs <= 1)
                res.setdefault(key, {}).setdefault(method, []).append(one)
        all_results[f"{exp}/alpha={alpha}"] = res
        checks = _checks(exp, res)
        what = (
            "accuracy (%) on the central test split"
            if metric == "best"
            else "accuracy (%) on the central test set, `acc5` (the mean of the last 5 rounds) unless named"
        )
        data = "" if args.setting == "digits" else f"`{BASES[args.setting].relative_to(ROOT)}`, "
        blocks += [
            f"**Experiment {exp}, Dirichlet α = {alpha}**, {data}seeds {', '.join(map(str, args.seeds))}, "
            f"{args.rounds} rounds; {what}, mean ± std over seeds.",
            "",
            *_table(exp, alpha, res),
            "",
            "| check | measured | verdict |",
            "|---|---|---|",
            *(
                f"| {c} | {m} | {'soft: ' if v is None else ''}{'PASS' if v else 'FAIL'} |"
                for c, m, v in checks
            ),
            "",
        ]
    setting = [] if args.setting == "digits" else ["--setting", args.setting]
    words = [f"--experiment {exp}", *setting, "--alphas", *map(str, args.alphas), "--seeds"]
    cmd = "python benchmarks/embracingfl_experiment.py " + " ".join([*words, *map(str, args.seeds)])
    blocks.append(f"Command: `.venv/bin/{cmd}` ({_provenance(started)}).")
    text = "\n".join(blocks)
    args.out.mkdir(parents=True, exist_ok=True)
    results_path = args.out / "results.json"
    previous = json.loads(results_path.read_text()) if results_path.exists() else {}
    results_path.write_text(json.dumps({**previous, **all_results}, indent=1))
    (args.out / f"table_{exp}.md").write_text(text + "\n")
    print(text)
    if args.docs:
        suffix = "" if args.setting == "digits" else f"-{args.setting}"
        replace_doc_block(DOC, f"embracingfl-results-{exp}{suffix}", text)


if __name__ == "__main__":
    main()
