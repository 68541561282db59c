"""The package map stays a one-way street: no package of specforge imports one that imports it back
(lazy imports inside functions count too), the HTTP app is used by the command line alone, and no
comment cites a document outside the repository."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "specforge"


def unit_of(module: str) -> str | None:
    """`specforge.eval.report` -> "eval", `specforge.pipeline` -> "pipeline"; None outside specforge."""
    parts = module.split(".")
    if parts[0] != "specforge" or len(parts) < 2:
        return None
    return parts[1]


def imports_of(path: Path) -> set[str]:
    """The specforge modules a file imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            if node.module == "specforge":  # from specforge import distributed
                found |= {f"specforge.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("specforge.")}


def unit_graph() -> dict[str, dict[str, list[str]]]:
    """unit -> {imported unit: [files that import it]}."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in PKG.rglob("*.py"):
        me = unit_of("specforge." + ".".join(path.relative_to(PKG).with_suffix("").parts))
        for module in imports_of(path):
            other = unit_of(module)
            if other and other != me:
                graph.setdefault(me, {}).setdefault(other, []).append(str(path.relative_to(ROOT)))
    return graph


def test_no_package_imports_one_that_imports_it_back():
    graph = unit_graph()

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            unit = todo.pop()
            if unit == goal:
                return True
            if unit not in seen:
                seen.add(unit)
                todo += list(graph.get(unit, {}))
        return False

    cycles = [(a, b, files) for a, deps in graph.items() for b, files in deps.items() if reaches(b, a)]
    assert not cycles, "import cycles between packages (unit -> unit, files):\n" + "\n".join(map(str, cycles))
    assert "launch" in graph.get("extract", {}) and "launch" in graph.get("eval", {})  # the graph is read


def test_the_http_app_is_used_by_the_command_line_alone():
    users = sorted(unit for unit, deps in unit_graph().items() if "serving" in deps)
    assert users == ["cli"], users


def test_no_comment_cites_a_file_outside_the_repository():
    offenders = []
    for path in [*PKG.rglob("*.py"), *(ROOT / "docs").glob("*.md"), *(ROOT / "conf").rglob("*.yaml"),
                 *(ROOT / "tests").glob("*.py"), ROOT / "README.md"]:
        if path == Path(__file__).resolve():
            continue
        text = path.read_text()
        for needle in ("shared/reference", "eagle3-contract.md", "../shared"):
            if needle in text:
                offenders.append(f"{path.relative_to(ROOT)}: {needle}")
    assert not offenders, offenders


def test_contract_citations_name_sections_of_our_contract_page():
    import re

    sections = set(re.findall(r"(?m)^## (\d+)\. ", (ROOT / "docs" / "contract.md").read_text()))
    assert sections == {str(i) for i in range(1, 9)}, sections
    cited, bare = set(), []
    for path in [*PKG.rglob("*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "conf").rglob("*.yaml")]:
        text = path.read_text()
        cited |= set(re.findall(r"docs/contract\.md §(\d+)", text))
        bare += [f"{path.relative_to(ROOT)}" for _ in re.findall(r"(?<!docs/)contract §\d", text)]
    assert cited and cited <= sections, cited - sections
    assert not bare, f"cite the page as docs/contract.md §N: {bare}"


def test_distributed_replaces_dist():
    assert (PKG / "distributed" / "__init__.py").is_file()
    assert not (PKG / "dist").exists()
