"""docs/architecture.md held to the code: every module of labkit's folders is named in its
folder's section, every file the page names exists, and no module cites a page the repository
lacks (labkit's design lives in docs/architecture.md; there is no DESIGN.md)."""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
FOLDERS = ("runtime", "parallel", "runs", "theory", "viz", "exercises")
FILE = re.compile(r"^[\w./-]*\w\.(py|md|csv|json|ipynb|toml|yml|txt)$")   # `x/y.py`, `y.csv`
MODULE_ATTRIBUTE = re.compile(r"^([\w/]+/\w+)\.(\w+)$")                 # `parallel/hybrid.Name`


def sections():
    """(folder or None, text) per `###` section: the folder its heading names, if any."""
    out, folder, lines = [], None, []
    for line in DOC.read_text().splitlines():
        if line.startswith("#"):
            out.append((folder, "\n".join(lines)))
            named = re.match(r"#+ `(labkit/\w+)/`", line)
            folder, lines = (ROOT / named[1] if named else None), []
        lines.append(line)
    return out + [(folder, "\n".join(lines))]


def spans(text):
    return re.findall(r"`([^`\n]+)`", text)


def tracked_names():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout
    return {Path(f).name for f in files.split()} | {p.name for p in ROOT.rglob("*.py")}


def missing(span, folder, names):
    """Why the file `span` names does not exist ('' when it does, or names no file)."""
    bases = [ROOT, ROOT / "labkit"]
    if "/" not in span:
        if not FILE.match(span):
            return ""
        here = folder is not None and (folder / span).exists()
        return "" if here or (folder is None and span in names) else \
            f"`{span}`: no such file{f' in {folder.relative_to(ROOT)}/' if folder else ''}"
    if span.endswith("/"):
        return "" if any((b / span).is_dir() for b in bases) else f"`{span}`: no such folder"
    if FILE.match(span):
        return "" if any((b / span).exists() for b in bases) else f"`{span}`: no such file"
    named = MODULE_ATTRIBUTE.match(span)
    if named:   # a module's function, class or constant
        source = next((b / f"{named[1]}.py" for b in bases if (b / f"{named[1]}.py").exists()),
                      None)
        if source is None:
            return f"`{span}`: no module {named[1]}.py"
        defined = re.compile(rf"^\s*(def|class)\s+{named[2]}\b|^{named[2]}\s*[:=]", re.M)
        return "" if defined.search(source.read_text()) else \
            f"`{span}`: {named[1]}.py defines no {named[2]}"
    return ""


def test_every_file_the_page_names_exists():
    names = tracked_names()
    wrong = [why for folder, text in sections() for span in spans(text)
             if (why := missing(span, folder, names))]
    assert not wrong, "\n".join(wrong)


def test_the_path_check_catches_a_missing_file():
    names = tracked_names()
    assert missing("tests/test_packaging.py", None, names) == ""
    assert missing("runs/miniature_terms.py", None, names)           # moved to theory/
    assert missing("theory/miniature_terms.py", None, names) == ""
    assert missing("stamps.py", ROOT / "labkit" / "parallel", names)  # not in that folder
    assert missing("parallel/hybrid.shard_experts", None, names) == ""
    assert missing("parallel/moe.shard_experts", None, names)         # not defined there
    assert missing("DESIGN.md", None, names)


def test_every_module_is_named_in_its_folders_section():
    named = {folder: set(spans(text)) for folder, text in sections() if folder is not None}
    wrong = []
    for name in FOLDERS:
        folder = ROOT / "labkit" / name
        assert folder in named, f"docs/architecture.md has no section for labkit/{name}/"
        wrong += [f"labkit/{name}/{p.name}" for p in sorted(folder.glob("*.py"))
                  if p.name != "__init__.py" and p.name not in named[folder]]
    assert not wrong, "not named in docs/architecture.md: " + ", ".join(wrong)


def test_no_module_cites_a_design_md():
    citing = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "labkit").rglob("*.py"))
              for i, line in enumerate(p.read_text().splitlines(), 1) if "DESIGN.md" in line]
    assert not citing, "cites DESIGN.md, which the repository lacks: " + ", ".join(citing)
