"""benchmarks/bench_rank_start.py: both ways of loading fused_adam measured in one run, results written."""
import json
import sys

import pytest

from train_utils import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import bench_rank_start  # noqa: E402


def test_a_bad_repeat_count_names_the_flag(capsys):
    with pytest.raises(SystemExit) as info:
        bench_rank_start.main(["--repeats", "0"])
    assert info.value.code == 2 and "--repeats: must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_one_repeat_measures_both_loads_and_writes_the_tables(tmp_path):
    assert bench_rank_start.main(["--repeats", "1", "--output_dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "bench_rank_start.json").read_text())
    assert set(res["times_s"]) == {"deepspeed", "kept"} and all(len(t) == 1 for t in res["times_s"].values())
    assert all(t > 0 for ts in res["times_s"].values() for t in ts)
    assert res["ratio"] == pytest.approx(res["median_s"]["deepspeed"] / res["median_s"]["kept"])
    md = (tmp_path / "bench_rank_start.md").read_text()
    assert f"| kept per CPU (snip_ds.runtime.cpuinfo_cache) | {res['median_s']['kept']:.2f} |" in md
