"""Screenshot of the attention explorer of a running `transformer serve` (the README's picture).

    transformer serve --checkpoint runs/multi30k_de_en/checkpoints/best.pt &
    python scripts/screenshot_explorer.py --url http://127.0.0.1:8000 \
        --sentence "Eine Frau spielt Gitarre auf der Straße." --out docs/serve_explorer.png

Drives Debian's Chromium (`--chromium`, default: the one on PATH) with Playwright: types the sentence, presses
Translate, picks the layer and head, hovers one target piece, and saves the page.
"""

from __future__ import annotations

import argparse
import shutil

from playwright.sync_api import sync_playwright


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--sentence", default="Eine Frau spielt Gitarre auf der Straße.")
    parser.add_argument("--out", default="docs/serve_explorer.png")
    parser.add_argument("--n-best", type=int, default=2)
    parser.add_argument("--layer", default="", help="default: the last")
    parser.add_argument("--head", default="mean", help="a head index or 'mean'")
    parser.add_argument("--hover", type=int, default=3, help="query row to hover (target piece index)")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = parser.parse_args()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1100, "height": 900}, device_scale_factor=1)
        page.goto(args.url + "/")
        page.wait_for_function("document.getElementById('model-info').textContent.includes('→')")
        page.fill("#source", args.sentence)
        page.fill("#n-best", str(args.n_best))
        page.click("#translate")
        page.wait_for_selector("#heatmap td.cell")
        if args.layer:
            page.select_option("#layer", args.layer)
        page.select_option("#head", args.head)
        page.hover(f'#heatmap th.row[data-index="{args.hover}"]')
        page.screenshot(path=args.out, full_page=True)
        browser.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
