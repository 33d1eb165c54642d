"""The reading site (`make html`: a Jupyter Book of the executed lessons) in headless Chromium:
the index lists every lesson, a lesson page has the navigation, its own table of contents, its
plots and its explorer's last picture loaded, and the link to the hub; the search finds a lesson
by a word of its prose. Screenshots in build/screens/site-*.png.

Skipped without Jupyter Book (the `docs` extra, which `make html` installs)."""
import contextlib
import importlib.util
import io

import pytest

from lab_server import ROOT

HUB = "https://hub.example.org"
SITE = ROOT / "build" / "site"


@pytest.fixture(scope="module")
def site():
    if importlib.util.find_spec("jupyter_book") is None:
        pytest.skip("Jupyter Book missing: pip install -e '.[docs]' (make html does)")
    from labkit import editions
    with contextlib.redirect_stdout(io.StringIO()):
        return editions.build_site(SITE, hub=HUB).parent


@pytest.fixture
def reader(browser, screens):
    screens.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(30_000)
    yield page
    context.close()


def test_the_index_lists_every_lesson(site, reader, screens):
    reader.goto((site / "index.html").as_uri())
    reader.wait_for_selector("nav.bd-docs-nav")
    links = reader.locator("nav.bd-docs-nav a.reference").all_inner_texts()
    lessons = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert [text[:2] for text in links if text[:2].isdigit()] == [n[:2] for n in lessons]
    reader.screenshot(path=str(screens / "site-index.png"))


def test_a_lesson_page_has_its_contents_pictures_and_hub_link(site, reader, screens):
    reader.goto((site / "07_when_it_breaks.html").as_uri())
    sections = reader.locator("li.toc-h2 a:visible")     # "Contents": its own sections, beside
    assert sections.count() >= 5                          # the page (a hidden copy for phones)
    hub = reader.locator(f'a[href^="{HUB}/hub/user-redirect/lab/tree/student/07_"]')
    assert hub.count() == 1
    assert reader.get_by_text("The explorer as last drawn").count() == 1
    broken = reader.evaluate("[...document.images].filter(i => !i.complete || "
                             "i.naturalWidth === 0).map(i => i.src.slice(0, 60))")
    assert not broken and reader.evaluate("document.images.length") >= 2   # a plot, the explorer
    reader.screenshot(path=str(screens / "site-07.png"), full_page=False)


def test_the_search_finds_a_lesson(site, reader):
    reader.goto((site / "search.html").as_uri() + "?q=zigzag")
    reader.wait_for_selector("#search-results li a", timeout=30_000)
    found = reader.locator("#search-results li a").all_inner_texts()
    assert any(text.startswith("08") for text in found), found
