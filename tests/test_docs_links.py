"""The docs' cross-references resolve: section links name a heading, result files exist.

The docs link each figure to its one home (README.md#quickstart, docs/PERFORMANCE.md#matcher,
docs/perf/*.json), so a renamed heading or a moved JSON silently breaks a reader's path.
Anchors follow GitHub's rule for heading ids: lower case, punctuation other than '-' and '_'
dropped, spaces turned into '-', and '-1', '-2', ... appended to repeated headings.
"""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Files whose text may link to a doc's section: the docs, configs, code and tools.
SOURCES = [*DOCS, *sorted(REPO.glob("gin_configs/**/*.gin")),
           *sorted(REPO.glob("detr_tf/**/*.py")), *sorted(REPO.glob("tools/*.py"))]
_SECTION_LINK = re.compile(r"((?:docs/)?[A-Z]+\.md)#([\w\-]+)")
_LOCAL_LINK = re.compile(r"\]\(#([\w\-]+)\)")
_RESULT_FILE = re.compile(r"docs/perf/([\w\-.]+\.json)")


def _slug(heading: str) -> str:
    heading = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return heading.replace(" ", "-")


def _anchors(doc: Path) -> set:
    """The ids GitHub gives the headings of `doc` (code blocks left out)."""
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)
    seen, ids = {}, set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug = _slug(heading)
        ids.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return ids


ANCHORS = {doc.relative_to(REPO).as_posix(): _anchors(doc) for doc in DOCS}


def _doc_key(name: str) -> str:
    return name if name.startswith("docs/") or name == "README.md" else f"docs/{name}"


def test_the_slug_rule_gives_the_ids_the_docs_rely_on():
    assert _slug("Host visits: train.steps_per_loop") == "host-visits-trainsteps_per_loop"
    assert _slug("The quickstart's class loss and matching cost (measured)") == (
        "the-quickstarts-class-loss-and-matching-cost-measured")
    assert "quickstart" in ANCHORS["README.md"] and "matcher" in ANCHORS["docs/PERFORMANCE.md"]


def test_every_section_link_names_a_heading():
    broken = []
    for source in SOURCES:
        text, name = source.read_text(), source.relative_to(REPO).as_posix()
        for doc, anchor in _SECTION_LINK.findall(text):
            if anchor not in ANCHORS.get(_doc_key(doc), ()):
                broken.append(f"{name}: {doc}#{anchor}")
        if source in DOCS:
            broken += [f"{name}: #{a}" for a in _LOCAL_LINK.findall(text) if a not in ANCHORS[name]]
    assert not broken, f"links to no heading: {broken}"


def test_every_result_file_a_doc_cites_exists():
    missing = [f"{doc.relative_to(REPO)}: {name}" for doc in DOCS
               for name in sorted(set(_RESULT_FILE.findall(doc.read_text())))
               if not (REPO / "docs" / "perf" / name).is_file()]
    assert not missing, f"docs/perf files cited but not there: {missing}"
