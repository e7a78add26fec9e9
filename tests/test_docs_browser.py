"""The built documentation site as a reader sees it: served on 127.0.0.1 and opened in headless Chromium
(Debian's ``chromium`` package), driven by Playwright with that browser (Playwright downloads nothing)."""

from __future__ import annotations

import functools
import http.server
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# The machine's network is closed: a browser that phones home (updates, sync, QUIC probes) only waits.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def served_site(built_site: Path) -> Iterator[str]:
    handler = functools.partial(_QuietHandler, directory=str(built_site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def page(served_site: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if CHROMIUM is None:
        pytest.skip("no Chromium: install Debian's (as root: apt-get install -y chromium)")
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="Playwright is not installed: pip install -r requirements-docs.txt"
    )
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),  # a fresh --user-data-dir
            executable_path=CHROMIUM,
            headless=True,
            args=FLAGS,
            viewport={"width": 1280, "height": 900},
        )
        context.set_default_timeout(20_000)
        try:
            yield context.new_page()
        finally:
            context.close()


def test_the_home_page_renders_the_readme(page: Any, served_site: str) -> None:
    page.goto(served_site + "/")
    assert page.title().startswith("stratagem")
    assert page.locator("article h1").first.inner_text().strip(" ¶\n") == "stratagem"
    assert page.locator("article h2#quick-start").is_visible()
    # The navigation has the guide, the plugins and the generated reference.
    nav = page.locator("nav.md-nav--primary").inner_text()
    assert "Architecture" in nav and "stratagem-fsdp" in nav and "Hook specs" in nav


def test_searching_fsdp_finds_the_fsdp_strategy_page(page: Any, served_site: str) -> None:
    page.goto(served_site + "/")
    page.locator("label.md-search__icon, .md-search__input").first.click()
    page.locator("input.md-search__input").fill("fsdp")
    results = page.locator("li.md-search-result__item a.md-search-result__link")
    results.first.wait_for(state="visible")
    links = [results.nth(i).get_attribute("href") or "" for i in range(min(results.count(), 5))]
    fsdp = [href for href in links if "plugins/fsdp/" in href]
    assert fsdp, f"no link to the FSDP strategy page among the first results: {links}"
    page.locator(f'a.md-search-result__link[href="{fsdp[0]}"]').first.click()
    page.wait_for_url("**/plugins/fsdp/**")
    assert page.locator("article h1").first.inner_text().strip(" ¶\n") == "stratagem-fsdp"


def test_the_hook_page_shows_wrap_models_arguments(page: Any, served_site: str) -> None:
    page.goto(served_site + "/reference/hooks/#stratagem.hookspecs.wrap_model")
    heading = page.locator('[id="stratagem.hookspecs.wrap_model"]')
    assert heading.is_visible()
    entry = heading.locator("xpath=..")  # the entry: heading, signature, docstring, parameters
    signature = entry.locator(".doc-signature").inner_text()
    shown = " ".join(signature.replace("(", "( ").replace(")", " )").split())
    assert "wrap_model( model: torch.nn.Module, compiler: Compiler ) -> torch.nn.Module" in shown, signature
    parameters = entry.locator("table").first
    assert parameters.is_visible()
    assert "model" in parameters.locator("tbody tr").first.inner_text()
    assert "firstresult" in entry.locator(".doc-labels").inner_text()
