"""snip_ds.runtime.deprecations: third-party messages a user cannot act on are dropped, each matched by library and text:
torch's FutureWarnings for the deprecated collectives when DeepSpeed calls them (a user's own call is shown, once
per process, however often the warning filters change in between: a re-plan's ``catch_warnings`` block changes
them), DeepSpeed's accelerator guess, torchao's optional kernels; every other warning and log line is kept."""
import logging
import subprocess
import sys

import pytest

from train_utils import REPO, env

_SCRIPT = """
import logging, sys, warnings
sys.path.insert(0, {repo!r})
from typing_extensions import deprecated
if {install}:
    from snip_ds.runtime.deprecations import quiet_third_party
    quiet_third_party()
    quiet_third_party()  # idempotent

def _deprecated(name):  # as torch marks the collectives (typing_extensions.deprecated), from a torch module
    scope = {{"__name__": "torch.distributed.c10d_fake", "deprecated": deprecated}}
    message = f"`torch.distributed.{{name}}` is deprecated. Please use `torch.distributed.{{name}}_single` instead."
    exec(compile(f'''@deprecated({{message!r}}, category=FutureWarning)
def {{name}}(): pass
def wrapper(): return {{name}}()''', "/x/torch/distributed/c10d_fake.py", "exec"), scope)
    return scope["wrapper"]

def _caller(module, func):  # a function of module `module` calling func
    scope = {{"__name__": module, "func": func}}
    exec(compile("def call():\\n    func()\\n", f"/x/{{module.replace('.', '/')}}.py", "exec"), scope)
    return scope["call"]

gather, scatter = _deprecated("all_gather_into_tensor"), _deprecated("reduce_scatter_tensor")
deepspeed_gather = _caller("deepspeed.comm.torch", gather)
user_scatter = _caller("user_code", scatter)
for step in range(5):
    deepspeed_gather()
    user_scatter()
    warnings.warn("something else is deprecated", FutureWarning)
    with warnings.catch_warnings(record=True):  # what a re-plan does around its solve
        warnings.simplefilter("always")

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
logging.getLogger("DeepSpeed").warning("Setting accelerator to CPU. If you have GPU or other accelerator, "
                                       "we were unable to detect it.")
logging.getLogger("DeepSpeed").warning("Setting accelerator to XPU")
logging.getLogger("torchao").warning("Failed to load /env/site-packages/torchao/_C_mxfp8.cpython-310.so: no")
logging.getLogger("torchao").warning("Failed to load something else")
logging.getLogger("torch.utils._pytree").warning("<enum 'K'> is an Enum subclass and is now natively supported by "
                                                 "torch.compile as an opaque value type.")
if {install}:
    from snip_ds.runtime.deprecations import LR_BEFORE_START, dropped_logs
    with dropped_logs("DeepSpeed", LR_BEFORE_START):
        logging.getLogger("DeepSpeed").warning("Attempting to get learning rate from scheduler before it has started")
logging.getLogger("DeepSpeed").warning("Attempting to get learning rate from scheduler before it has started")
"""


@pytest.mark.parametrize("install", [True, False])
def test_dropped_messages_are_deepspeeds_and_torchaos_only(install):
    proc = subprocess.run([sys.executable, "-c", _SCRIPT.format(repo=str(REPO), install=install)], env=env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()

    def count(text):
        return sum(text in line for line in lines)

    assert count("something else is deprecated") == 5  # each time the filters changed, as Python does
    # DeepSpeed's calls: dropped; the user's own: once (without the filter: each time the filters changed)
    assert (count("all_gather_into_tensor` is deprecated"), count("reduce_scatter_tensor` is deprecated")) == (
        (0, 1) if install else (5, 5))
    assert count("Setting accelerator to CPU") == (0 if install else 1)
    assert count("Setting accelerator to XPU") == 1 and count("Failed to load something else") == 1
    assert count("torchao/_C_mxfp8") == (0 if install else 1)
    assert count("is an Enum subclass") == (0 if install else 1)
    assert count("before it has started") == 1  # dropped inside the block only


def test_the_logger_filters_are_installed_once():
    from snip_ds.runtime.deprecations import MessageFilter, quiet_third_party

    quiet_third_party()
    quiet_third_party()
    assert sum(isinstance(f, MessageFilter) for f in logging.getLogger("DeepSpeed").filters) == 1
