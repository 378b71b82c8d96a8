"""snip_ds.hf.checkpoint: the one check of a Trainer checkpoint's shape before the Trainer loads it."""
import json
import pytest

from snip_ds.hf.checkpoint import check_resume_shape
from snip_ds.hf.checks import TrainerChecks
from snip_ds.config.settings import ConfigError, SnipSettings


def _checks(deepspeed):
    """What check_trainer resolves for one rank without tensor parallelism, with or without a DeepSpeed config."""
    config = {} if deepspeed else None
    return TrainerChecks(SnipSettings(), "SnipCallback(settings=...)", config, deepspeed, world=1, tp=1)


def _checkpoint(tmp_path, step=4, **fields) -> str:
    folder = tmp_path / f"checkpoint-{step}"
    folder.mkdir()
    (folder / "snip_state.json").write_text(json.dumps({"format": "snip_ds.state/1", "step": step, **fields}))
    return str(folder)


def test_another_tensor_parallel_degree_is_refused_with_or_without_deepspeed(tmp_path):
    folder = _checkpoint(tmp_path, world_size=2, tensor_parallel=2)
    with pytest.raises(ConfigError, match=rf"^{folder}/snip_state.json: saved at tensor_parallel.autotp_size 2, "
                                          r"this run has 1: the Trainer resumes a checkpoint at the tensor-parallel"):
        check_resume_shape(_checks(None), tmp_path, folder)
    with pytest.raises(ConfigError, match=rf"^{folder}/snip_state.json: saved by 2 rank\(s\) at "
                                          r"tensor_parallel.autotp_size 2, this run has 1 rank\(s\) at 1"):
        check_resume_shape(_checks("ds.json"), tmp_path, folder)
    with pytest.raises(ConfigError, match=r"saved at tensor_parallel.autotp_size 2, this run has 1"):
        check_resume_shape(_checks(None), tmp_path, True)  # True: the output directory's last one


def test_another_number_of_ranks_is_refused_only_under_deepspeed(tmp_path):
    folder = _checkpoint(tmp_path, world_size=2)
    check_resume_shape(_checks(None), tmp_path, folder)  # the Trainer's own files load at any
    with pytest.raises(ConfigError, match=r"saved by 2 rank\(s\) at tensor_parallel.autotp_size 1, this run has 1"):
        check_resume_shape(_checks("ds.json"), tmp_path, folder)


def test_what_fits_or_holds_no_snip_state_is_left_to_the_trainer(tmp_path):
    folder = _checkpoint(tmp_path, world_size=1)
    for given in (folder, True, None, False, str(tmp_path / "missing")):
        check_resume_shape(_checks("ds.json"), tmp_path, given)
    (tmp_path / "checkpoint-4" / "snip_state.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=rf"^{folder}/snip_state.json: not a JSON object"):
        check_resume_shape(_checks(None), tmp_path, folder)
