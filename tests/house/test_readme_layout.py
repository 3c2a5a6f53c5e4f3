"""README's "Layout" names every library file, and every path it names exists.

Guards against the map going stale while the code moves: a module added under ``inference/`` or
``medusa_train/`` that no one wrote into the Layout (a reader never learns where it sits), or a
module moved or deleted whose old path the Layout still names (the official Medusa repo's trap: a
README pointing at files that do not exist). The file list is read from disk at test time.

The Layout's code block: one entry per line, a file or a folder ending in ``/``; entries indented by
two spaces below a folder are inside it; several names joined by `` | `` share one description, which
follows after two or more spaces.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("inference", "medusa_train")
ENTRY = re.compile(r"^(?P<indent> *)(?P<names>[\w.-]+/?(?: \| [\w.-]+/?)*)(?: {2,}\S.*)?$")


def layout_block(readme: str) -> list[str]:
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```\n", 2)[1].splitlines()


def named_paths(lines: list[str]) -> list[str]:
    """The repository paths the block names (folders end in /), resolved through the indentation."""
    stack: list[tuple[int, str]] = []   # (indent, folder path) of the folders above the current line
    paths = []
    for line in lines:
        if not line.strip():
            continue
        m = ENTRY.match(line)
        assert m, f"README Layout: cannot read the line {line!r} (names, then two spaces and a description)"
        indent = len(m["indent"])
        assert indent % 2 == 0, f"README Layout: odd indentation in {line!r}"
        while stack and stack[-1][0] >= indent:
            stack.pop()
        assert indent == (stack[-1][0] + 2 if stack else 0), f"README Layout: {line!r} is indented under no folder"
        parent = stack[-1][1] if stack else ""
        names = m["names"].split(" | ")
        paths += [parent + n for n in names]
        if len(names) == 1 and names[0].endswith("/"):
            stack.append((indent, parent + names[0]))
    return paths


def library_files() -> set[str]:
    return {p.relative_to(ROOT).as_posix() for pkg in LIBRARY for p in (ROOT / pkg).rglob("*.py")
            if p.name != "__init__.py" and "__pycache__" not in p.parts}


def test_every_path_the_layout_names_exists():
    paths = named_paths(layout_block((ROOT / "README.md").read_text()))
    assert len(paths) > 50
    missing = [p for p in paths if not (ROOT / p).exists() or (p.endswith("/") and not (ROOT / p).is_dir())]
    assert not missing, f"README Layout names paths that do not exist: {missing}"


def test_every_library_file_is_in_the_layout():
    named = set(named_paths(layout_block((ROOT / "README.md").read_text())))
    absent = sorted(library_files() - named)
    assert not absent, f"README Layout does not name these library files (add one line each): {absent}"


def test_the_parser_reads_nesting_and_shared_descriptions():
    """Guards against the checks above passing vacuously because the block was misread."""
    lines = ["inference/     decoding", "  heads/       families", "    a.py | b.py   one each",
             "  cli.py       entry", "scripts/       entry points"]
    assert named_paths(lines) == ["inference/", "inference/heads/", "inference/heads/a.py",
                                  "inference/heads/b.py", "inference/cli.py", "scripts/"]
