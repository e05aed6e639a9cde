"""Every shipped experiment file (gin_configs/*.gin) parses, as dopamine's gin_config_test does.

Each file is parsed strictly with its %gin.REQUIRED macros given dummy values, without building
anything. The required macros are found by reading the files themselves (following `include`s,
the last assignment of a macro wins), independently of Gin, and each must be named in the file's
header comment (STYLE.md: values a user must set are listed there).
"""
import re
from pathlib import Path
from typing import Dict

import gin
import pytest

from detr_tf import config

GIN_DIR = Path(__file__).resolve().parent.parent / "gin_configs"
TOP_LEVEL = sorted(p.name for p in GIN_DIR.glob("*.gin"))
_INCLUDE = re.compile(r"""^include\s+['"](.+)['"]\s*$""")
_MACRO = re.compile(r"^([A-Z][A-Z0-9_]*)\s*=\s*(.+?)\s*$")


def _macro_values(path: Path) -> Dict[str, str]:
    """Macro name -> its last assigned value text, in the order Gin applies the files."""
    values: Dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].rstrip()
        include = _INCLUDE.match(line)
        if include:
            values.update(_macro_values(GIN_DIR / include.group(1)))
            continue
        macro = _MACRO.match(line)
        if macro:
            values[macro.group(1)] = macro.group(2)
    return values


def required_macros(path: Path) -> list:
    return sorted(name for name, value in _macro_values(path).items()
                  if value == "%gin.REQUIRED")


def _header(path: Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return "\n".join(lines)


def test_top_level_files_exist():
    assert "quickstart.gin" in TOP_LEVEL and "tiny.gin" in TOP_LEVEL


def test_macro_scanner_sees_overrides():
    # shapes.gin leaves SHAPES_CACHE_DIR required; tiny.gin sets it after the include.
    assert required_macros(GIN_DIR / "data" / "shapes.gin") == ["SHAPES_CACHE_DIR"]
    assert "SHAPES_CACHE_DIR" not in required_macros(GIN_DIR / "tiny.gin")


@pytest.mark.parametrize("name", TOP_LEVEL)
def test_gin_file_parses_with_dummy_required_values(name):
    path = GIN_DIR / name
    required = required_macros(path)
    bindings = [f"{macro} = '/dummy/{macro.lower()}'" for macro in required]
    gin.clear_config()
    try:
        config.parse_gin_config([str(path)], bindings, finalize=False)
        for macro in required:
            assert gin.query_parameter(f"%{macro}") == f"/dummy/{macro.lower()}"
        # Every experiment file configures a model, a criterion and the training run.
        model_fn = gin.query_parameter("train.model_fn")
        assert gin.query_parameter(f"{model_fn.selector}.num_classes") is not None
    finally:
        gin.clear_config()


@pytest.mark.parametrize("name", TOP_LEVEL)
def test_header_gives_command_and_required_values(name):
    header = _header(GIN_DIR / name)
    assert f"--gin_file=gin_configs/{name}" in header, f"{name}: header lacks the command"
    for macro in required_macros(GIN_DIR / name):
        assert macro in header, f"{name}: required macro {macro} is not named in the header"


@pytest.mark.parametrize("name, backbone_share", [
    # RT-DETR's and RT-DETRv2-M/L's groups give the backbone lr 1e-5 of the main 1e-4;
    # RT-DETRv2-S's config replaces the groups with one for its norms, so its backbone trains at
    # the main rate.
    ("rtdetr_r18vd.gin", 0.1), ("rtdetr_v2_r50vd.gin", 0.1), ("rtdetr_v2_r18vd.gin", 1.0)])
def test_the_backbone_rate_is_the_references_share_of_the_main_rate(name, backbone_share):
    path = GIN_DIR / name
    bindings = [f"{m} = '/dummy/{m.lower()}'" for m in required_macros(path)]
    gin.clear_config()
    try:
        config.parse_gin_config([str(path)], bindings, finalize=False)
        main = gin.query_parameter("build_optimizers.learning_rate")
        backbone = gin.query_parameter("build_optimizers.backbone_learning_rate")
        assert backbone == pytest.approx(backbone_share * main, rel=1e-12)
    finally:
        gin.clear_config()


# Recipes whose reference trains on PIL images (their resize filters when it shrinks): every
# COCO file, and the DETR-R50 fine-tune, whose reference is DETR's own train script.
_REFERENCE_DATA = ("COCO_TRAIN_PATTERN", "TFDS_DATA_DIR")
_PINNED_UNFILTERED = ("quickstart.gin", "custom_cpu.gin")  # published figures measured so


def _bound(parameter: str):
    """The value bound to `parameter` in the parsed config, None when nothing binds it."""
    try:
        return gin.query_parameter(parameter)
    except ValueError:
        return None


def _parse_with_dummy_data(name: str) -> bool:
    """Parses top-level file `name` with its required macros bound to dummy paths; True when
    it trains on a reference's data (`_REFERENCE_DATA`, or the DETR-R50 fine-tune)."""
    path = GIN_DIR / name
    required = required_macros(path)
    gin.clear_config()
    config.parse_gin_config([str(path)], [f"{m} = '/dummy/{m.lower()}'" for m in required],
                            finalize=False)
    return any(m in required for m in _REFERENCE_DATA) or name == "finetune_detr_r50.gin"


@pytest.mark.parametrize("name", TOP_LEVEL)
def test_the_train_resize_filters_as_the_reference_where_it_trains_on_its_data(name):
    try:
        reference = _parse_with_dummy_data(name)
        # A scoped transform (DEIM's plain tail) reads the unscoped binding unless it has its own.
        for selector in ("detr_train_transform", "tail/detr_train_transform"):
            got = _bound(f"{selector}.antialias")
            if selector.startswith("tail/") and got is None:
                continue
            if reference:
                assert got is True, f"{name}: {selector}.antialias is {got}"
            elif name in _PINNED_UNFILTERED:
                assert got is False, f"{name}: {selector}.antialias should be pinned to False"
            else:
                assert not got, f"{name}: {selector}.antialias {got}, not the reference's data"
    finally:
        gin.clear_config()


_MIXING_PINNED_UNFILTERED = ("deim_dfine_quickstart.gin",)  # published figures measured so


@pytest.mark.parametrize("name", TOP_LEVEL)
def test_mosaic_and_mixup_resizes_filter_as_the_reference_where_it_trains_on_its_data(name):
    """DEIM's reference resizes PIL images before its mosaic and mixup (mixing.py)."""
    try:
        reference = _parse_with_dummy_data(name)
        uses_mosaic = _bound("random_mosaic.output_size") is not None
        for parameter in ("random_mosaic.antialias", "random_mixup.antialias"):
            got = _bound(parameter)
            if uses_mosaic and reference:
                assert got is True, f"{name}: {parameter} is {got}"
            elif name in _MIXING_PINNED_UNFILTERED:
                assert uses_mosaic and got is False, f"{name}: {parameter} should be pinned False"
            else:
                assert not got, f"{name}: {parameter} {got}, not the reference's data"
    finally:
        gin.clear_config()
