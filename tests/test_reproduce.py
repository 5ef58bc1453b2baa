"""``fedfleet reproduce``: every results block of the algorithm docs is what the command writes.

The committed blocks are parsed back: each must start with the caption :mod:`services.reproduce`
writes (command, code version of a committed tree, seeds, configs) and hold well-formed tables. One
reproduction runs end to end on a tiny setting (LG-FedAvg, one seed, 2 rounds) into a copy of its
doc, so the path from the script to the doc block is exercised and its table shape compared with the
committed one.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from services import reproduce as rp

DOCS = rp.DOCS


def _doc_blocks(alg: str) -> dict[str, str]:
    return rp.blocks_of((DOCS / rp.REPRODUCTIONS[alg].doc).read_text())


@pytest.mark.parametrize("alg", sorted(rp.REPRODUCTIONS))
def test_every_paper_block_has_the_commands_caption_and_shape(alg: str) -> None:
    rep = rp.REPRODUCTIONS[alg]
    blocks = _doc_blocks(alg)
    for block in rep.blocks:
        assert block.marker in blocks, f"{rep.doc} lacks the {block.marker} block"
        text = blocks[block.marker]
        first = text.splitlines()[0]
        m = rp.CAPTION_RE.match(first)
        if block.pending:
            assert not m, f"{block.marker} was regenerated: drop its `pending` note in services/reproduce.py"
            continue
        assert m, f"{rep.doc} {block.marker}: first line is not the reproduce caption: {first!r}"
        assert m["alg"] == alg
        assert not m["version"].endswith("-dirty"), f"{block.marker} was made from an uncommitted tree"
        assert re.fullmatch(r"[0-9a-f]{7,40}|v?[\w.-]+-\d+-g[0-9a-f]{7,40}", m["version"]), m["version"]
        assert [int(s) for s in m["seeds"].split(",")] == list(rep.seeds)
        # the block's own configs, or (captions written before blocks could name theirs) the paper's
        assert re.findall(r"`([^`]+)`", m["configs"]) in (
            list(block.configs or rep.configs),
            list(rep.configs),
        )
        assert "Smoke run" not in m["note"], f"{block.marker} holds a smoke run's table"
        tables = rp.tables_of(text)
        assert tables, f"{block.marker} holds no table"
        for table in tables:
            assert len(table) >= 3, f"{block.marker}: a table without rows: {table[0]}"
            assert all(re.fullmatch(r":?-{3,}:?", c) for c in table[1]), f"{block.marker}: bad separator"
            widths = {len(row) for row in table}
            assert widths == {len(table[0])}, f"{block.marker}: ragged table under {table[0]}"


def test_every_block_in_the_paper_docs_is_registered() -> None:
    """A block no reproduction writes would be a hand-maintained table again."""
    registered = {(r.doc, b.marker) for r in rp.REPRODUCTIONS.values() for b in r.blocks}
    registered.add((rp.TALLY_DOC.name, rp.TALLY_MARKER))  # written by `fedfleet verdicts`, checked below
    for alg, rep in rp.REPRODUCTIONS.items():
        for marker in _doc_blocks(alg):
            assert (rep.doc, marker) in registered, f"{rep.doc}: block {marker} has no reproduction"


@pytest.mark.parametrize("alg", sorted(rp.REPRODUCTIONS))
def test_configs_exist_and_the_doc_cites_them(alg: str) -> None:
    rep = rp.REPRODUCTIONS[alg]
    doc = (DOCS / rep.doc).read_text()
    for cfg in rep.configs:
        assert (rp.ROOT / cfg).is_file(), cfg
        assert Path(cfg).name in doc, f"{rep.doc} does not cite {cfg}"
    for block in rep.blocks:
        assert (rp.ROOT / block.script).is_file(), block.script


def test_names_resolve_to_their_paper() -> None:
    assert rp.resolve("feddse") == "feddse"
    assert rp.resolve("heterofl") == "feddse"
    assert rp.resolve("fedtiny") == "fedmef"
    assert rp.resolve("lgfedavg") == "embracingfl"
    with pytest.raises(ValueError, match="no reproduction"):
        rp.resolve("nope")


def test_runs_of_another_code_version_are_discarded(tmp_path: Path) -> None:
    out = tmp_path / "block"
    rp._fresh_dir(out, "aaaaaaa")
    (out / "run-s0").mkdir()
    rp._fresh_dir(out, "aaaaaaa")
    assert (out / "run-s0").exists(), "same version: finished runs are reused"
    rp._fresh_dir(out, "bbbbbbb")
    assert not (out / "run-s0").exists(), "another version: its runs must not reach a table"
    assert (out / "code-version.txt").read_text().strip() == "bbbbbbb"


def test_dirty_tree_is_refused_without_allow_dirty(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(rp, "code_version", lambda root=rp.ROOT: "abc1234-dirty")
    with pytest.raises(RuntimeError, match="dirty"):
        rp.reproduce("lgfedavg", out_root=tmp_path, docs_dir=tmp_path)


def test_reproduce_end_to_end_on_a_tiny_setting(tmp_path: Path) -> None:
    """The real command path: script → table → caption → doc block, on 1 seed × 2 rounds."""
    docs = tmp_path / "docs"
    docs.mkdir()
    doc = docs / "embracingfl.md"
    shutil.copy(DOCS / "embracingfl.md", doc)
    before = rp.blocks_of(doc.read_text())
    written = rp.reproduce(
        "lgfedavg",
        seeds=(0,),
        only=("lgfedavg-results",),
        rounds=2,
        out_root=tmp_path / "runs",
        docs_dir=docs,
        allow_dirty=True,
        nice=0,
    )
    assert written == ["lgfedavg-results"]
    after = rp.blocks_of(doc.read_text())
    text = after["lgfedavg-results"]
    m = rp.CAPTION_RE.match(text.splitlines()[0])
    assert m and m["alg"] == "embracingfl" and m["seeds"] == "0"
    assert m["version"] == rp.code_version()
    assert "Smoke run: 2 rounds" in m["note"]
    # the other blocks are untouched, and the new table has the committed table's shape
    assert {k: v for k, v in after.items() if k != "lgfedavg-results"} == {
        k: v for k, v in before.items() if k != "lgfedavg-results"
    }
    new_tables, old_tables = rp.tables_of(text), rp.tables_of(before["lgfedavg-results"])
    assert [t[0] for t in new_tables] == [t[0] for t in old_tables]
    assert [[row[0] for row in t] for t in new_tables] == [[row[0] for row in t] for t in old_tables]
    assert (tmp_path / "runs" / "embracingfl" / "lgfedavg-results" / "code-version.txt").exists()


def test_grid_checks_decide_on_the_seed_mean_with_margins_and_byte_ratios() -> None:
    """Hermes' checks carry a margin ("≥ FedAvg + 20 points") and a traffic bound; a bare ordering
    must not pass on a float-noise tie."""
    res = {
        "a": [{"personal": 80.0, "bytes": 50.0}, {"personal": 70.0, "bytes": 60.0}],
        "b": [{"personal": 55.0, "bytes": 100.0}, {"personal": 55.0, "bytes": 100.0}],
        "tie": [{"personal": 55.0, "bytes": 100.0}, {"personal": 55.0 + 1e-15, "bytes": 100.0}],
    }
    measured, ok = rp.verdict(rp.Check("a ≥ b + 20", "a", "b", margin=20.0), res, "personal")
    assert ok and measured.startswith("20.0 ± 7.1 (25.0 / 15.0)")
    assert not rp.verdict(rp.Check("a ≥ b + 21", "a", "b", margin=21.0), res, "personal")[1]
    assert not rp.verdict(rp.Check("tie ordered", "tie", "b"), res, "personal")[1]
    assert rp.verdict(rp.Check("b below a", "b", "a", sign=-1), res, "personal")[1]
    measured, ok = rp.verdict(rp.Check("bytes", "a", "b", max_ratio=0.55), res, "personal")
    assert ok and measured.startswith("0.550 (0.500 / 0.600)")
    assert not rp.verdict(rp.Check("bytes", "a", "b", max_ratio=0.5), res, "personal")[1]


def test_grid_variants_inherit_the_configs_options_only_when_asked() -> None:
    grid = rp.GRIDS["hermes-fashion"]
    no_pruning = next(v for v in grid.variants if v.label == "hermes-no-pruning")
    cfg = rp._variant_config(grid, no_pruning, 1, None)
    assert cfg["algorithm"]["options"]["r_target"] == 1.0
    assert cfg["algorithm"]["options"]["acc_threshold"] == 0.5, "the config's other options are kept"
    fedavg = next(v for v in grid.variants if v.algorithm == "fedavg")
    assert rp._variant_config(grid, fedavg, 1, None)["algorithm"]["options"] == {}
    feddse = rp.GRIDS["feddse-fashion"]
    cfg = rp._variant_config(feddse, feddse.variants[1], 0, None)
    assert cfg["algorithm"]["options"] == {"capacity": "paper"}, "FedDSE's variants spell out their options"


def test_grid_variant_overrides_change_only_existing_keys() -> None:
    """EmbracingFL's width reduction at the paper's ratios runs on a weaker fleet than the others."""
    grid = rp.GRIDS["embracingfl-fashion"]
    by_label = {v.label: v for v in grid.variants}
    paper = rp._variant_config(grid, by_label["wr-paper"], 2, None)
    assert paper["fleet"]["tiers"]["weak"]["memory_fraction"] == 0.24
    assert paper["algorithm"]["options"]["budget_grid"] == (0.2, 0.45, 1.0)
    assert (
        rp._variant_config(grid, by_label["efl"], 2, None)["fleet"]["tiers"]["weak"]["memory_fraction"] == 0.4
    )
    typo = rp.Variant("typo", "embracingfl", overrides=(("fleet.tiers.weak.memory_fractoin", 0.3),))
    with pytest.raises(KeyError, match="memory_fractoin"):
        rp._variant_config(grid, typo, 0, None)


def test_grid_byte_range_checks_use_their_key_and_both_bounds() -> None:
    """Hermes' check 3 is a range ([0.45, 0.65]) in the paper's accounting, not a wire-byte bound."""
    res = {
        "r0.3": [{"bytes": 90.0, "paper_bytes": 50.0}, {"bytes": 90.0, "paper_bytes": 60.0}],
        "r0.8": [{"bytes": 100.0, "paper_bytes": 100.0}, {"bytes": 100.0, "paper_bytes": 100.0}],
    }
    in_range = rp.Check("3", "r0.3", "r0.8", max_ratio=0.65, min_ratio=0.45, ratio_key="paper_bytes")
    measured, ok = rp.verdict(in_range, res, "personal")
    assert ok and measured.startswith("0.550 (0.500 / 0.600) × the paper-accounted bytes")
    too_low = rp.Check("3", "r0.3", "r0.8", max_ratio=0.65, min_ratio=0.56, ratio_key="paper_bytes")
    assert not rp.verdict(too_low, res, "personal")[1], "below the range's lower bound"
    assert not rp.verdict(rp.Check("3", "r0.3", "r0.8", max_ratio=0.65, min_ratio=0.45), res, "personal")[
        1
    ], "the wire bytes (0.9) are outside the range: the key must matter"


def test_a_grid_variant_can_start_from_its_own_config() -> None:
    """FedMef's batch-1 check compares against FedTiny *with BN*, the model of FedTiny's own config."""
    grid = rp.GRIDS["fedmef-batch1"]
    by_label = {v.label: v for v in grid.variants}
    tiny = rp._variant_config(grid, by_label["fedtiny-b1"], 1, None)
    mef = rp._variant_config(grid, by_label["fedmef-b1"], 1, None)
    assert tiny["model"]["options"]["batch_norm"] is True and mef["model"]["options"]["batch_norm"] is False
    assert tiny["train"]["batch_size"] == mef["train"]["batch_size"] == 1
    assert (
        tiny["algorithm"]["name"] == "fedtiny" and "activation_sparsity" not in tiny["algorithm"]["options"]
    )
    assert mef["algorithm"]["options"]["activation_sparsity"] == 0.9, "FedMef keeps its config's options"
    assert tiny["train"]["lr"] == mef["train"]["lr"] == 0.3


def test_the_committed_verdict_tally_is_what_the_pages_hold() -> None:
    """A verdict changed on a page without ``fedfleet verdicts --write`` would leave a stale tally."""
    committed = rp.blocks_of(rp.TALLY_DOC.read_text())[rp.TALLY_MARKER]
    assert committed == rp.verdict_tally(), "run `.venv/bin/fedfleet verdicts --write`"


def test_verdict_tables_are_found_titled_and_counted() -> None:
    page = """# X

| check | measured | verdict |
|---|---|---|
| outside the verdict section | 1 | **fail** |

## Verdicts per dataset and model

**Digits, MLP, 3 seeds.** 2 of 4 hold.

| check | measured | verdict | explanation |
|---|---|---|---|
| 1 a \\|mean\\| check | 0.1 | pass | |
| 2 b | 3 | pass (FLOPs), latency worse | |
| 3 c | 4 | **fail** (untestable) | why |
| 4 d | – | reported | |

**Fashion-MNIST, a CNN.** Some prose after the title.

| check | measured | verdict | explanation |
|---|---|---|---|
| 1 a | 2 | **fail** | |

| not | a verdict | table |
|---|---|---|
| x | y | pass |

## Spec sections

| check | measured | verdict |
|---|---|---|
| after the section | 1 | pass |
"""
    tables = rp.verdict_tables("x.md", page)
    assert [(t.title, t.verdicts) for t in tables] == [
        ("Digits, MLP, 3 seeds", ("pass", "pass", "fail", "other")),
        ("Fashion-MNIST, a CNN", ("fail",)),
    ]
    # a title two paragraphs up belongs to another table: an error, not a silent carry-over
    stray = page.replace("after the title.\n", "after the title.\n\nA diagnostic paragraph.\n")
    with pytest.raises(ValueError, match="without a bold title right above it"):
        rp.verdict_tables("x.md", stray)
    assert [rp.classify(c) for c in ("pass", "**fail** at α 0.1", "differs by design", "–")] == [
        "pass",
        "fail",
        "other",
        "other",
    ]
