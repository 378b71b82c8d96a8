"""The module paths of the previous release, still importable for one release, with a DeprecationWarning.

The package was laid out by concern (docs/architecture.md): ``snip_ds.trainer`` is now ``snip_ds.run.trainer``,
``snip_ds.hf_checks`` ``snip_ds.hf.checks``, and so on (:data:`OLD_PATHS`). :func:`install` puts one finder at the
front of ``sys.meta_path``; importing an old name (``import snip_ds.trainer``, ``from snip_ds import console``,
``mock.patch("snip_ds.state.X")``) warns once and gives the new module itself (the same object, so a patch of an
old path patches what the code uses). Nothing in snip_ds imports an old path. Drop this module in the release after.
"""
import importlib
import importlib.abc
import importlib.util
import sys
import warnings

OLD_PATHS = {
    'snip_ds.ab': 'snip_ds.run.ab',
    'snip_ds.artifacts': 'snip_ds.report.artifacts',
    'snip_ds.builds': 'snip_ds.engine.builds',
    'snip_ds.compile_stance': 'snip_ds.runtime.compile_stance',
    'snip_ds.console': 'snip_ds.runtime.console',
    'snip_ds.corpus': 'snip_ds.run.corpus',
    'snip_ds.cpuinfo_cache': 'snip_ds.runtime.cpuinfo_cache',
    'snip_ds.data': 'snip_ds.run.data',
    'snip_ds.deepspeed_config': 'snip_ds.config.deepspeed_config',
    'snip_ds.deprecations': 'snip_ds.runtime.deprecations',
    'snip_ds.distributed': 'snip_ds.runtime.distributed',
    'snip_ds.export_calib': 'snip_ds.export.calib',
    'snip_ds.export_cli': 'snip_ds.export.cli',
    'snip_ds.export_config': 'snip_ds.export.config',
    'snip_ds.export_ct': 'snip_ds.export.ct',
    'snip_ds.export_files': 'snip_ds.export.files',
    'snip_ds.export_serve': 'snip_ds.export.serve',
    'snip_ds.export_trainer': 'snip_ds.export.trainer',
    'snip_ds.export_weights': 'snip_ds.export.weights',
    'snip_ds.faults': 'snip_ds.runtime.faults',
    'snip_ds.fileio': 'snip_ds.runtime.fileio',
    'snip_ds.global_rng': 'snip_ds.runtime.global_rng',
    'snip_ds.hf_checkpoint': 'snip_ds.hf.checkpoint',
    'snip_ds.hf_checks': 'snip_ds.hf.checks',
    'snip_ds.hf_loop': 'snip_ds.hf.loop',
    'snip_ds.hf_tp': 'snip_ds.hf.tp',
    'snip_ds.jit_builds': 'snip_ds.runtime.jit_builds',
    'snip_ds.model': 'snip_ds.run.model',
    'snip_ds.model_settings': 'snip_ds.config.model_settings',
    'snip_ds.nonfinite': 'snip_ds.engine.nonfinite',
    'snip_ds.omp': 'snip_ds.runtime.omp',
    'snip_ds.progress': 'snip_ds.report.progress',
    'snip_ds.resume': 'snip_ds.run.resume',
    'snip_ds.run_report': 'snip_ds.report.run_report',
    'snip_ds.run_summary': 'snip_ds.report.run_summary',
    'snip_ds.schedule': 'snip_ds.engine.schedule',
    'snip_ds.settings': 'snip_ds.config.settings',
    'snip_ds.state': 'snip_ds.engine.state',
    'snip_ds.stats.artifact': 'snip_ds.stats_file',
    'snip_ds.stats_table': 'snip_ds.report.stats_table',
    'snip_ds.tensorboard': 'snip_ds.report.tensorboard',
    'snip_ds.train_args': 'snip_ds.config.train_args',
    'snip_ds.train_stop': 'snip_ds.run.train_stop',
    'snip_ds.trainer': 'snip_ds.run.trainer',
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, module):
        old = module.__name__
        warnings.warn(f"{old} moved to {self.new}; the old path works until the next release "
                      f"(docs/architecture.md)", DeprecationWarning, stacklevel=2)
        # the import system returns what sys.modules holds under the old name once this returns
        sys.modules[old] = importlib.import_module(self.new)


class OldPathFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = OLD_PATHS.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    """Put the finder at the front of ``sys.meta_path`` (once)."""
    if not any(isinstance(f, OldPathFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, OldPathFinder())
