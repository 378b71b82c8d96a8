"""snip_ds.deprecations: torch's FutureWarnings for the collectives DeepSpeed calls are shown once per process,
however often the warning filters change in between (a re-plan's ``catch_warnings`` block changes them); other
warnings are shown as Python shows them."""
import subprocess
import sys

import pytest

from train_utils import REPO, env

_SCRIPT = """
import sys, warnings
sys.path.insert(0, {repo!r})
if {install}:
    from snip_ds.deprecations import show_deprecations_once
    show_deprecations_once()
    show_deprecations_once()  # idempotent

def collective(name):  # as torch/distributed/c10d_logger.py warns for DeepSpeed's calls
    warnings.warn(f"`torch.distributed.{{name}}` is deprecated. Please use `torch.distributed.{{name}}_single` "
                  "instead.", FutureWarning)

def other():
    warnings.warn("something else is deprecated", FutureWarning)

for step in range(5):
    collective("all_gather_into_tensor")
    collective("reduce_scatter_tensor")
    other()
    with warnings.catch_warnings(record=True):  # what a re-plan does around its solve
        warnings.simplefilter("always")
"""


@pytest.mark.parametrize("install", [True, False])
def test_each_deprecated_collective_is_shown_once_and_other_warnings_as_before(install):
    proc = subprocess.run([sys.executable, "-c", _SCRIPT.format(repo=str(REPO), install=install)], env=env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    gather = sum("`torch.distributed.all_gather_into_tensor` is deprecated" in line for line in lines)
    scatter = sum("`torch.distributed.reduce_scatter_tensor` is deprecated" in line for line in lines)
    others = sum("something else is deprecated" in line for line in lines)
    assert others == 5  # each time the filters changed, as Python does
    assert (gather, scatter) == ((1, 1) if install else (5, 5))
