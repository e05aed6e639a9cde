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
    resume_checks.check_images_per_step(run, 8, is_chief=True)  # a new run: recorded
    assert _recorded(run) == 8
    _checkpoint(run, 12)
    resume_checks.check_images_per_step(run, 8, is_chief=True)  # the same size resumes
    with pytest.raises(ValueError, match=r"trained to step 12 at 8 images per step .* gives "
                                         r"16\..*train\.init_weights='.*ckpt-12'"):
        resume_checks.check_images_per_step(run, 16, is_chief=False)
    assert _recorded(run) == 8


def test_without_checkpoints_or_a_record_the_run_goes_on_and_records(tmp_path):
    run = str(tmp_path / "run")
    resume_checks.check_images_per_step(run, 8, is_chief=True)
    resume_checks.check_images_per_step(run, 4, is_chief=True)  # nothing trained yet
    assert _recorded(run) == 4
    os.remove(os.path.join(run, "checkpoints", resume_checks.RECORD))
    _checkpoint(run, 3)  # checkpoints older than the record
    resume_checks.check_images_per_step(run, 2, is_chief=True)
    assert _recorded(run) == 2
    # Only the chief writes.
    os.remove(os.path.join(run, "checkpoints", resume_checks.RECORD))
    resume_checks.check_images_per_step(run, 2, is_chief=False)
    assert not os.path.exists(os.path.join(run, "checkpoints", resume_checks.RECORD))


def test_an_unreadable_record_is_named(tmp_path):
    run = str(tmp_path / "run")
    _checkpoint(run, 1)
    path = os.path.join(run, "checkpoints", resume_checks.RECORD)
    with open(path, "w") as f:
        f.write("{")
    with pytest.raises(ValueError, match=r"input\.json cannot be read .*Remove it"):
        resume_checks.check_images_per_step(run, 2, is_chief=True)
