"""The up-front check of a weights path (--weights, train.init_weights): every kind the importer
reads passes, whatever its name, and what it cannot read is said in words that follow the path,
so the caller can put its flag or binding before them."""
import shutil
from pathlib import Path

import tensorflow as tf

from detr_tf import weight_sources

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "weights"
EXPECTED = ("give a .safetensors or torch .pth file, a save_pretrained directory, or a detr_tf "
            "run directory or ckpt-N prefix")


def test_every_kind_the_importer_reads_passes_whatever_its_name(tmp_path):
    run = tmp_path / "run"
    prefix = tf.train.CheckpointManager(tf.train.Checkpoint(w=tf.Variable(1.0)),
                                        str(run / "checkpoints"), max_to_keep=1).save(7)
    pretrained = tmp_path / "save_pretrained"
    pretrained.mkdir()
    shutil.copy(FIXTURES / "detr_hf4.safetensors", pretrained / "model.safetensors")
    odd = tmp_path / "weights.h5"  # safetensors under another extension: read by its content
    shutil.copy(FIXTURES / "detr_hf4.safetensors", odd)
    index = pretrained / "model.safetensors.index.json"  # a sharded checkpoint of one shard
    index.write_text('{"weight_map": {"class_labels_classifier.bias": "model.safetensors"}}')
    for path in (FIXTURES / "detr_reference.safetensors", FIXTURES / "detr_reference.pth", odd,
                 pretrained, index, run, run / "checkpoints", prefix, "gs://bucket/run"):
        assert weight_sources.problem(str(path)) is None, path


def test_what_it_cannot_read_is_said_after_the_path(tmp_path, monkeypatch):
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty.safetensors").write_bytes(b"")
    (tmp_path / "model.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(8))
    said = {name: weight_sources.problem(str(tmp_path / name))
            for name in ("missing.pth", "empty_dir", "empty.safetensors", "model.h5")}
    assert said == {
        "missing.pth": f"does not exist: {EXPECTED}",
        "empty_dir": ("is a directory with no complete detr_tf checkpoint in it (nor in its "
                      "checkpoints/) and no model.safetensors / model.safetensors.index.json / "
                      f"pytorch_model.bin / pytorch_model.bin.index.json: {EXPECTED}"),
        "empty.safetensors": f"is an empty file: {EXPECTED}",
        "model.h5": ("is neither a safetensors file nor a torch checkpoint (first bytes "
                     f"b'\\x89HDF\\r\\n\\x1a\\n'): {EXPECTED}")}
    # Tests run as root, whom no permission stops: the refusal is the file system's answer.
    monkeypatch.setattr(weight_sources.os, "access", lambda path, mode: False)
    assert weight_sources.problem(str(FIXTURES / "detr_reference.safetensors")) == (
        f"cannot be read (permission denied): {EXPECTED}")
