"""The pooler playground in a real headless browser: Debian's chromium (installed by
``make test``) driven by Playwright. The page is loaded from the running server, a comparison is
run, and the scores it renders must equal the API's. A screenshot goes to the test's folder
(and to ``$EMBEDPOOL_PLAYGROUND_SCREENSHOT`` when set, which is how ``docs/playground.png`` is made)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
QUERY = "How do plants make their food?"
TEXTS = [
    "Photosynthesis turns light, water and carbon dioxide into sugar in the leaves.",
    "Plants take up water and minerals through their roots.",
    "The stock market closed higher on Friday after a volatile week.",
    "Chlorophyll absorbs red and blue light and reflects green.",
    "A recipe for sourdough bread needs flour, water, salt and time.",
]
POOLERS = ["mean", "cls", "tokens", "cluster"]
EXTRA = "landmark:g=16"


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` (or `make browser`) installs Debian's chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    ctx = browser.new_context(viewport={"width": 1500, "height": 1000})
    pg = ctx.new_page()
    pg.requested = []
    pg.on("request", lambda r: pg.requested.append(r.url))
    yield pg
    ctx.close()
    outside = [u for u in pg.requested if not u.startswith(server.url) and not u.startswith("data:")]
    assert not outside, f"the page reached beyond its server: {outside}"


def wait(page, states=("done",), timeout=180_000):
    page.wait_for_selector(", ".join(f"body[data-state={s}]" for s in (*states, "error")), timeout=timeout)
    state = page.get_attribute("body", "data-state")
    assert state in states, f"page state {state}: {page.inner_text('#error')}"


def reference_similarity(a, b, multi: bool) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if not multi:
        return float(a @ b / np.sqrt((a @ a) * (b @ b)))
    return float((a @ b.T).max(axis=1).mean())


def rendered_ranking(card):
    return [(int(li.get_attribute("data-index")), float(li.get_attribute("data-score")),
             li.query_selector(".score").inner_text()) for li in card.query_selector_all("ol.ranking li")]


def test_playground_scores_equal_the_api(page, server, client, tmp_path):
    page.goto(f"{server.url}/")  # redirects to /playground/
    assert page.url == f"{server.url}/playground/"
    wait(page, ("ready",), 60_000)
    assert "all-MiniLM-L6-v2" in page.inner_text("#status")
    page.fill("#query", QUERY)
    page.fill("#texts", "\n".join(TEXTS))
    for box in page.query_selector_all("#pooler-choices input"):
        box.set_checked(box.get_attribute("value") in POOLERS)
    page.fill("#extra-poolers", EXTRA)
    page.click("#run")
    wait(page)
    page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)
    assert (tmp_path / "playground.png").stat().st_size > 20_000
    if os.environ.get("EMBEDPOOL_PLAYGROUND_SCREENSHOT"):
        shutil.copy(tmp_path / "playground.png", os.environ["EMBEDPOOL_PLAYGROUND_SCREENSHOT"])

    embedded = client.post("/embed", json={"inputs": TEXTS, "poolers": POOLERS + [EXTRA], "truncate": True}).json()
    cards = {c.get_attribute("data-pooler"): c for c in page.query_selector_all("#results .card")}
    assert set(cards) == {r["pooler"] for r in embedded["results"]} == set(POOLERS) | {EXTRA}
    for result in embedded["results"]:
        spec, multi, card = result["pooler"], result["multi_vector"], cards[result["pooler"]]
        ranks = client.post("/rerank", json={"query": QUERY, "texts": TEXTS, "pooler": spec, "truncate": True}).json()
        shown = rendered_ranking(card)
        assert [i for i, _, _ in shown] == [r["index"] for r in ranks], spec
        for (_, score, text), r in zip(shown, ranks):
            assert score == pytest.approx(r["score"], abs=1e-6) and text == f"{r['score']:.4f}", spec
        emb = result["embeddings"]
        for cell in card.query_selector_all("table.heatmap td"):
            i, j = int(cell.get_attribute("data-row")), int(cell.get_attribute("data-col"))
            want = reference_similarity(emb[i], emb[j], multi)
            assert float(cell.get_attribute("data-score")) == pytest.approx(want, abs=1e-6), (spec, i, j)
        counts = [int(td.inner_text()) for td in card.query_selector_all("table.sizes td.vectors")]
        assert counts == [len(e) if multi else 1 for e in emb], spec
        dim = len(emb[0][0]) if multi else len(emb[0])
        total = card.query_selector_all("table.sizes td.bytes")[-1].inner_text()
        assert int(total.replace(",", "")) == sum(counts) * 4 * dim, spec


def test_playground_collection_mode(page, server, client):
    assert client.post("/collections", json={"name": "pg-plants"}).status_code in (200, 201)
    docs = [{"id": f"t{i}", "text": t} for i, t in enumerate(TEXTS)]
    assert client.post("/collections/pg-plants/documents", json=docs).status_code == 200
    page.goto(f"{server.url}/playground/")
    wait(page, ("ready",), 60_000)
    page.click("#tab-collection")
    page.wait_for_selector("#collection-choices input[value=pg-plants]")
    page.check("#collection-choices input[value=pg-plants]")
    page.fill("#query", QUERY)
    page.fill("#k", "3")
    page.click("#run")
    wait(page)
    hits = client.post("/collections/pg-plants/search", json={"query": QUERY, "k": 3}).json()["hits"]
    items = page.query_selector_all(".card[data-collection=pg-plants] ol.ranking li")
    assert [li.get_attribute("data-id") for li in items] == [h["id"] for h in hits]
    assert [float(li.get_attribute("data-score")) for li in items] == pytest.approx([h["score"] for h in hits], abs=1e-6)


def test_playground_with_an_api_key(browser, limited_server):
    ctx = browser.new_context()
    page = ctx.new_page()
    try:
        page.goto(f"{limited_server.url}/playground/")  # the static page itself needs no key
        page.wait_for_selector("body[data-state=error]")
        assert "401" in page.inner_text("#error") and page.inner_text("#status") == "not connected"
        page.fill("#api-key", limited_server.api_key)
        page.press("#api-key", "Enter")  # commits the value: a change event
        page.wait_for_selector("body[data-state=ready]", timeout=60_000)
        page.fill("#texts", "\n".join(TEXTS[:3]))
        for box in page.query_selector_all("#pooler-choices input"):
            box.set_checked(box.get_attribute("value") == "mean")
        page.click("#run")
        wait(page)
        assert len(page.query_selector_all(".card[data-pooler=mean] ol.ranking li")) == 3
    finally:
        ctx.close()
