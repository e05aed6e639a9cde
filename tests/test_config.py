"""Gin entry point: strict parsing, file lookup and plain error messages."""
from pathlib import Path

import gin
import pytest

from detr_tf import config
from tests import tool_helpers

REPO = Path(__file__).resolve().parent.parent


@gin.configurable
def _probe(value=1):
    return value


@pytest.fixture(autouse=True)
def _clear_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def test_unknown_configurable_names_it():
    with pytest.raises(config.ConfigError, match="no_such_configurable"):
        config.parse_gin_config([], ["no_such_configurable.x = 1"], finalize=False)


def test_unknown_parameter_names_it():
    with pytest.raises(config.ConfigError, match="not_a_param"):
        config.parse_gin_config([], ["_probe.not_a_param = 3"], finalize=False)


def test_a_bracket_left_open_is_a_config_error_naming_the_binding():
    with pytest.raises(config.ConfigError, match=r"(?s)invalid gin configuration .*_probe.value = "
                                                 r"\(4.*TokenError"):
        config.parse_gin_config([], ["_probe.value = (4"], finalize=False)


def test_a_macro_nothing_sets_is_named_with_the_way_to_set_it(tmp_path):
    block = tmp_path / "block.gin"
    block.write_text("_probe.value = %UNSET_SIZE\n")
    with pytest.raises(config.ConfigError, match=r"UNSET_SIZE is used but never set \(gin files "
                                                 r".*block.gin.*--gin_param=\"UNSET_SIZE=...\""):
        config.parse_gin_config([str(block)], [], finalize=True)
    gin.clear_config()
    config.parse_gin_config([str(block)], ["UNSET_SIZE = 9"], finalize=True)
    assert _probe() == 9


def test_binding_applies():
    config.parse_gin_config([], ["_probe.value = 7"], finalize=False)
    assert _probe() == 7


def test_missing_file_lists_where_it_looked():
    with pytest.raises(config.ConfigError, match="nope_missing.gin.*looked in"):
        config.resolve_gin_file("nope_missing.gin")


def test_file_found_relative_to_gin_configs_and_cwd(tmp_path, monkeypatch):
    (tmp_path / "mine.gin").write_text("_probe.value = 11\n")
    monkeypatch.chdir(tmp_path)
    assert config.resolve_gin_file("mine.gin") == str(tmp_path / "mine.gin")
    assert config.resolve_gin_file("mine") == str(tmp_path / "mine.gin")
    config.parse_gin_config(["mine.gin"], [], finalize=False)
    assert _probe() == 11
    # A shipped file is found with or without the gin_configs/ prefix, from any directory.
    shipped = sorted((REPO / "gin_configs").rglob("*.gin"))
    if shipped:
        rel = shipped[0].relative_to(REPO / "gin_configs")
        assert Path(config.resolve_gin_file(f"gin_configs/{rel}")) == shipped[0]
        assert Path(config.resolve_gin_file(str(rel))) == shipped[0]


def _run_train(*args):
    return tool_helpers.run_tool("train.py", *args, timeout=300)


def test_train_script_rejects_bad_config_without_traceback(tmp_path):
    bad_param = _run_train("--gin_param=train.no_such_param = 1", f"--model_dir={tmp_path}")
    assert bad_param.returncode != 0
    assert "no_such_param" in bad_param.stderr and "Traceback" not in bad_param.stderr

    missing = _run_train("--gin_file=does_not_exist.gin", f"--model_dir={tmp_path}")
    assert missing.returncode != 0
    assert "does_not_exist.gin" in missing.stderr and "Traceback" not in missing.stderr


def test_a_missing_gin_file_is_named_before_tensorflow_loads():
    proc = tool_helpers.run_python(
        "import sys\nfrom detr_tf import config\ntry:\n"
        "    config.parse_gin_config(['does_not_exist.gin'])\n"
        "except config.ConfigError as e:\n    print(e)\n"
        "print('tensorflow loaded:', 'tensorflow' in sys.modules)")
    assert "gin file 'does_not_exist.gin' not found; looked in: " in proc.stdout, proc.stdout
    assert proc.stdout.splitlines()[-1] == "tensorflow loaded: False", proc.stdout


def test_train_names_a_model_dir_that_is_empty_or_a_file_and_expands_home(tmp_path,
                                                                           monkeypatch):
    a_file = tmp_path / "a_file"
    a_file.write_text("kept")
    monkeypatch.setenv("HOME", str(tmp_path))
    for model_dir, said in [("", "--model_dir is empty"),
                            (str(a_file), f"--model_dir='{a_file}' is a file"),
                            # The shell leaves this `~` alone; the tool expands it.
                            ("~/a_file", f"--model_dir='{a_file}' is a file"),
                            (str(a_file / "run"), f"('{a_file}' is a file)")]:
        proc = _run_train("--gin_file=tiny.gin", f"--model_dir={model_dir}")
        assert proc.returncode == 1 and said in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert a_file.read_text() == "kept" and not (REPO / "~").exists()


def test_required_macro_names_the_macro_and_how_to_set_it():
    # detr_r50.gin leaves the COCO paths and the ImageNet backbone to the user.
    data = [f"{m} = 'x'" for m in ("COCO_TRAIN_PATTERN", "COCO_VAL_PATTERN",
                                   "COCO_VAL_ANNOTATIONS")]
    with pytest.raises(config.ConfigError,
                       match=r"BACKBONE_WEIGHTS is required .*--gin_param=\"BACKBONE_WEIGHTS="):
        config.parse_gin_config(["detr_r50.gin"], data)
    config.parse_gin_config(["detr_r50.gin"], data + ["BACKBONE_WEIGHTS = '/w/r50.pth'"],
                            finalize=False)
    assert gin.query_parameter("%BACKBONE_WEIGHTS") == "/w/r50.pth"
    assert str(gin.query_parameter("train.init_weights")) == "%BACKBONE_WEIGHTS"


def test_a_data_block_before_the_experiment_file_says_to_give_it_after():
    """data/custom_data.gin replaces an experiment file's COCO data only when it comes after
    it; before it, the experiment file's required COCO paths win, and the error says why."""
    given = ["DATA_DIR = '/data/mine'"]
    with pytest.raises(config.ConfigError, match=r"COCO_TRAIN_PATTERN is required .*note: "
                       r"data/custom_data.gin comes before rtdetr_r18vd.gin.*give the "
                       r"experiment file first and data/custom_data.gin after it"):
        config.parse_gin_config(["data/custom_data.gin", "rtdetr_r18vd.gin"], given)
    with pytest.raises(config.ConfigError) as e:  # a COCO path really missing: no note
        config.parse_gin_config(["rtdetr_r18vd.gin"], [])
    assert "COCO_TRAIN_PATTERN is required" in str(e.value) and "note" not in str(e.value)
    config.parse_gin_config(["rtdetr_r18vd.gin", "data/custom_data.gin"], given, finalize=False)
    assert gin.query_parameter("%DATA_DIR") == "/data/mine"
    gin.clear_config()
