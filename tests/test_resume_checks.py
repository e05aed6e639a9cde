"""A resumed run keeps the images per step its checkpoints were trained with."""
import json
import os

import pytest
import tensorflow as tf

from detr_tf.training import resume_checks


def _checkpoint(run_dir, step):
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(w=tf.Variable(1.0)),
                                         os.path.join(run_dir, "checkpoints"), max_to_keep=None)
    return manager.save(checkpoint_number=step)


def _recorded(run_dir):
    with open(os.path.join(run_dir, "checkpoints", resume_checks.RECORD)) as f:
        return json.load(f)["images_per_step"]


def test_a_resume_with_other_images_per_step_is_refused(tmp_path):
    run = str(tmp_path / "run")
    resume_checks.record_run(run, 8, "float32")
    _checkpoint(run, 12)
    resume_checks.check_images_per_step(run, 8)  # the same size resumes
    with pytest.raises(ValueError, match=r"trained to step 12 at 8 images per step .* gives "
                                         r"16\..*train\.init_weights='.*ckpt-12'"):
        resume_checks.check_images_per_step(run, 16)
    assert _recorded(run) == 8


def test_without_checkpoints_or_a_record_the_run_goes_on(tmp_path):
    run = str(tmp_path / "run")
    resume_checks.record_run(run, 8, "float32")
    resume_checks.check_images_per_step(run, 4)  # nothing trained yet
    os.remove(os.path.join(run, "checkpoints", resume_checks.RECORD))
    _checkpoint(run, 3)  # checkpoints older than the record
    resume_checks.check_images_per_step(run, 2)
    # Checking writes nothing: a run that fails before it is built leaves no file behind.
    fresh = tmp_path / "fresh"
    resume_checks.check_images_per_step(str(fresh), 2)
    assert not fresh.exists()


def test_an_unreadable_record_is_named(tmp_path):
    run = str(tmp_path / "run")
    _checkpoint(run, 1)
    with open(os.path.join(run, "checkpoints", resume_checks.RECORD), "w") as f:
        f.write("{")
    with pytest.raises(ValueError, match=r"input\.json cannot be read .*Remove it"):
        resume_checks.check_images_per_step(run, 2)
