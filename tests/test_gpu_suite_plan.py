"""The GPU suite's `plan` row (benchmarks/gpu_suite_plan.py) in its CPU dry run: every row
measures, and the planner's estimate is within 10% of the live-tensor peak."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_suite_plan  # noqa: E402


def test_dry_run_rows_measure_and_agree(tmp_path):
    rows = gpu_suite_plan.main(["--dry-run", "--out", str(tmp_path / "plan.json")])
    assert rows and all("error" not in r for r in rows), rows
    for r in rows:
        assert 0.9 <= r["estimate / measured"] <= 1.1, r
    assert (tmp_path / "plan.json").is_file()
