"""The Fashion-MNIST cases grid must run the same fleets as the digits Experiment B it stands beside.

Why: B2 and B3 compare cases by name (7, 10); a grid whose "case 10" held other counts or memory
budgets than the digits benchmark's would check a different claim under the same label.
"""

import importlib

from services import reproduce as rp


def test_fashion_cases_match_the_digits_experiment_b_fleets() -> None:
    # imported by name, as services/reproduce.py does: mypy sees benchmarks/ as top-level scripts
    bench = importlib.import_module("benchmarks.embracingfl_experiment")
    grid = rp.GRIDS["embracingfl-fashion-cases"]
    for variant in grid.variants:
        method, case = variant.label.rsplit("-case", 1)
        tiers = rp._variant_config(grid, variant, 0, None)["fleet"]["tiers"]
        s, m, w = bench.CASES_B[f"case {case}"]
        want = bench._tiers(
            {"strong": s, "moderate": m, "weak": w}, "wr-paper" if method == "wr-paper" else "efl"
        )
        assert tiers == want, variant.label
        assert sum(t["count"] for t in tiers.values()) == 32
