"""MkDocs hooks of the documentation site (mkdocs.yml: ``hooks``).

1. Files from outside ``docs/`` included with a snippet line (``--8<-- "README.md"`` in
   docs/index.md, ``--8<-- "CHANGELOG.md"`` in docs/changelog.md) are included here, with
   their relative links rebased onto the page: the README's ``docs/data.md`` becomes
   ``data.md`` and ``docs/img/x.png`` becomes ``img/x.png``, so that README.md keeps
   working on GitHub and its links are checked by ``mkdocs build --strict`` like any other.
2. A relative link of any page to an existing file of the repository outside ``docs/``
   (``../benchmarks/round_time.py``, a README link to ``experiments/...``) is not part of
   the site: it becomes its text (a link to the repository when mkdocs.yml has a
   ``repo_url``). A link to a file that does not exist is left alone, so that the build
   reports it (``validation: links: not_found: warn`` with ``--strict`` fails).
3. The API reference's docstrings use reST roles (``:class:`Name```, ``:meth:`~a.b.c```):
   they are rendered as code, linked to the object where the site documents it (an object
   of the same page, or a fully qualified name through mkdocs-autorefs, silently unlinked
   when the reference does not document it).
"""

from __future__ import annotations

import html
import os
import re
from pathlib import Path
from typing import Any

# a snippet line naming one file: --8<-- "path"
SNIPPET = re.compile(r'^(?P<indent>[ \t]*)-{1,}8<-{2,}[ \t]+(?P<q>["\'])(?P<path>[^"\']+)(?P=q)[ \t]*$')
FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})")
# inline links and images: [text](target "title"), ![alt](target)
INLINE_LINK = re.compile(r'(?P<bang>!?)\[(?P<text>(?:[^\[\]]|\[[^\[\]]*\])*)\]\((?P<target>[^()\s]+)(?P<title>\s+"[^"]*")?\)')
# reference definitions: [id]: target
REFERENCE = re.compile(r'^(?P<head>[ ]{0,3}\[[^\]]+\]:[ \t]*)(?P<target><[^>]*>|\S+)(?P<tail>.*)$')
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
# a reST role as Python-Markdown renders it: :class:<code>Name</code>
ROLE = re.compile(r":(?:py:)?(?:class|meth|func|attr|mod|data|exc|obj|const|type):<code>(?P<target>[^<]*)</code>")
OBJECT_HEADING = re.compile(r'<h[1-6][^>]*\bid="(?P<id>[A-Za-z_][\w.]*)"')
ANY_ID = re.compile(r'\bid="([^"]+)"')


def _within(path: Path, folder: Path) -> bool:
    try:
        path.relative_to(folder)
        return True
    except ValueError:
        return False


class _Rebaser:
    """Rewrites the relative links of Markdown read from ``source_dir`` for a page in ``page_dir``."""

    def __init__(self, source_dir: Path, page_dir: Path, docs_dir: Path, root: Path, repo_url: str | None) -> None:
        self.source_dir, self.page_dir, self.docs_dir, self.root = source_dir, page_dir, docs_dir, root
        self.repo_url = repo_url.rstrip("/") if repo_url else None

    def target(self, target: str) -> tuple[str, bool]:
        """The rebased target, and whether it still points into the site (False: a file
        of the repository outside docs/)."""
        if target.startswith(("#", "/")) or SCHEME.match(target):
            return target, True
        split = re.match(r"(?P<path>[^#?]*)(?P<suffix>.*)", target)
        path, suffix = split["path"], split["suffix"]
        if not path:
            return target, True
        resolved = Path(os.path.normpath(self.source_dir / path))
        if _within(resolved, self.docs_dir) or not resolved.exists() or not _within(resolved, self.root):
            # a page, an image, or a missing file (left for mkdocs to report), as seen from the page
            rebased = Path(os.path.relpath(resolved, self.page_dir)).as_posix()
            if path.endswith("/") and not rebased.endswith("/"):
                rebased += "/"
            return rebased + suffix, True
        return resolved.relative_to(self.root).as_posix(), False

    def link(self, match: re.Match[str]) -> str:
        target, inside = self.target(match["target"])
        if inside:
            return f"{match['bang']}[{match['text']}]({target}{match['title'] or ''})"
        if self.repo_url:
            return f"{match['bang']}[{match['text']}]({self.repo_url}/blob/HEAD/{target}{match['title'] or ''})"
        return match["text"]  # a file of the repository that the site does not hold: its text

    def reference(self, match: re.Match[str]) -> str:
        raw = match["target"]
        bare = raw[1:-1] if raw.startswith("<") else raw
        target, inside = self.target(bare)
        if not inside:
            target = f"{self.repo_url}/blob/HEAD/{target}" if self.repo_url else "#"
        return f"{match['head']}{target}{match['tail']}"

    def rebase(self, markdown: str) -> str:
        """Every link outside code (fences and inline code spans) rebased."""
        out: list[str] = []
        fence: str | None = None
        for line in markdown.split("\n"):
            opened = FENCE.match(line)
            if fence is not None:
                if opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence) and not line.strip()[len(opened.group(1)):].strip():
                    fence = None
                out.append(line)
                continue
            if opened:
                fence = opened.group(1)
                out.append(line)
                continue
            reference = REFERENCE.match(line)
            if reference:
                out.append(self.reference(reference))
                continue
            # links outside inline code spans: split on backtick runs
            parts = re.split(r"(`+[^`]*`+)", line)
            out.append("".join(part if part.startswith("`") else INLINE_LINK.sub(self.link, part) for part in parts))
        return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Include the repository's files named by snippet lines, and rebase links (1, 2)."""
    docs_dir = Path(config["docs_dir"]).resolve()
    root = Path(config["config_file_path"]).resolve().parent
    page_path = Path(page.file.abs_src_path).resolve()
    page_dir = page_path.parent
    repo_url = config.get("repo_url")

    out: list[str] = []
    fence: str | None = None
    for line in markdown.split("\n"):
        opened = FENCE.match(line)
        if fence is not None:
            if opened and opened.group(1)[0] == fence[0]:
                fence = None
            out.append(line)
            continue
        if opened:
            fence = opened.group(1)
        snippet = SNIPPET.match(line) if fence is None else None
        if snippet:
            included = (root / snippet["path"]).resolve()
            if included.is_file() and not _within(included, docs_dir):
                text = included.read_text(encoding="utf-8")
                out.append(_Rebaser(included.parent, page_dir, docs_dir, root, repo_url).rebase(text))
                continue
        out.append(line)
    markdown = "\n".join(out)
    return _Rebaser(page_dir, page_dir, docs_dir, root, repo_url).rebase(markdown)


def on_page_content(html_text: str, page: Any, config: Any, files: Any) -> str:
    """reST roles of docstrings as code, linked where the site documents the object (3)."""
    if ":<code>" not in html_text:
        return html_text
    ids = set(ANY_ID.findall(html_text))
    headings = [(m.start(), m["id"]) for m in OBJECT_HEADING.finditer(html_text)]

    def current_object(position: int) -> str | None:
        found = None
        for start, ident in headings:
            if start > position:
                break
            found = ident
        return found

    def role(match: re.Match[str]) -> str:
        target = html.unescape(match["target"]).strip()
        short = target.startswith("~")
        target = target.lstrip("~.")
        title = target.rsplit(".", 1)[-1] if short else target
        code = f"<code>{html.escape(title)}</code>"
        scope = current_object(match.start())
        if scope:
            parts = scope.split(".")
            for n in range(len(parts), 0, -1):
                candidate = ".".join(parts[:n] + [target])
                if candidate in ids:
                    return f'<a class="autorefs autorefs-internal" href="#{candidate}">{code}</a>'
        ending = [ident for ident in ids if ident.endswith("." + target)]
        if len(ending) == 1:  # a name of this page, from a docstring whose object has no heading
            return f'<a class="autorefs autorefs-internal" href="#{ending[0]}">{code}</a>'
        if "." in target:
            return f'<autoref identifier="{html.escape(target)}" optional>{code}</autoref>'
        return code

    return ROLE.sub(role, html_text)
