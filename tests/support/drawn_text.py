"""The texts a matplotlib figure really draws, with their boxes: what a reader of the image sees."""

import contextlib

import matplotlib.text


@contextlib.contextmanager
def recording_texts():
    """Inside, every non-empty visible `Text` drawn (tick labels, titles, legends, annotations)
    is appended to the yielded list as ``(text, Bbox in display pixels)``."""
    drawn = []
    real = matplotlib.text.Text.draw

    def draw(self, renderer):
        if self.get_visible() and self.get_text().strip():
            drawn.append((self.get_text(), self.get_window_extent(renderer)))
        return real(self, renderer)

    matplotlib.text.Text.draw = draw
    try:
        yield drawn
    finally:
        matplotlib.text.Text.draw = real


def drawn_texts(drawing) -> list:
    """``[(text, Bbox)]`` of every text ``drawing`` (an autoprec figure) puts in its image."""
    with recording_texts() as drawn:
        drawing.to_array()
    return drawn


def overlaps(drawn) -> list:
    """The pairs of drawn texts whose boxes share a pixel."""
    return [(a, b) for i, (a, box_a) in enumerate(drawn) for b, box_b in drawn[i + 1:] if box_a.overlaps(box_b)]


def outside(drawn, drawing) -> list:
    """The drawn texts that stick out of the image (cut at its edge)."""
    width, height = drawing.size
    return [t for t, box in drawn if box.x0 < 0 or box.y0 < 0 or box.x1 > width or box.y1 > height]
