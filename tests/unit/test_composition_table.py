"""THE table of refused combinations (``virtualflow.config.composition``) and the page generated
from it (docs/composition.md, ``scripts/gen_composition.py``).

- Each row's example facts satisfy its condition, and its message is one line; :func:`check`
  raises the first row (in the order named) whose condition holds and nothing when none does.
- The page's generated blocks are what the table and the script's cells give now (run
  ``python scripts/gen_composition.py`` after changing either).
- Every test the page names exists, and every row about two of the page's capabilities is a
  refused pair of the page or a refused corner of a working one.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from virtualflow.config.composition import CAPABILITIES, REFUSALS, check, check_stage_sharding, refusal
from virtualflow.config.pipeline import Pipeline

REPO = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("gen_composition", REPO / "scripts" / "gen_composition.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_composition", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("row", REFUSALS, ids=lambda r: r.key)
def test_each_rows_example_is_refused_with_its_one_line_message(row):
    assert row.when(**row.example)
    with pytest.raises(ValueError) as info:
        check(row.key, **row.example)
    assert str(info.value) == row.message() and "\n" not in row.message()


def test_check_raises_the_first_row_that_holds_in_the_order_named():
    facts = dict(flush=False, schedule="2bw", shard_replicas=1)
    with pytest.raises(ValueError, match=r"^shard_replicas=1 keeps a replica"):
        check("shard_replicas+pipeline", "sharded+no_flush", **facts)
    with pytest.raises(ValueError, match=r"^reduction='sharded' with Pipeline.schedule='2bw'"):
        check("sharded+no_flush", "shard_replicas+pipeline", **facts)
    check("sharded+no_flush", "shard_replicas+pipeline", **{**facts, "flush": True, "shard_replicas": 0})  # nothing refused
    with pytest.raises(KeyError, match="no refusal 'nope'"):
        refusal("nope")


def test_the_table_refuses_what_the_pipeline_and_the_sharded_stage_refused():
    assert Pipeline(stages=2, tensor=2, redundancy=True).redundancy  # built (tests/e2e/test_bamboo.py)
    with pytest.raises(ValueError, match=r"^reduction='sharded' with Pipeline.schedule='2bw'"):
        check_stage_sharding(Pipeline(stages=2, schedule="2bw"))
    check_stage_sharding(Pipeline(stages=2))


def test_the_page_is_generated_from_the_table():
    gen = _script()
    text = gen.PAGE.read_text()
    assert gen.render(text) == text, "docs/composition.md is out of date: run python scripts/gen_composition.py"


def test_every_test_the_page_names_exists_and_every_pair_row_is_on_the_page():
    gen = _script()
    names = {name for name, _ in CAPABILITIES}
    for pair, cell in gen.CELLS.items():
        for path, test in re.findall(r"`(tests/[\w/]+\.py)::(\w+)", cell.text):
            source = (REPO / path).read_text()
            assert re.search(rf"^def {test}\(", source, re.M), f"{pair}: {path}::{test} does not exist"
    for row in REFUSALS:
        if row.a in names and row.b in names:
            cell = gen.CELLS.get((row.a, row.b)) or gen.CELLS[(row.b, row.a)]
            assert cell.status == "refused at launch" or row.key in cell.corners, (
                f"row {row.key} refuses a pair the page says works, and is not one of its corners")
