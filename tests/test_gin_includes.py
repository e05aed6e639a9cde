"""Where a gin file's includes are read from: a file of the user's own that replaces a shipped
building block is named in a note, and an include that is found nowhere says where it was
looked for and how to add a directory."""
import gin
import pytest

from detr_tf import config


@pytest.fixture(autouse=True)
def _clear():
    gin.clear_config()
    yield
    gin.clear_config()


def test_a_local_file_replacing_a_shipped_include_is_named(tmp_path, monkeypatch, capsys):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "detr_recipe.gin").write_text(
        (config.GIN_CONFIGS_DIR / "train" / "detr_recipe.gin").read_text())
    monkeypatch.chdir(tmp_path)
    config.parse_gin_config(["tiny.gin"], defer_required=True)
    said = capsys.readouterr().out
    assert ("includes train/detr_recipe.gin: read from "
            f"{tmp_path / 'train' / 'detr_recipe.gin'}, which replaces the shipped "
            "gin_configs/train/detr_recipe.gin") in said, said
    gin.clear_config()
    monkeypatch.chdir(config.GIN_CONFIGS_DIR.parent)  # the repository: nothing replaced
    config.parse_gin_config(["tiny.gin"], defer_required=True)
    assert "replaces" not in capsys.readouterr().out


def test_an_include_found_nowhere_says_where_includes_are_looked_for(tmp_path, monkeypatch):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "base.gin").write_text("train.num_steps = 3\n")
    (tmp_path / "mine" / "exp.gin").write_text("include 'base.gin'\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(config.ConfigError, match=r"(?s)base\.gin.*not beside the file that "
                                                 r"includes it: add that file's directory to "
                                                 r"DETR_TF_GIN_PATH"):
        config.parse_gin_config([str(tmp_path / "mine" / "exp.gin")], defer_required=True)
    gin.clear_config()
    monkeypatch.setenv("DETR_TF_GIN_PATH", str(tmp_path / "mine"))
    config.parse_gin_config([str(tmp_path / "mine" / "exp.gin")], defer_required=True)
    assert gin.query_parameter("train.num_steps") == 3
