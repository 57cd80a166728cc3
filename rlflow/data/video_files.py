"""Reading a JSONL row's video: an animated image (PIL), any other clip (PyAV, when installed),
a directory of frame images, or a list of frame paths; and spreading a clip's frames evenly over
the recipe's frame count. rlflow.data.jsonl reads the rows and calls these."""

from __future__ import annotations

FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def read_video(row, open_image, read_error) -> list:
    """A row's video (`row.video`) as RGB PIL frames, all the size of the first; a file that
    cannot be decoded raises `read_error(row, "video", message)`, naming the JSONL line."""
    from PIL import Image, ImageSequence

    if isinstance(row.video, tuple):
        frames = [open_image(row, p, "video") for p in row.video]
    elif row.video.is_dir():
        files = sorted(p for p in row.video.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)
        frames = [open_image(row, p, "video") for p in files]
    else:
        try:
            with Image.open(row.video) as clip:
                frames = [f.convert("RGB") for f in ImageSequence.Iterator(clip)]
        except OSError as exc:
            frames = _decode_with_av(row, exc, read_error)
    size = frames[0].size if frames else None
    return [f if f.size == size else f.resize(size) for f in frames]


def _decode_with_av(row, pil_error: Exception, read_error) -> list:
    try:
        import av  # optional: rlflow does not depend on it
    except ImportError:
        raise read_error(
            row, "video", f"cannot read video {row.video}: {pil_error} (and PyAV is not installed)"
        ) from pil_error
    try:
        with av.open(str(row.video)) as container:
            return [frame.to_image().convert("RGB") for frame in container.decode(video=0)]
    except Exception as exc:  # PyAV raises its own error types per codec problem
        raise read_error(row, "video", f"cannot read video {row.video}: {exc}") from exc


def uniform_frames(frames: list, num_frames: int) -> tuple:
    """num_frames frames spread evenly over the clip (repeating frames of a short clip)."""
    if num_frames == len(frames):
        return tuple(frames)
    step = len(frames) / num_frames
    return tuple(frames[min(int(i * step), len(frames) - 1)] for i in range(num_frames))
