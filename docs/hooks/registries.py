"""MkDocs hook: tables generated from the code's own registries, and links of included files mapped into the site.

Markers (an HTML comment alone on a line) are replaced, at build time, by a markdown table:

- ``<!-- registry: advantage-estimators -->``: one row per ``fastexp.rl.advantages.ESTIMATORS`` entry (name,
  aliases from ``ALIASES``, formula, least ``n_samples_per_prompt`` and why, critic, source, the two stage
  functions with the first line of their docstrings, linked to the API reference).
- ``<!-- registry: kl-estimators -->``: one row per ``fastexp.rl.kl.KL_ESTIMATORS`` entry, its formula and
  properties read from the function's docstring or else from the module docstring's ``- ``kN``: ...`` line.
- ``<!-- registry: status-codes -->``: one row per domain error in ``fastexp.status.STATUS_CODES``, its
  gRPC code and the first paragraph of its docstring.

A registry entry the page cannot describe fails the build (``PluginError``), so the tables cannot drift from the
code. Files included with ``pymdownx.snippets`` keep links relative to their own folder (``benchmarks/README.md``
links ``../docs/...``); :class:`IncludedLinks` rewrites those that land in ``docs/`` relative to the page.
"""

from __future__ import annotations

import inspect
import posixpath
import re

from markdown import Extension
from markdown.preprocessors import Preprocessor
from mkdocs.exceptions import PluginError

MARKER = re.compile(r"^<!-- registry: ([a-z-]+) -->$", re.MULTILINE)
KL_DOC_LINE = re.compile(r"^- ``(\w+)``: ``(.+?)``\s+\((.+)\)\s*$", re.MULTILINE)
#: Pages moved since an included file was written: old path under docs/ -> new one.
MOVED = {"trl.md": "trainer/trl.md"}
#: Folder (repo-relative) of each file pages include, to resolve its relative links.
INCLUDED_FROM = {"benchmarks/README.md": "benchmarks"}
LINK = re.compile(r"\]\((?!https?://|#|/)([^)\s]+)\)")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


ROLE = re.compile(r":(?:func|class|mod|data|attr|meth):`~?([^`]+)`")


def _first_line(function) -> str:
    """The first paragraph of a docstring as one table cell (Sphinx roles shown as code)."""
    doc = inspect.getdoc(function) or ""
    return _cell(ROLE.sub(r"``\1``", doc.split("\n\n")[0])) if doc else ""


def _function_ref(function) -> str:
    path = f"{function.__module__}.{function.__qualname__}"
    return f"[`{function.__name__}`][{path}]"


def advantage_table() -> str:
    from fastexp.rl.advantages import ALIASES, ESTIMATORS

    rows = [
        "| estimator | formula | n ≥ | critic | source | stages |",
        "|---|---|---|---|---|---|",
    ]
    for name, estimator in ESTIMATORS.items():
        if not estimator.formula or not estimator.source:
            raise PluginError(f"ESTIMATORS[{name!r}] has no formula or source for the docs' table")
        aliases = sorted(alias for alias, target in ALIASES.items() if target == name)
        label = f"`{name}`" + "".join(f" (`{alias}`)" for alias in aliases)
        minimum = str(estimator.min_samples_per_prompt)
        if estimator.why_min:
            minimum += f": {_cell(estimator.why_min)}"
        stages = (f"shaping {_function_ref(estimator.shape_rewards)}: {_first_line(estimator.shape_rewards)}<br>"
                  f"advantages {_function_ref(estimator.advantages)}: {_first_line(estimator.advantages)}")
        rows.append(f"| {label} | `{_cell(estimator.formula)}` | {minimum} | "
                    f"{'yes' if estimator.needs_critic else 'no'} | {_cell(estimator.source)} | {stages} |")
    return "\n".join(rows)


def kl_table() -> str:
    from fastexp.rl import kl

    from_module = {name: (formula, notes) for name, formula, notes in KL_DOC_LINE.findall(kl.__doc__ or "")}
    rows = ["| `kl_estimator` | per-token value (`log_ratio` = log π − log π_ref) | properties |", "|---|---|---|"]
    for name, function in kl.KL_ESTIMATORS.items():
        if inspect.getdoc(function):
            rows.append(f"| `{name}` | {_first_line(function)} | |")
        elif name in from_module:
            formula, notes = from_module[name]
            rows.append(f"| `{name}` | `{formula}` | {_cell(notes)} |")
        else:
            raise PluginError(f"KL_ESTIMATORS[{name!r}] has no docstring and no line in fastexp.rl.kl's docstring")
    return "\n".join(rows)


def status_table() -> str:
    from fastexp.status import STATUS_CODES

    rows = ["| domain error | gRPC status | when |", "|---|---|---|"]
    for kind, code in STATUS_CODES.items():
        name = getattr(code, "name", str(code))
        if not inspect.getdoc(kind):
            raise PluginError(f"{kind.__name__} has no docstring for the docs' status table")
        rows.append(f"| `{kind.__name__}` (`{kind.__module__}`) | `{name}` | {_first_line(kind)} |")
    rows.append("| anything else | `INTERNAL` | a generic message with an error id, logged with the traceback |")
    return "\n".join(rows)


TABLES = {"advantage-estimators": advantage_table, "kl-estimators": kl_table, "status-codes": status_table}


def _table(match: re.Match) -> str:
    name = match.group(1)
    if name not in TABLES:
        raise PluginError(f"unknown registry marker {name!r} (known: {sorted(TABLES)})")
    return TABLES[name]()


class IncludedLinks(Preprocessor):
    """Rewrites links of included files that point into ``docs/`` so they resolve from the including page."""

    def __init__(self, md, hook: IncludedLinksExtension) -> None:
        super().__init__(md)
        self.hook = hook

    def run(self, lines: list[str]) -> list[str]:
        page = self.hook.page
        if page is None:
            return lines
        page_dir = posixpath.dirname(page)

        def rewrite(match: re.Match) -> str:
            target, _, anchor = match.group(1).partition("#")
            for folder in INCLUDED_FROM.values():
                in_repo = posixpath.normpath(posixpath.join(folder, target))
                if in_repo.startswith("docs/"):
                    in_docs = MOVED.get(in_repo.removeprefix("docs/"), in_repo.removeprefix("docs/"))
                    relative = posixpath.relpath(in_docs, page_dir or ".")
                    return f"]({relative}{'#' + anchor if anchor else ''})"
            return match.group(0)

        return [LINK.sub(rewrite, line) if "](../docs/" in line else line for line in lines]


class IncludedLinksExtension(Extension):
    page: str | None = None

    def extendMarkdown(self, md) -> None:  # noqa: N802 (Python-Markdown's name)
        # pymdownx.snippets runs at priority 32; this runs after it, on the included text.
        md.preprocessors.register(IncludedLinks(md, self), "fastexp_included_links", 31)


EXTENSION = IncludedLinksExtension()


def on_config(config):
    config.markdown_extensions.append(EXTENSION)
    return config


def on_page_markdown(markdown: str, page, **_) -> str:
    EXTENSION.page = page.file.src_uri
    return MARKER.sub(_table, markdown)
