"""The console progress line: its ETA comes from the steps actually run since the first report,
so a slow first step (tracing, XLA compilation) does not inflate it."""
import io

from detr_tf.training import metrics_writer


def test_eta_ignores_the_time_before_the_first_report(monkeypatch):
    clock = iter([100.0, 110.0])
    monkeypatch.setattr(metrics_writer.time, "time", lambda: next(clock))
    out = io.StringIO()  # not a tty: one full line per report
    progress = metrics_writer.Progress(total_steps=1001, every_s=0.0, stream=out)
    # Step 1 is reported after a long compile; 100 steps then take 10 s: 10 steps/s, so the
    # remaining 900 steps need 90 s.
    progress.update(1, images_per_sec=1.0)
    progress.update(101, images_per_sec=80.0, loss=2.5)
    first, second = out.getvalue().splitlines()
    assert first.endswith("ETA --:--:--")
    assert "step 101/1001" in second and "loss 2.5000" in second
    assert second.endswith("ETA 00:01:30")


def test_metrics_jsonl_is_created_by_the_first_record_only(tmp_path):
    """A run that fails while it is being built leaves no metrics.jsonl behind."""
    import json

    writer = metrics_writer.MetricsWriter(str(tmp_path))
    assert list(tmp_path.iterdir()) == []
    writer.write(3, {"loss": 1.5})
    writer.write(4, {"loss": 1.25})
    writer.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 3, "split": "train", "loss": 1.5}, {"step": 4, "split": "train", "loss": 1.25}]
    metrics_writer.MetricsWriter(str(tmp_path / "unused")).close()  # closing with no record


def test_a_resumed_run_leaves_out_the_rows_of_the_steps_it_takes_again(tmp_path, capsys):
    """Killed at step 5 with its last checkpoint at 3: the rows of steps 4 and 5 (and a line
    the kill cut short) go, so each step has one row when the resumed run logs them again."""
    import json

    writer = metrics_writer.MetricsWriter(str(tmp_path))
    for step in range(1, 6):
        writer.write(step, {"loss": 1.0 / step})
    writer.write(3, {"AP": 0.5}, split="eval")
    writer.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "spl')  # the kill
    resumed = metrics_writer.MetricsWriter(str(tmp_path))
    resumed.resume_at(3)
    assert "left out 3 row(s) past step 3" in capsys.readouterr().out
    for step in (4, 5):
        resumed.write(step, {"loss": 2.0})
    resumed.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"]) for r in rows] == [
        (1, "train"), (2, "train"), (3, "train"), (3, "eval"), (4, "train"), (5, "train")]
    assert rows[-1]["loss"] == 2.0
    # Nothing past the step: the file is left as it is, and nothing is said.
    metrics_writer.MetricsWriter(str(tmp_path)).resume_at(5)
    assert capsys.readouterr().out == ""
