"""Every number the notebooks, README and package attribute to the paper is one `paper.py` holds.

A *citing clause* is a sentence piece (split at ``;``, table cells and parentheses) that names the
paper: "paper", "Figure N", "Fig. N", "§N" or "Table 1". Every number in it must be a number of
:mod:`paged_attention.experiments.paper` (as written there, or rounded to the digits the text
shows). References themselves (figure, section, notebook numbers), model and GPU names and years
are not numbers of the claim. A clause that quotes the paper and our own measurement together
should be split, so a reader can tell whose number is whose.
"""

from __future__ import annotations

import io
import json
import re
import tokenize
from pathlib import Path

import pytest

from paged_attention.experiments import paper

ROOT = Path(__file__).resolve().parent.parent
CITES = re.compile(r"\bpaper\b|\bpaper's\b|\bFigures? \d|\bFig\. ?\d|§ ?\d|\bTable 1\b", re.IGNORECASE)
REFERENCES = re.compile(
    r"(?:Figures?|Fig\.|Table|§|notebooks?|cells?|steps?|sections?)\s*\d+(?:\.\d+)*[a-z]?"
    r"(?:\s*(?:,|and|or|-|–|to)\s*\d+(?:\.\d+)*[a-z]?)*"
    r"|(?:SOSP|OSDI|arXiv|NeurIPS|ICML)\s*'?\d+|\b(?:19|20)\d\d\b(?!\s*(?:tokens|slots))",
    re.IGNORECASE,
)
# A number: not glued to a word (A100, v1, sm_90, fp16) nor to a name by a hyphen (OPT-13B).
NUMBER = re.compile(r"(?<![\w.$])(?<![A-Za-z]-)(\d+(?:,\d{3})*(?:\.\d+)?)(?![\d.]*[A-WYZa-wyz\d_])")
# Not claims: code names (``paper.FIG13``), f-string fields, "n > 1", tolerances ("within 5 points").
NOT_CLAIMS = re.compile(
    r"\bpaper\.(?:py\b|[A-Za-z_]\w*)|\{[^{}]*\}|\b\d+-shot\b|\b[nk]\s*[<>=]+\s*\d+"
    r"|\bwithin\s+\d[\d.]*\s*(?:%|points?|percentage points)"
)


def clauses(text: str) -> list[str]:
    """Sentence pieces: parenthesised text apart from its sentence; split at ; | and sentence ends."""
    pieces: list[str] = []
    depth_text = re.sub(r"\(([^()]*)\)", lambda m: pieces.append(m.group(1)) or " ", text)
    pieces.append(depth_text)
    out = []
    for piece in pieces:
        out += [p for p in re.split(r"(?<=[.!?])\s+(?=[A-Z*`\"])|;|\||\n\s*\n|\n[*-] ", piece) if p.strip()]
    return out


def cited(value: str, held: set[float]) -> bool:
    number = float(value.replace(",", ""))
    digits = len(value.split(".")[1]) if "." in value else 0
    return any(round(h, digits) == number or h == number for h in held)


def uncited(text: str) -> list[tuple[str, str]]:
    """(number, clause) pairs of citing clauses whose number ``paper.py`` does not hold."""
    held = {n for n, _ in paper.cited_numbers()}
    bad = []
    for clause in clauses(NOT_CLAIMS.sub(" ", text)):
        if not CITES.search(clause):
            continue
        stripped = REFERENCES.sub(" ", clause.replace("`", ""))
        for value in NUMBER.findall(stripped):
            if not cited(value, held):
                bad.append((value, " ".join(clause.split())[:160]))
    return bad


def code_text(source: str) -> str:
    """Comments and string literals of Python source (where a code cell or module cites)."""
    parts = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type in (tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1)):
                parts.append(tok.string)
    except (tokenize.TokenError, IndentationError):  # a cell with IPython magics
        return source
    return "\n\n".join(parts)


def sources() -> list[tuple[str, str]]:
    readme = (ROOT / "README.md").read_text()
    # A fenced block's lines are separate statements.
    readme = re.sub(r"```.*?```", lambda m: m.group(0).replace("\n", "\n\n"), readme, flags=re.DOTALL)
    found = [("README.md", readme)]
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for index, cell in enumerate(json.loads(path.read_text())["cells"]):
            text = "".join(cell["source"])
            prose = text if cell["cell_type"] == "markdown" else code_text(text)
            found.append((f"{path.name} cell {index}", prose))
    for path in sorted((ROOT / "paged_attention").rglob("*.py")):
        if path.name != "paper.py":
            found.append((str(path.relative_to(ROOT)), code_text(path.read_text())))
    return found


@pytest.mark.parametrize("where, text", sources(), ids=[name for name, _ in sources()])
def test_every_paper_number_is_held_by_paper_py(where: str, text: str) -> None:
    bad = uncited(text)
    assert not bad, f"{where}: numbers attributed to the paper that paper.py does not hold: {bad}"


def test_the_scanner_catches_an_unheld_number() -> None:
    assert [v for v, _ in uncited("The paper measured a 42.7x speedup (Figure 12).")] == ["42.7"]
    assert uncited("Orca (Max) keeps 20.4% in token states (the paper's Figure 2).") == []
    assert uncited("On OPT-13B the paper quotes 800 KB per token; Llama-2-7B is 512 KiB.") == []
    assert [v for v, _ in uncited("the paper: 1.7-2.7x over Oracle, 2.7-11x over Max")] == ["11"]
    assert uncited("ours: 4.8x (paper: 2.7-8x)") == []


def test_every_source_names_a_constant() -> None:
    assert all(hasattr(paper, name) for name in paper.SOURCES)
    assert paper.KV_SLOTS == 15728
    assert round(paper.KV_SLOTS / 1000, 1) == paper.TABLE1_OPT13B["kv_slots_thousands"]
    for name, stack in paper.FIG2.items():
        assert sum(stack) == pytest.approx(100, abs=0.15), name
