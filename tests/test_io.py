"""Atomic writes: all or nothing, and the permissions of a normal write (a server running as
another user must be able to read a checkpoint)."""
import os
from pathlib import Path

import pytest

from specforge.utils.io import atomic_dir, atomic_path, write_json


def test_atomic_path_keeps_old_file_on_error(tmp_path):
    target = tmp_path / "f.json"
    write_json(target, {"v": 1})
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash")
    assert target.read_text().strip().startswith("{") and '"v": 1' in target.read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_atomic_dir_replaces_whole_directory(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_dir(target) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as tmp:
            (tmp / "b").write_text("2")
            raise RuntimeError("crash")
    assert sorted(p.name for p in target.iterdir()) == ["a"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_written_files_and_dirs_are_readable_by_others(tmp_path):
    old = os.umask(0o022)
    try:
        write_json(tmp_path / "f.json", {})
        with atomic_dir(tmp_path / "d") as tmp:
            (tmp / "x").write_text("1")
    finally:
        os.umask(old)
    assert (tmp_path / "f.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o755


def test_a_checkpoint_and_a_training_state_have_one_mode_for_every_file(tmp_path):
    """safetensors writes 0600 files: a server running as another user could not read the weights
    beside a 0644 config.json."""
    import torch

    from specforge.checkpoint import save_checkpoint
    from specforge.train.state import save_training_state
    from tests.test_ttt import tiny_draft

    class FileStrategy:  # what a strategy does: write its own files into the state directory
        def save_state(self, directory):
            from safetensors.torch import save_file

            save_file({"w": torch.zeros(2)}, Path(directory) / "model.safetensors")

    old = os.umask(0o022)
    try:
        save_checkpoint(tiny_draft(), tmp_path / "epoch_1")
        save_training_state(tmp_path / "state", "epoch_1", FileStrategy(), {"step": 1}, {"step": 1})
    finally:
        os.umask(old)
    for directory in (tmp_path / "epoch_1", tmp_path / "state" / "epoch_1"):
        modes = {p.name: p.stat().st_mode & 0o777 for p in directory.iterdir()}
        assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes
        assert directory.stat().st_mode & 0o777 == 0o755
