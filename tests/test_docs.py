"""The documentation: a short README, a MkDocs site that builds strictly, and reference pages generated from the code.

- README.md stays at most 150 lines and every page it links to exists.
- docs/hooks.py generates the configuration, command and metrics references: every config key is listed with a
  description (its comment in config.py), a key added to a config tree appears on the page with no hand edit,
  every command of the CLI tree and every metric of the METRICS table is listed.
- `mkdocs build --strict` passes: a broken link, a missing anchor or a page left out of the navigation fails it.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _hooks():
    spec = importlib.util.spec_from_file_location("kvfabric_docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up while being made)
    spec.loader.exec_module(module)
    return module


def test_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert links and all((ROOT / link).exists() for link in links), [link for link in links if not (ROOT / link).exists()]


def test_every_config_key_is_on_the_reference_page_with_a_description():
    import kvfabric.config as config

    hooks = _hooks()
    keys = hooks.config_keys(config.Config, inspect.getsource(config))
    assert len(keys) > 90
    assert [key.key for key in keys if not key.description] == []  # a key without a comment in config.py fails here
    page = hooks.config_page()
    for key in keys:
        assert f"| `{key.key}` |" in page and f"`{key.env}`" in page
    row = next(line for line in page.splitlines() if line.startswith("| `disk.capacity` |"))
    assert "50 GiB" in row and "KVFABRIC_DISK__CAPACITY" in row and "byte size" in row
    row = next(line for line in page.splitlines() if line.startswith("| `mode` |"))
    assert "inproc, server" in row


def test_a_new_config_key_appears_on_the_page_without_a_hand_edit(tmp_path):
    """A config tree defined here (as config.py defines its own): the page lists what the code declares."""
    source = textwrap.dedent('''
        from __future__ import annotations
        from dataclasses import dataclass, field
        from typing import Literal

        @dataclass(frozen=True)
        class Section:
            depth: int = 3  # how deep it goes
            #   (and a second line of its description)

        @dataclass(frozen=True)
        class Root:
            name: str = "x"  # what it is called
            brand_new_key: Literal["a", "b"] = "a"  # a key added today
            section: Section = field(default_factory=Section)
    ''')
    path = tmp_path / "fixture_config.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("fixture_config", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["fixture_config"] = module
    try:
        spec.loader.exec_module(module)
        page = _hooks().config_page(module.Root, source)
    finally:
        del sys.modules["fixture_config"]
    assert "| `brand_new_key` | `Literal['a', 'b']` | `a` | a, b | `KVFABRIC_BRAND_NEW_KEY` | a key added today |" in page
    assert "| `section.depth` |" in page and "how deep it goes (and a second line of its description)" in page
    assert "`KVFABRIC_SECTION__DEPTH`" in page


def test_every_command_and_metric_is_on_its_reference_page():
    import click

    from kvfabric.apps.cli import main
    from kvfabric.observe.metrics import METRICS

    hooks = _hooks()
    cli = hooks.cli_page()

    def paths(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
        out = []
        for name, command in group.commands.items():
            out.append((*prefix, name))
            if isinstance(command, click.Group):
                out += paths(command, (*prefix, name))
        return out

    for path in paths(main):
        assert f"## `kvfabric {' '.join(path)}`" in cli
    assert "Traceback" not in cli
    assert cli.count("```text") == len(paths(main)) and cli.count("sage: kvfabric") >= len(paths(main))
    metrics = hooks.metrics_page()
    assert all(f"| `{name}` |" in metrics for name in METRICS)


def test_the_site_builds_strictly(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    if mkdocs is None:
        pytest.skip("mkdocs is not installed here (kvfabric[docs], part of make test)")
    done = subprocess.run([mkdocs, "build", "--strict", "-q", "-d", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    site = tmp_path / "site"
    for page in ("index.html", "reference/config/index.html", "reference/cli/index.html", "vllm/index.html"):
        assert (site / page).exists(), page
    config_html = (site / "reference" / "config" / "index.html").read_text()
    assert "disk.capacity" in config_html and "<table>" in config_html
    assert not (site / "hooks.py").exists()
    assert dataclasses.is_dataclass(_hooks().ConfigKey)


@pytest.mark.slow
def test_the_built_site_renders_in_a_headless_browser(tmp_path):
    """The home page and the configuration reference, opened in headless Chromium from a local HTTP server: each
    has its title, the navigation and a table; a screenshot of each is taken (the ones kept in docs/screenshots/
    came from this test: KVFABRIC_TEST_ARTIFACTS)."""
    import functools
    import http.server
    import threading
    from html.parser import HTMLParser

    from tests.artifacts import keep_artifact
    from tests.test_status_page import CHROMIUM, CHROMIUM_FLAGS

    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    if mkdocs is None or CHROMIUM is None:
        pytest.skip("needs mkdocs (kvfabric[docs]) and chromium (scripts/setup.sh --test)")
    site = tmp_path / "site"
    subprocess.run([mkdocs, "build", "-q", "-d", str(site)], cwd=ROOT, check=True, timeout=600)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    class Page(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.title, self.in_title, self.nav_links, self.tables = "", False, 0, 0

        def handle_starttag(self, tag, attrs):
            classes = dict(attrs).get("class") or ""
            self.in_title = tag == "title"
            self.nav_links += tag == "a" and "md-nav__link" in classes
            self.tables += tag == "table"

        def handle_data(self, data):
            if self.in_title:
                self.title += data

    try:
        for path, title, name in (("", "kvfabric", "docs-home.png"),
                                  ("reference/config/", "Configuration keys", "docs-config-reference.png")):
            url = f"http://127.0.0.1:{server.server_address[1]}/{path}"
            profile = tmp_path / f"profile-{name}"
            dom = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
                                 capture_output=True, text=True, timeout=120)
            assert dom.returncode == 0, dom.stderr[-2000:]
            page = Page()
            page.feed(dom.stdout)
            assert title in page.title and page.nav_links >= 10 and page.tables >= 1, (page.title, page.nav_links)
            shot = tmp_path / name
            subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--window-size=1280,900",
                            f"--screenshot={shot}", url], capture_output=True, timeout=120, check=True)
            assert shot.stat().st_size > 20_000  # a rendered page, not a blank one
            print(f"{path or 'home'}: {keep_artifact(shot)}")
    finally:
        server.shutdown()
