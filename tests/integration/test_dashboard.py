"""``palatine dashboard`` in a real headless Chromium against a running local mesh: the
page needs its token, shows the job's procs, turns a SIGKILLed worker red within a second
and shows a stuck proc's stack and log on a click. A screenshot is kept in the test's tmp
dir."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

from palatine import inspect, local_mesh, remote

pytestmark = pytest.mark.timeout(180)

cloudpickle.register_pickle_by_value(sys.modules[__name__])

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


def sleep_in_a_known_place(seconds: float) -> int:
    from palatine.hosting import user_metrics

    user_metrics.gauge("dashboard_test_loss").set(0.25)
    print("dashboard test: this worker sleeps now", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.02)
    return 0


def first_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The first stdout line of ``proc``, read within ``timeout_s``."""
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    out = proc.stdout
    threading.Thread(target=lambda: lines.put(out.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout_s).strip()
    except queue.Empty:
        raise AssertionError(f"no link from palatine dashboard in {timeout_s} s") from None


def status_of(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    if CHROMIUM is None or DRIVER is None:
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install them)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,1000",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}"):  # fmt: skip
        opts.add_argument(flag)
    driver = webdriver.Chrome(options=opts, service=Service(DRIVER))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def test_dashboard_shows_procs_a_killed_worker_in_red_and_a_stuck_procs_stack(
    browser: Any, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    with local_mesh(1, 3) as mesh:
        cluster = mesh._local
        assert cluster is not None
        env = {**os.environ, "PALATINE_CLUSTER_TOKEN": cluster.env["PALATINE_CLUSTER_TOKEN"]}
        dash = subprocess.Popen(
            [sys.executable, "-m", "palatine", "dashboard", "--system-addr",
             cluster.system_addr, "--log-dir", str(cluster.logs.path)],
            stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        try:
            url = first_line(dash, 30)
            assert url.startswith("http://127.0.0.1:") and "/?token=" in url, url
            base = url.split("?")[0]
            assert status_of(base) == 403
            assert status_of(base + "api/state?token=wrong") == 403
            assert status_of(url) == 200

            with mesh.activate():
                pids = [inspect(remote(os.getpid)(), shard=r) for r in range(3)]
                remote(sleep_in_a_known_place)(60.0)
            browser.get(url)
            wait = WebDriverWait(browser, 30, poll_frequency=0.05)
            rows = wait.until(
                lambda d: (
                    (r := d.find_elements(By.CSS_SELECTOR, "tr.proc-row[data-proc^='worker[']"))
                    and len(r) == 3
                    and r
                )
            )
            assert {r.get_attribute("data-proc") for r in rows} == {
                "worker[0]",
                "worker[1]",
                "worker[2]",
            }
            assert all(r.get_attribute("data-health") == "Alive" for r in rows)

            # a stuck proc's stack (and its log) at a click
            browser.find_element(By.CSS_SELECTOR, "tr.proc-row[data-proc='worker[1]']").click()
            stacks = wait.until(
                lambda d: (
                    "sleep_in_a_known_place" in (t := d.find_element(By.ID, "stacks").text) and t
                )
            )
            assert "worker" in browser.find_element(By.ID, "detail-title").text
            assert stacks
            wait.until(lambda d: "this worker sleeps now" in d.find_element(By.ID, "log").text)

            # a SIGKILLed worker turns red within a second
            red = "tr.proc-row[data-proc='worker[2]']:not(.health-Alive)"
            os.kill(pids[2], signal.SIGKILL)
            t0 = time.monotonic()
            WebDriverWait(browser, 1.0, poll_frequency=0.02).until(
                lambda d: d.find_elements(By.CSS_SELECTOR, red)
            )
            took = time.monotonic() - t0
            colour = browser.find_element(By.CSS_SELECTOR, red).value_of_css_property(
                "background-color"
            )
            assert colour == "rgba(248, 208, 208, 1)", colour
            # in words, as the system logged it
            wait.until(
                lambda d: (
                    f"worker[2] (pid {pids[2]}" in (t := d.find_element(By.ID, "failures").text)
                    and "signal 9" in t
                )
            )
            # the workers' gauge, plotted over time (it comes with their heartbeats)
            plot = wait.until(
                lambda d: d.find_elements(
                    By.CSS_SELECTOR, "[data-metric='worker: dashboard_test_loss'] polyline"
                )
            )
            assert plot[0].get_attribute("points")
            browser.save_screenshot(str(tmp_path / "dashboard.png"))
            assert took < 1.0
        finally:
            dash.send_signal(signal.SIGINT)
            try:
                assert dash.wait(timeout=20) == 0
            finally:
                dash.kill()


def test_local_mesh_with_dashboard_serves_its_link_and_says_it(
    capfd: pytest.CaptureFixture[str],
) -> None:
    import json

    with local_mesh(1, 2, dashboard=True) as mesh:
        assert mesh._local is not None
        url = mesh.dashboard_url
        assert url is not None
        assert url.startswith("http://127.0.0.1:") and "/?token=" in url, url
        assert f"palatine: dashboard {url}" in capfd.readouterr().err
        base, _, query = url.partition("?")
        assert status_of(base + "api/state") == 403
        with urllib.request.urlopen(base + "api/state?" + query, timeout=10) as r:
            state = json.load(r)
        worker = next(w for w in state["worlds"] if w["name"] == "worker")
        assert [p["proc"] for p in worker["procs"]] == ["worker[0]", "worker[1]"]
        assert state["job"]["log_dir"] == str(mesh._local.logs.path)


def test_dashboard_of_a_job_by_its_id_takes_its_log_dir_from_the_jobs_record() -> None:
    import json

    with local_mesh(1, 1) as mesh:
        assert mesh._local is not None and mesh.job_id
        env = {k: v for k, v in os.environ.items() if k != "PALATINE_SYSTEM_ADDR"}
        dash = subprocess.Popen(
            [sys.executable, "-m", "palatine", "dashboard", "--job", mesh.job_id],
            stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        try:
            url = first_line(dash, 30)
            base, _, query = url.partition("?")
            with urllib.request.urlopen(base + "api/state?" + query, timeout=10) as r:
                job = json.load(r)["job"]
            assert job["id"] == mesh.job_id
            assert job["log_dir"] == str(mesh._local.logs.path)
        finally:
            dash.send_signal(signal.SIGINT)
            try:
                assert dash.wait(timeout=20) == 0
            finally:
                dash.kill()
