"""Text every tracked file must be free of: a merge's conflict markers (a merge once left them in a doc)."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a line that starts a conflict's side or its separator, as git writes them
MARKER = re.compile(rb"^(<{7} |>{7} |={7}$)", re.MULTILINE)


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    return [ROOT / name.decode() for name in names if name and (ROOT / name.decode()).is_file()]


def test_no_tracked_file_holds_a_merge_conflict_marker():
    files = tracked_text_files()
    assert len(files) > 100  # the listing worked
    marked = [str(path.relative_to(ROOT)) for path in files if MARKER.search(path.read_bytes())]
    assert marked == []


def test_the_marker_pattern_finds_what_git_writes():
    conflict = b"a\n<<<<<<< HEAD\nours\n=======\ntheirs\n>>>>>>> branch\n"
    assert len(MARKER.findall(conflict)) == 3
    assert not MARKER.search(b"a heading\n=======\n".replace(b"=======\n", b"======== x\n"))


def test_no_two_test_files_share_a_name():
    """pytest imports test files by their base name (no packages under tests/): a second file of the same name
    fails to collect when both run in one process."""
    names = [path.name for path in (ROOT / "tests").rglob("test_*.py")]
    assert sorted({name for name in names if names.count(name) > 1}) == []
