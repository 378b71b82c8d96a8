"""The environment's switch of the direct Triton launcher (:mod:`.direct`), read without importing Triton:
``launch/train.py`` checks it before anything starts."""
from __future__ import annotations

import os

DIRECT_SWITCH = "SNIP_DS_TRITON_DIRECT"  # "0": every eager launch through Triton's own JITFunction.run


def direct_switched_on(environ=os.environ) -> bool:
    """The environment's :data:`DIRECT_SWITCH` (:mod:`.direct`'s launcher): unset or ``1`` on, ``0`` off; any
    other value a ValueError naming it (a setting is never ignored). Needs no Triton: ``launch/train.py`` asks
    it before anything starts."""
    value = environ.get(DIRECT_SWITCH, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{DIRECT_SWITCH}={value!r}: expected 0 (launch through Triton's JITFunction.run) or 1 "
                         "(the direct launches, the default)")
    return value == "1"
