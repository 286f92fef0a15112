"""Every section the code cites ("SPEC §N", "math §N") exists in docs/math.md.

The code, CLI output and HTML reports cite the project's math reference as ``SPEC §4``,
``(SPEC §3, §7)``, ``SPEC §4–§6`` (a range) or ``SPEC §6, step 6``; ``docs/math.md`` keeps the
numbering of that specification. This test scans ``src/geosharp/**/*.py``, ``docs/*.md`` and the
README for such citations and checks that each cited section ``N`` is a ``## N.`` heading of
``docs/math.md`` (and a cited ``N.M`` a ``### N.M`` heading), that the sections are exactly 1…10
in order, and that the cross-references inside ``docs/math.md`` resolve too.
"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
MATH = ROOT / "docs" / "math.md"
N_SECTIONS = 10

# A citation: "SPEC" / "SPEC.md" / "math" / "math.md", then one or more "§N" / "§N.M" joined by
# commas, semicolons, "and", "to" or a dash (a range). Whitespace may include line breaks
# (citations wrap in docstrings). "SPEC Eq. 5" names an equation, not a section: not matched.
_REF = r"§\d+(?:\.\d+)?"
_SEP = r"\s*(?:,|;|–|—|-|\band\b|\bto\b)\s*"
CITATION = re.compile(rf"\b(?:SPEC|math)(?:\.md)?\s+({_REF}(?:{_SEP}{_REF})*)")
# Inside docs/math.md: a bare "§N" that is not a reference to the paper ("paper §3.1").
INTERNAL = re.compile(rf"(?<!paper )({_REF}(?:{_SEP}{_REF})*)")
_ONE = re.compile(r"(–|—|-|\bto\b)?\s*§(\d+)(?:\.(\d+))?")
SECTION = re.compile(r"^## (\d+)\. \S", re.M)
SUBSECTION = re.compile(r"^### (\d+)\.(\d+) \S", re.M)


def refs(run: str) -> list[tuple[int, int | None]]:
    """The ``(section, subsection)`` pairs of one citation run; ranges ``§4–§6`` are expanded."""
    out: list[tuple[int, int | None]] = []
    for m in _ONE.finditer(run):
        sec, sub = int(m.group(2)), (int(m.group(3)) if m.group(3) else None)
        if m.group(1) and out and sub is None and out[-1][1] is None:
            out.extend((s, None) for s in range(out[-1][0] + 1, sec))
        out.append((sec, sub))
    return out


def cited_files() -> list[pathlib.Path]:
    files = sorted((ROOT / "src" / "geosharp").rglob("*.py"))
    files += sorted((ROOT / "docs").glob("*.md"))
    files.append(ROOT / "README.md")
    return [f for f in files if f.is_file()]


def headings(text: str) -> tuple[list[int], list[tuple[int, int]], dict[tuple[int, int], int]]:
    """Section numbers, subsection numbers and, per subsection, its enclosing section."""
    secs = [(m.start(), int(m.group(1))) for m in SECTION.finditer(text)]
    subs = [(m.start(), (int(m.group(1)), int(m.group(2)))) for m in SUBSECTION.finditer(text)]
    parent = {}
    for pos, key in subs:
        above = [n for p, n in secs if p < pos]
        parent[key] = above[-1] if above else 0
    return [n for _, n in secs], [k for _, k in subs], parent


def test_citation_parser():
    assert refs("§4") == [(4, None)]
    assert refs("§3, §7") == [(3, None), (7, None)]
    assert refs("§4–§6") == [(4, None), (5, None), (6, None)]
    assert refs("§4.4 and §9") == [(4, 4), (9, None)]
    text = (
        "(SPEC §2, §6).\nSPEC\n    §4 with h = 1; SPEC Eq. 5; paper §7; math.md §8.3; "
        "SPEC §6, step 6"
    )
    found = [r for m in CITATION.finditer(text) for r in refs(m.group(1))]
    assert found == [(2, None), (6, None), (4, None), (8, 3), (6, None)]


def test_math_md_has_its_sections_in_order():
    secs, subs, parent = headings(MATH.read_text(encoding="utf-8"))
    assert secs == list(range(1, N_SECTIONS + 1))
    for sec in range(1, N_SECTIONS + 1):
        numbers = [m for (s, m) in subs if s == sec]
        assert numbers == list(range(1, len(numbers) + 1)), f"§{sec} subsections {numbers}"
    for (s, m), p in parent.items():
        assert s == p, f"### {s}.{m} sits under ## {p}."


def test_every_cited_section_exists():
    secs, subs, _ = headings(MATH.read_text(encoding="utf-8"))
    have = set(secs)
    have_sub = set(subs)
    missing, n_cites = [], 0
    for path in cited_files():
        text = path.read_text(encoding="utf-8")
        for m in CITATION.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            for sec, sub in refs(m.group(1)):
                n_cites += 1
                ok = sec in have and (sub is None or (sec, sub) in have_sub)
                if not ok:
                    label = f"§{sec}" + (f".{sub}" if sub is not None else "")
                    missing.append(f"{path.relative_to(ROOT)}:{line}: {label}")
    # The code cites the reference in dozens of places; finding none means the pattern broke.
    assert n_cites > 50
    assert not missing, "cited sections missing from docs/math.md:\n" + "\n".join(missing)


def test_internal_cross_references_of_math_md_resolve():
    text = MATH.read_text(encoding="utf-8")
    secs, subs, _ = headings(text)
    bad = []
    for m in INTERNAL.finditer(text):
        for sec, sub in refs(m.group(1)):
            if sec not in secs or (sub is not None and (sec, sub) not in subs):
                line = text.count("\n", 0, m.start()) + 1
                bad.append(f"docs/math.md:{line}: §{sec}" + (f".{sub}" if sub else ""))
    assert not bad, "\n".join(bad)


def test_the_math_reference_ships_with_the_package():
    """Reports and CLI output cite it: it is package data, readable where geosharp is installed."""
    from importlib.resources import files

    text = (files("geosharp") / "math.md").read_text(encoding="utf-8")
    assert "## 8." in text and "## 9." in text
    pyproject = (pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert 'geosharp = ["math.md"]' in pyproject


def test_one_math_reference():
    """docs/math.md is the package's math.md (a link), so the two can never differ."""
    package = ROOT / "src" / "geosharp" / "math.md"
    assert MATH.is_symlink() and MATH.resolve() == package.resolve()
    assert MATH.read_text() == package.read_text()
