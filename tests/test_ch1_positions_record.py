"""book/data/ch1_positions_replication.json (benchmarks/ch1_positions_control.py --replicate):
chapter 1's positions-moved control on fresh seeds, its claims fixed before the run."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

def test_the_positions_replication_holds_its_claims_before_its_run_on_fresh_seeds():
    """book/data/ch1_positions_replication.json: the control's two claims, verbatim, committed
    before the run (the claims' commit is the run's), on seeds the pilot never trained, and the
    verdicts the rows give."""
    import subprocess
    import sys

    sys.path.insert(0, str(ROOT))
    import benchmarks.ch1_positions_control as ctl

    record = json.loads((ROOT / ctl.REPLICATION_OUT).read_text())
    pilot = json.loads((ROOT / "book/data/extrapolation_results.json").read_text())
    control = json.loads((ROOT / ctl.OUT).read_text())
    assert record["status"] == "done" and record["claims"] == ctl.CLAIMS == control["claims"]
    assert record["seeds"] == list(ctl.FRESH_SEEDS) == [r["seed"] for r in record["rows"]]
    assert not set(record["seeds"]) & set(pilot["seeds"])
    assert record["claims_written"] < record["started"]
    known = subprocess.run(["git", "cat-file", "-e", record["claims_commit"]], cwd=ROOT,
                           capture_output=True).returncode == 0
    if known:  # a shallow clone may lack the history
        assert record["commit"] == record["claims_commit"]
        before = json.loads(subprocess.run(
            ["git", "show", f"{record['claims_commit']}:{ctl.REPLICATION_OUT}"], cwd=ROOT,
            capture_output=True, text=True, check=True).stdout)
        assert before["status"] == "claims" and before["claims"] == record["claims"]
    for row in record["rows"]:
        assert row["check_max_abs_diff"] is None  # no pilot model to check a fresh seed against
        for k in ("2", "4", "8"):
            assert abs(row["share"][k] - row["rise_moved"][k] / row["rise_long"][k]) < 1e-12
    assert record["decided"] == ctl.decide(record["rows"])
