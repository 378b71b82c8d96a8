"""The previous release's module paths still import, as the new modules themselves, with a DeprecationWarning."""
import importlib
import sys
from unittest import mock

import pytest

import snip_ds
from snip_ds.runtime.old_paths import OLD_PATHS


def _forget(name):
    sys.modules.pop(name, None)
    parent, _, leaf = name.rpartition(".")
    if parent in sys.modules and leaf in vars(sys.modules[parent]):
        delattr(sys.modules[parent], leaf)


def test_every_old_path_names_a_module_that_exists():
    assert OLD_PATHS, "no old paths"
    for old, new in OLD_PATHS.items():
        assert importlib.util.find_spec(new) is not None, f"{old} -> {new}: no such module"
        assert old != new


def test_an_old_path_warns_and_gives_the_new_module():
    _forget("snip_ds.console")
    with pytest.warns(DeprecationWarning, match=r"snip_ds\.console moved to snip_ds\.runtime\.console"):
        old = importlib.import_module("snip_ds.console")
    new = importlib.import_module("snip_ds.runtime.console")
    assert old is new
    assert new.__name__ == "snip_ds.runtime.console" and new.__spec__.name == "snip_ds.runtime.console"


def test_from_package_import_of_an_old_module_name():
    _forget("snip_ds.fileio")
    with pytest.warns(DeprecationWarning, match="moved to snip_ds.runtime.fileio"):
        from snip_ds import fileio
    from snip_ds.runtime import fileio as new
    assert fileio is new


def test_an_old_name_inside_an_existing_package():
    _forget("snip_ds.stats.artifact")
    with pytest.warns(DeprecationWarning, match="moved to snip_ds.stats_file"):
        from snip_ds.stats.artifact import STATS_FORMAT
    from snip_ds.stats_file import STATS_FORMAT as new
    assert STATS_FORMAT == new


def test_a_patch_through_an_old_path_patches_the_module_in_use():
    from snip_ds.runtime import fileio
    _forget("snip_ds.fileio")
    with pytest.warns(DeprecationWarning):
        with mock.patch("snip_ds.fileio.atomic_write_text") as patched:
            assert fileio.atomic_write_text is patched
    assert fileio.atomic_write_text is not patched


def test_names_that_never_existed_still_fail():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("snip_ds.no_such_module")
    with pytest.raises(AttributeError):
        getattr(snip_ds, "no_such_name")
