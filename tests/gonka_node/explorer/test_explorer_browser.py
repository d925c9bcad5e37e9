"""The explorer in a real headless Chromium (Debian's chromium + chromium-driver, driven by Selenium)
against a 2-round devnet of real processes (embedded chain served on loopback, a Governor-voted epoch,
the aggregator and two hosts as `gonka-node` processes).

One devnet for every page assertion: the epoch page, opened before any round, fills in live with two
finalized rounds whose checkpoint hashes equal the chain's and a loss chart of rounds + 1 points; a
round's download link streams the checkpoint the chain records; the round page lists each host's
reward equal to the amount the Registry accepts a claim for, and shows a claim as it happens; strings from the chain and from an aggregator containing `<script>` render as
text; the epoch page fits a phone's width. The screenshot of the epoch page it takes is the one in
docs/ (`--explorer-screenshot docs/explorer-epoch.png`).
"""

from __future__ import annotations

import os
import shutil
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from eth_utils import to_canonical_address
from safetensors.torch import load as load_safetensors

from chain.client import ChainClient
from gonka_node.devnet import DevnetOptions, deploy_and_schedule
from gonka_node.devnet_chain import GOVERNANCE, close_signin, start_chain
from gonka_node.devnet_procs import Children, aggregator_client, start_aggregator, start_host
from gonka_node.explorer import start_explorer
from gonka_node.explorer.db import IndexDb
from gonka_node.explorer.reports import Finalized, to_report
from proto.gonka.v1 import aggregator_pb2 as pb
from training.checkpoint import canonical_sha256

HOSTILE = "<script>window.pwned=1</script>"
WAIT_S = 300


def _browser_binaries() -> tuple[str, str]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        if os.environ.get("CI"):
            pytest.fail("chromium/chromium-driver are not installed but CI is set (scripts/test.sh installs them)")
        pytest.skip("Debian's chromium and chromium-driver are not installed (scripts/test.sh installs them as root)")
    return chromium, driver


@pytest.fixture
def browser() -> Iterator[Any]:
    chromium, driver_path = _browser_binaries()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1280,2400", "--hide-scrollbars"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def wait_until(driver: Any, what: str, ready: Callable[[Any], Any], children: Children, logs: Path,
               timeout_s: float = WAIT_S) -> Any:
    """Poll the live page (never reloading it) until `ready` returns something truthy."""
    from selenium.common.exceptions import StaleElementReferenceException

    deadline = time.monotonic() + timeout_s
    while True:
        children.check(logs)
        try:
            value = ready(driver)
        except StaleElementReferenceException:  # live.js swapped <main> while we read it
            value = None
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def texts(driver: Any, selector: str) -> list[str]:
    """The text of every element `selector` matches, read at once (call it inside `wait_until`)."""
    return [element.text for element in css(driver, selector)]


def css(driver: Any, selector: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return list(driver.find_elements(By.CSS_SELECTOR, selector))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_explorer_in_chromium_against_a_two_round_devnet(
    browser: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    opts = DevnetOptions(out=tmp_path / "devnet", hosts=2, rounds=2, inner_steps=8, preset="tiny", timeout_s=300)
    out, logs = opts.out, opts.out / "logs"
    logs.mkdir(parents=True)
    chain = start_chain()
    children = Children()
    explorer = None
    try:
        sched = deploy_and_schedule(opts, chain, say=lambda line: None)
        epoch = sched.epoch
        explorer = start_explorer(chain.url, out / "deployment.json", 0, out / "explorer.sqlite3", poll_s=0.2)
        page = f"{explorer.url}epochs/{epoch}"
        state = wait_until(browser, "the epoch to be indexed", lambda d: d.get(page) or css(d, "h1 .state"),
                           children, logs, 60)
        assert state[0].text == "sign-in"

        target = start_aggregator(out, children)
        for i in (1, 2):
            start_host(out, i, target, children)
        close_signin(chain, sched, 2, children, out)
        reader = ChainClient(chain.backend, chain.backend.dev_accounts()[GOVERNANCE], sched.deployment).connect()

        # The page opened at sign-in updates itself: two finalized rounds and the loss of rounds 0..2.
        wait_until(browser, "two finalized rounds and three loss points", lambda d: len(
            css(d, "#rounds tr[data-state=finalized]")) == 2 and len(css(d, "#loss-chart circle.loss-point")) == 3,
            children, logs)
        def epoch_page(d: Any) -> dict[str, Any]:  # read at once: live.js may swap <main> meanwhile
            points = css(d, "#loss-chart circle.loss-point")
            return {"shas": [css(d, f"#rounds code.sha[data-round='{r}']")[0].text for r in (1, 2)],
                    "losses": [float(c.get_attribute("data-loss")) for c in points],
                    "rounds": [int(c.get_attribute("data-round")) for c in points],
                    "bars": len(css(d, "#bytes-chart rect")), "cmd": css(d, "#rounds pre.cmd")[0].text,
                    "download": css(d, "#rounds a.download")[1].get_attribute("href")}

        seen = wait_until(browser, "the epoch page read whole", epoch_page, children, logs)
        assert seen["shas"] == ["0x" + reader.round_result(epoch, r).checkpoint_sha256.hex() for r in (1, 2)]
        assert seen["rounds"] == [0, 1, 2] and seen["losses"][-1] < seen["losses"][0]
        assert seen["bars"] == 3  # two hosts and the all-reduce baseline
        assert "gonka-node checkpoint pull" in seen["cmd"]
        with urllib.request.urlopen(seen["download"], timeout=60) as r:
            pulled = load_safetensors(r.read())
        assert canonical_sha256(pulled) == reader.round_result(epoch, 2).checkpoint_sha256.hex()
        screenshot = tmp_path / "explorer-epoch.png"
        browser.save_screenshot(str(screenshot))

        # The round page: each host's reward is the amount the Registry accepts a claim of.
        browser.get(f"{explorer.url}epochs/{epoch}/rounds/1")
        rows = wait_until(browser, "both contributions", lambda d: len(css(d, "#contributions tbody tr")) == 2
                          and css(d, "#contributions tbody tr"), children, logs)
        hosts = [row.get_attribute("data-host") for row in rows]
        assert sorted(hosts) == sorted(reader.hosts(epoch))
        with aggregator_client(out, target) as agg:
            proofs = {h: agg.reward_proof(epoch, 1, to_canonical_address(h)) for h in hosts}

        def contributions(d: Any) -> list[tuple[str, int, str, str, str]]:
            return [(row.get_attribute("data-host"), int(css(row, "td.reward")[0].get_attribute("data-ngonka")),
                     css(row, "td.claimed")[0].text, css(row, ".verdict")[0].text, css(row, "ul.reasons")[0].text)
                    for row in css(d, "#contributions tbody tr")]

        for host, shown, claimed, verdict, reasons in wait_until(browser, "the round page read whole", contributions,
                                                                  children, logs):
            proof = proofs[host]
            assert shown == proof.amount > 0
            assert reader.read(reader.registry, "verify_reward", epoch, 1, host, shown, list(proof.proof))
            assert (claimed, verdict) == ("not claimed", "accepted") and "replay: cosine" in reasons
        assert sum(proofs[h].amount for h in hosts) == reader.round_result(epoch, 1).total_reward
        claimer = hosts[0]
        index = next(i for i, a in enumerate(chain.backend.dev_accounts()) if a.address == claimer)
        ChainClient(chain.backend, chain.backend.dev_accounts()[index], sched.deployment).connect().claim(
            epoch, 1, proofs[claimer].amount, list(proofs[claimer].proof))
        wait_until(browser, "the claim to show", lambda d: css(
            d, f"#contributions tr[data-host='{claimer}'] td.claimed")[0].text == "claimed", children, logs, 30)

        # Strings anyone can put on chain, and an aggregator's reason, render as text.
        proposer = ChainClient(chain.backend, chain.backend.dev_accounts()[3], sched.deployment).connect()
        proposer.propose([proposer.action_mint(proposer.address, 1)], HOSTILE)
        challenger = ChainClient(chain.backend, chain.backend.dev_accounts()[4], sched.deployment).connect()
        challenger.challenge(epoch, claimer, bytes(range(32)), HOSTILE)
        browser.get(explorer.url)
        # Read inside the wait: live.js may swap <main> between finding an element and reading it.
        shown = wait_until(browser, "the proposal", lambda d: texts(d, "#proposals tr[data-proposal='2'] td span.text"),
                           children, logs, 30)
        assert shown[0] == HOSTILE
        shown = wait_until(browser, "the challenge", lambda d: texts(d, "#challenges tbody tr td span.text"),
                           children, logs, 30)
        assert shown[0] == HOSTILE
        _hostile_report(out / "explorer.sqlite3", sched.deployment, epoch, claimer)
        browser.get(f"{explorer.url}epochs/{epoch}/rounds/2")
        assert css(browser, "ul.reasons li")[0].text == HOSTILE
        assert "NOT verified" in css(browser, "main")[0].text
        for page in ("", f"epochs/{epoch}/rounds/2"):
            browser.get(explorer.url + page)
            assert browser.execute_script("return window.pwned") is None
            assert [s.get_attribute("src") for s in css(browser, "script")] == [f"{explorer.url}static/live.js"]

        # Readable on a phone: nothing wider than the screen but the tables' own scroll boxes.
        browser.set_window_size(390, 844)
        browser.get(f"{explorer.url}epochs/{epoch}")
        assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1")
    finally:
        if explorer is not None:
            explorer.stop()
        children.stop()
        chain.stop()
    wanted = request.config.getoption("--explorer-screenshot")
    if wanted:
        shutil.copyfile(screenshot, wanted)


def _hostile_report(db_path: Path, deployment: Any, epoch: int, host: str) -> None:
    """Round 2's report replaced by what a malicious aggregator could answer: a script as its reason."""
    db = IndexDb(db_path).open(
        {"chain_id": deployment.chain_id, "registry": deployment.registry, "governor": deployment.governor})
    try:
        block = db.db.execute("SELECT block FROM reports WHERE epoch=? AND round=2", (epoch,)).fetchone()[0]
        forged = pb.RoundResult(contributions=[pb.Contribution(host=to_canonical_address(host), reasons=[HOSTILE])])
        db.save_report(to_report(Finalized(epoch, 2, block, bytes(32), bytes(32), 0), "forger:1", forged,
                                 "forger:1: forged"))
    finally:
        db.close()
