"""paths.atomic_save_dir: readers see the old or the new complete folder, never a partial one."""

from pathlib import Path

import pytest

from hacrl_megatron.paths import atomic_save_dir


def _writer(text: str):
    def save(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "a.txt").write_text(text)
        (tmp / "b.txt").write_text(text * 2)
    return save


def test_first_save_and_kept_existing_folder(tmp_path):
    target = tmp_path / "deep" / "cache"
    atomic_save_dir(target, _writer("one"))
    assert (target / "b.txt").read_text() == "oneone"
    atomic_save_dir(target, _writer("two"))  # a cache: the folder already there wins
    assert (target / "a.txt").read_text() == "one"
    assert sorted(p.name for p in target.parent.iterdir()) == ["cache"]  # no temporary folder left


def test_replace_swaps_in_the_new_folder(tmp_path):
    target = tmp_path / "export"
    atomic_save_dir(target, _writer("old"))
    (target / "stale.txt").write_text("from the old export")
    atomic_save_dir(target, _writer("new"), replace=True)
    assert sorted(p.name for p in target.iterdir()) == ["a.txt", "b.txt"]
    assert (target / "a.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_a_failing_save_leaves_the_target_and_no_temporary_folder(tmp_path):
    target = tmp_path / "export"
    atomic_save_dir(target, _writer("old"))

    def broken(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "a.txt").write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_save_dir(target, broken, replace=True)
    assert (target / "a.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
