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
