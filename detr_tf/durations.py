"""Human-readable durations and counts for the console: the progress line's ETA, final
summaries, and a count with its noun ('1 step', '4 steps').

Standard library only, so tools that never load TensorFlow (the CPU report and its verdict)
print durations the way a training run does.
"""
import math


def format_duration(seconds: float) -> str:
    """'HH:MM:SS', with a day count in front from 24 hours on ('3d 01:02:03'): COCO runs last
    days, and a clock format alone would wrap. '--:--:--' when unknown (inf or NaN)."""
    if not math.isfinite(seconds):
        return "--:--:--"
    total = int(round(max(seconds, 0.0)))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    clock = f"{hours:02d}:{minutes:02d}:{secs:02d}"
    return f"{days}d {clock}" if days else clock


def format_elapsed(seconds: float) -> str:
    """A human duration for final summaries: '47 s', '9 min 20 s', '2 h 05 min', '3 d 4 h'."""
    total = int(round(max(seconds, 0.0)))
    if total < 60:
        return f"{total} s"
    if total < 3600:
        return f"{total // 60} min {total % 60} s"
    if total < 86400:
        return f"{total // 3600} h {total % 3600 // 60:02d} min"
    return f"{total // 86400} d {total % 86400 // 3600} h"


def counted(n: int, noun: str) -> str:
    """A count with its noun, singular for one: '1 step', '4 steps', '0 images', '2 batches'."""
    if n == 1:
        return f"{n} {noun}"
    return f"{n} {noun}{'es' if noun.endswith(('s', 'x', 'ch', 'sh')) else 's'}"
