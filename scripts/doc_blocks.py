"""Generated blocks of the docs: the text between a pair of marker comments, written from a result file by the
script that owns it (`--write-docs`) and read back by the test that checks the doc still holds what that
script renders from the file."""


def read_block(path: str, markers: tuple[str, str]) -> str:
    """The text between `markers` (start, end) in the file at `path`."""
    text = open(path).read()
    return text.split(markers[0], 1)[1].split(markers[1], 1)[0]


def write_block(path: str, markers: tuple[str, str], body: str) -> None:
    """Replace the text between `markers` in the file at `path` with `body` (one line break on each side)."""
    text = open(path).read()
    head, rest = text.split(markers[0], 1)
    tail = rest.split(markers[1], 1)[1]
    with open(path, "w") as f:
        f.write(head + markers[0] + "\n" + body + "\n" + markers[1] + tail)
