"""atomic_files.write_text: the file is replaced whole, and a failed write leaves nothing."""
import os

import pytest

from detr_tf import atomic_files


def test_a_file_is_replaced_whole_and_a_failed_write_leaves_no_temporary(tmp_path):
    path = tmp_path / "config.gin"
    path.write_text("old")
    atomic_files.write_text(str(path), "new")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["config.gin"]
    (tmp_path / "a_dir").mkdir()
    with pytest.raises(OSError):  # a directory cannot be replaced by a file
        atomic_files.write_text(str(tmp_path / "a_dir"), "text")
    assert sorted(os.listdir(tmp_path)) == ["a_dir", "config.gin"]
