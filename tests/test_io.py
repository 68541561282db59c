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


@pytest.fixture
def disk_log(monkeypatch):
    """What reaches the disk, in order: ("fsync", path) and ("replace", src, dst), recorded around the
    real calls (a power loss cannot be staged in a test; the order of the calls is what makes the
    write survive one)."""
    import specforge.utils.io as io

    log = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        log.append(("replace", str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(io.os, "fsync", fsync)
    monkeypatch.setattr(io.os, "replace", replace)
    return log


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name a descriptor's file")
def test_a_file_is_on_the_disk_before_its_rename_and_the_rename_before_the_write_returns(tmp_path, disk_log):
    target = tmp_path / "f.json"
    write_json(target, {"v": 1})
    (_, synced), (_, src, dst), last = disk_log
    assert synced == src and Path(src).parent == tmp_path and dst == str(target)
    assert last == ("fsync", str(tmp_path))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name a descriptor's file")
def test_every_file_of_a_directory_is_on_the_disk_before_the_directory_is_renamed(tmp_path, disk_log):
    target = tmp_path / "ckpt"
    for version in (1, 2):  # the second replaces the first: the old one is moved aside, then removed
        disk_log.clear()
        with atomic_dir(target) as tmp:
            (tmp / "sub").mkdir()
            (tmp / "sub" / "a").write_text(str(version))
            (tmp / "b").write_text(str(version))
        first_rename = next(i for i, e in enumerate(disk_log) if e[0] == "replace")
        synced = {Path(e[1]).relative_to(tmp) for e in disk_log[:first_rename]}
        assert synced == {Path("."), Path("sub"), Path("sub/a"), Path("b")}
        assert disk_log[-1] == ("fsync", str(tmp_path))
    assert (target / "sub" / "a").read_text() == "2"
