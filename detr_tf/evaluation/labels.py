"""Where to put each detection's tag on a drawing: inside the image, never over another tag.

Greedy, in the order given (the drawing passes the most confident detection first): each tag
takes the first of its box's preferred spots that is free of every tag placed before it, and
among free spots it prefers the one covering the least of the other boxes. When all of them are
taken, spots further from the box are searched, ring by ring; if the image has no free spot
left, the tag is not placed.
"""
from typing import Iterator, List, Optional, Sequence, Tuple

Rect = Tuple[float, float, float, float]  # x0, y0, x1, y1 (x1, y1 exclusive)


def overlap(a: Rect, b: Rect) -> float:
    """The area two rectangles share."""
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    return w * h if w > 0 and h > 0 else 0.0


def _clamp(x: float, y: float, tw: int, th: int, width: int, height: int) -> Tuple[int, int]:
    return (int(round(min(max(x, 0), max(width - tw, 0)))),
            int(round(min(max(y, 0), max(height - th, 0)))))


def preferred_spots(box: Sequence[float], tw: int, th: int
                    ) -> List[Tuple[float, float]]:
    """A box's tag spots, best first: above it, below it, inside its top and bottom edges,
    left-aligned, then the same right-aligned."""
    x0, y0, x1, y1 = box
    left = [(x0, y0 - th), (x0, y1), (x0, y0), (x0, y1 - th)]
    return left + [(x1 - tw, y) for _, y in left]


def _ring_spots(box: Sequence[float], tw: int, th: int, width: int, height: int
                ) -> Iterator[Tuple[float, float]]:
    """Spots further and further from the box's top-left, one ring of tag-sized steps at a
    time, until a ring lies wholly outside the image."""
    x0, y0 = box[0], box[1] - th
    for ring in range(1, max(width // max(tw // 2, 1), height // max(th, 1)) + 2):
        for dy in range(-ring, ring + 1):
            for dx in range(-ring, ring + 1):
                if max(abs(dx), abs(dy)) == ring:
                    yield x0 + dx * tw / 2, y0 + dy * th


def place_labels(boxes: Sequence[Sequence[float]], sizes: Sequence[Tuple[int, int]],
                 canvas_size: Tuple[int, int]) -> List[Optional[Tuple[int, int]]]:
    """The top-left corner of each tag, or None where no free spot is left.

    Args:
      boxes: [N] boxes x0, y0, x1, y1 in canvas pixels, in placing order.
      sizes: [N] (width, height) of each tag.
      canvas_size: (width, height) of the canvas; every tag lies inside it (unless the tag is
        larger than the canvas).

    Returns:
      [N] (x, y) or None.
    """
    width, height = canvas_size
    placed: List[Rect] = []
    out: List[Optional[Tuple[int, int]]] = []
    for j, (box, (tw, th)) in enumerate(zip(boxes, sizes)):
        others = [tuple(b) for i, b in enumerate(boxes) if i != j]

        def free(spot):
            rect = (spot[0], spot[1], spot[0] + tw, spot[1] + th)
            return rect if not any(overlap(rect, p) for p in placed) else None

        best = None
        for spot in dict.fromkeys(_clamp(*s, tw, th, width, height)
                                  for s in preferred_spots(box, tw, th)):
            rect = free(spot)
            if rect is None:
                continue
            cost = sum(overlap(rect, o) for o in others)  # how much of other objects it hides
            if best is None or cost < best[0]:
                best = (cost, spot, rect)
        if best is None:
            for spot in _ring_spots(box, tw, th, width, height):
                rect = free(_clamp(*spot, tw, th, width, height))
                if rect:
                    best = (0, (int(rect[0]), int(rect[1])), rect)
                    break
        out.append(best[1] if best else None)
        if best:
            placed.append(best[2])
    return out
