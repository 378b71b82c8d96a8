"""Adam's second moments read from DeepSpeed's partitioned ZeRO 1/2/3 state, against ZeRO-0's full state."""
import json
import subprocess
import sys

import pytest

from train_utils import REPO, env

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
SCRIPT = REPO / "tests" / "dist_scripts" / "adam_state_probe.py"


def _run(tmp_path, stage: int, ranks: int) -> dict:
    from snip_ds.engine.core import _free_port

    out = tmp_path / f"stage{stage}_{ranks}.json"
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port",
           str(_free_port()), str(SCRIPT), "--stage", str(stage), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_partitioned_preconditioner_matches_full_state(tmp_path):
    """Σ over ranks of the owned Σ(t⊙P)² equals the full-state value (same global batch: the second
    moments agree up to FP32 reduction order, so 1e-4 relative)."""
    ref = _run(tmp_path, 0, 1)
    assert ref["source"] == "adam"
    for stage in (1, 2, 3):
        got = _run(tmp_path, stage, 2)
        assert got["source"] == f"zero{stage}"
        assert set(got["layers"]) == set(ref["layers"]) and len(ref["layers"]) == 14
        for fqn, value in ref["layers"].items():
            assert got["layers"][fqn] == pytest.approx(value, rel=1e-4), (stage, fqn)
