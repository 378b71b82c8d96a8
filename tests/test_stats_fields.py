"""The statistics' named sums: each estimator module declares its own, and no two share a name."""
from snip_ds.stats import bwd, common, fld, fwd, isotropic
from snip_ds.stats.common import SumField


def _declared(module):
    found = []
    for value in vars(module).values():
        if isinstance(value, SumField):
            found.append(value)
        elif isinstance(value, dict):
            found.extend(v for v in value.values() if isinstance(v, SumField))
    return found


def test_every_sum_has_one_owner():
    owners = {}
    for module in (common, fld, bwd, fwd, isotropic):
        for f in _declared(module):
            owners.setdefault(f.name, set()).add(module.__name__)
    shared = {name: mods for name, mods in owners.items() if len(mods) > 1}
    assert shared == {}
    # the per-channel vectors fold into a scalar of the same module
    for module in (fld, bwd):
        names = {f.name for f in _declared(module)}
        for f in module.FOLDS + getattr(module, "LAYER_FOLDS", ()):
            assert f.folded_into is not None and f.folded_into.name in names
