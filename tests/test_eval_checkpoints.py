"""The checkpoint a tool's --checkpoint names (its prefix, one of its files, a directory, or a
bare name in the run: ckpt-2000, best), and where tools/eval.py writes: the run's eval/ only for
what the trainer itself evaluates (its latest checkpoint, with the EMA weights when it kept
them), a folder of its own otherwise."""
import os
import re

import pytest
import tensorflow as tf

from detr_tf.evaluation import checkpoint_flag, evaluate


def _save_run(run_dir, steps, ema):
    values = {"w": tf.Variable(1.0)}
    if ema:
        values["ema"] = tf.Variable(2.0)
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(**values),
                                         os.path.join(run_dir, "checkpoints"), max_to_keep=None)
    return [manager.save(checkpoint_number=step) for step in steps]


def test_the_latest_checkpoint_writes_the_runs_eval_and_older_ones_their_own(tmp_path):
    run = str(tmp_path / "run")
    older, latest = _save_run(run, (10, 20), ema=False)
    assert evaluate.eval_subdir(run, latest) == "eval"
    # Without EMA weights, asking for raw ones changes nothing.
    assert evaluate.eval_subdir(run, latest, use_ema=False) == "eval"
    assert evaluate.eval_subdir(run, older) == os.path.join("eval", "ckpt-10")


def test_raw_weights_beside_ema_ones_get_their_own_folder(tmp_path):
    run = str(tmp_path / "run")
    latest, = _save_run(run, (5,), ema=True)
    assert evaluate.eval_subdir(run, latest) == "eval"
    assert evaluate.eval_subdir(run, latest, use_ema=False) == os.path.join(
        "eval", "ckpt-5_without_ema")


def test_checkpoints_elsewhere_in_or_outside_the_run_are_named_by_their_path(tmp_path):
    run = str(tmp_path / "run")
    _save_run(run, (3,), ema=False)
    best = tf.train.Checkpoint(w=tf.Variable(0.0)).write(os.path.join(run, "best", "ckpt"))
    assert evaluate.eval_subdir(run, best) == os.path.join("eval", "best_ckpt")
    # Another run's checkpoint: named with that run, never as this run's own ckpt-3.
    other, = _save_run(str(tmp_path / "other"), (3,), ema=False)
    assert evaluate.eval_subdir(run, other) == os.path.join("eval", "other_ckpt-3")
    loose = tf.train.Checkpoint(w=tf.Variable(0.0)).write(str(tmp_path / "loose" / "ckpt-3"))
    assert evaluate.eval_subdir(run, loose) == os.path.join("eval", "loose_ckpt-3")
    # A run with no checkpoint of its own: nothing given is its result.
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    assert evaluate.eval_subdir(empty, other) == os.path.join("eval", "other_ckpt-3")


def _save_best(run_dir):
    """What BestCheckpoint keeps: one checkpoint named otherwise, without a state file."""
    return tf.train.Checkpoint(w=tf.Variable(0.0)).write(os.path.join(run_dir, "best", "ckpt"))


def test_a_checkpoint_is_found_by_its_prefix_a_file_of_it_or_its_name_in_the_run(tmp_path):
    run = str(tmp_path / "run")
    _, latest = _save_run(run, (10, 20), ema=False)
    for given in (latest, latest + ".index", latest + ".data-00000-of-00001", "ckpt-20",
                  "ckpt-20.index"):
        assert checkpoint_flag.checkpoint_prefix(run, given) == latest, given


def test_a_bare_best_is_the_runs_best_weights_from_any_working_directory(tmp_path, monkeypatch,
                                                                          capsys):
    run = str(tmp_path / "run")
    _save_run(run, (10,), ema=False)
    best = _save_best(run)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # holds no `best`: the name was taken from here and failed
    assert checkpoint_flag.checkpoint_prefix(run, "best") == best
    assert capsys.readouterr().out.splitlines() == [
        f"detr_tf: --checkpoint=best is a directory ({os.path.join(run, 'best')}): restoring "
        f"its latest checkpoint, {best}"]


def test_the_runs_name_wins_over_the_working_directorys_and_says_so(tmp_path, monkeypatch,
                                                                    capsys):
    """The documented reading: a bare name is a name in the run; ./NAME the working
    directory's."""
    run = str(tmp_path / "run")
    ours, = _save_run(run, (10,), ema=False)
    cwd = tmp_path / "cwd"
    _save_run(str(cwd), (10,), ema=False)  # the working directory is another run's checkpoints/
    monkeypatch.chdir(cwd / "checkpoints")
    assert checkpoint_flag.checkpoint_prefix(run, "ckpt-10") == ours
    assert capsys.readouterr().out.splitlines() == [
        f"detr_tf: note: --checkpoint=ckpt-10 is the run's, {ours}, not the working "
        "directory's (give ./ckpt-10 for that one)"]
    assert checkpoint_flag.checkpoint_prefix(run, "./ckpt-10") == "./ckpt-10"
    assert capsys.readouterr().out == ""


def test_a_name_found_nowhere_lists_what_the_run_holds(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    _save_run(run, (10, 20, 30, 40, 50, 60), ema=False)
    _save_best(run)
    (tmp_path / "run" / "eval").mkdir()  # holds no checkpoint: not a name to give
    monkeypatch.chdir(tmp_path)
    holds = (f"--model_dir={run!r} holds ckpt-10, ..., ckpt-40, ckpt-50, ckpt-60, best: give one "
             "of these names, a checkpoint prefix, one of its files or a directory holding "
             "checkpoints")
    with pytest.raises(FileNotFoundError) as error:
        checkpoint_flag.checkpoint_prefix(run, "ckpt-99")
    assert str(error.value) == ("--checkpoint='ckpt-99' is in neither --model_dir (nor its "
                                f"checkpoints/) nor the working directory; {holds}")
    missing = os.path.join(run, "checkpoints", "ckpt-99")
    with pytest.raises(FileNotFoundError) as error:
        checkpoint_flag.checkpoint_prefix(run, missing)
    assert str(error.value) == (f"--checkpoint={missing!r} names no checkpoint (no "
                                f"{missing}.index); {holds}")


def test_a_directory_gives_its_latest_checkpoint_and_says_which(tmp_path, capsys):
    run = str(tmp_path / "run")
    _, latest = _save_run(run, (10, 20), ema=False)
    for given in (run, os.path.join(run, "checkpoints"), os.path.join(run, "checkpoints", "")):
        assert checkpoint_flag.checkpoint_prefix(str(tmp_path / "other"), given) == latest, given
        said = capsys.readouterr().out.splitlines()
        assert said == [f"detr_tf: --checkpoint={given} is a directory: restoring its latest "
                        f"checkpoint, {latest}"], said
    best = _save_best(run)
    assert checkpoint_flag.checkpoint_prefix(run, os.path.join(run, "best")) == best


def test_a_checkpoint_that_is_not_there_is_named_before_the_model_is_built(tmp_path):
    """No Gin configuration is parsed here: building the model would fail otherwise."""
    from detr_tf.evaluation import restore

    run = str(tmp_path / "run")
    _save_run(run, (10,), ema=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=re.escape(
            f"--checkpoint={str(empty)!r} is a directory holding no checkpoint (looked in it "
            f"and in {os.path.join(str(empty), 'checkpoints')!r})")):
        restore.load_trained_model(run, checkpoint=str(empty))
    missing = os.path.join(run, "checkpoints", "ckpt-99")
    with pytest.raises(FileNotFoundError, match=re.escape(
            f"--checkpoint={missing!r} names no checkpoint (no {missing}.index)")):
        restore.load_trained_model(run, checkpoint=missing)


def test_bindings_that_differ_from_the_runs_config_are_named(tmp_path, capsys):
    """A two-stage DETR's query count shapes no variable, so its checkpoint restores under
    another one without a mismatch: the tools name the difference."""
    import gin

    from detr_tf.evaluation import restore

    (tmp_path / "config.gin").write_text("NUM_QUERIES = 30\nNUM_CLASSES = 4\n")
    gin.clear_config()
    try:
        gin.parse_config("NUM_QUERIES = 31\nNUM_CLASSES = 4\n")
        restore.note_differences(str(tmp_path))
        assert ("note: bindings that differ from the run's config.gin (trained -> now): "
                "NUM_QUERIES: 30 -> 31") in capsys.readouterr().out
        gin.clear_config()
        gin.parse_config("NUM_QUERIES = 30\nNUM_CLASSES = 4\n")
        restore.note_differences(str(tmp_path))
        assert capsys.readouterr().out == ""
    finally:
        gin.clear_config()
