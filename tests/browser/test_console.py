"""The operator console in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, which ``.ci/run`` installs) driven by Selenium against Django's live
server on the file-backed test database.

An operator (staff, with the replay and purge permissions, not a superuser) logs in, reads
the queue overview, filters the dead letters by queue, replays two through the
confirmation page, purges everything else that matches the filter, and replays one more
from its detail page; the database shows each result.

With ``RELAY_SCREENSHOTS=1`` the test also saves ``docs/img/overview.png`` and
``docs/img/dead-letters.png`` for the README (``RELAY_SCREENSHOTS=1 bin/test tests/browser``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User

from queue_core.clock import FakeClock, SystemClock
from queue_core.models import Job, JobEvent
from queue_core.service import QueueService

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        CHROMIUM is None or CHROMEDRIVER is None,
        reason="needs Debian's chromium and chromium-driver (apt-get install chromium "
        "chromium-driver; .ci/run installs them)",
    ),
    pytest.mark.django_db(transaction=True),
]

REPO = Path(__file__).resolve().parents[2]
PASSWORD = "correct horse battery staple"
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1440,900",
    "--hide-scrollbars",
)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """A headless Chromium through Debian's chromedriver (no download of either)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    driver.implicitly_wait(5)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def screenshots(tmp_path: Path) -> Path:
    """Where screenshots go: docs/img with RELAY_SCREENSHOTS=1, else a temporary folder."""
    if os.environ.get("RELAY_SCREENSHOTS") == "1":
        return REPO / "docs" / "img"
    return tmp_path


def make_operator() -> User:
    user = User.objects.create_user("olivia", password=PASSWORD, is_staff=True)
    codenames = ("view_job", "view_deadletter", "view_jobevent", "replay_job", "purge_job")
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="queue_core", codename__in=codenames)
    )
    return user


def seed() -> dict[str, list[str]]:
    """Jobs in four queues, made through the service over the last two hours.

    Returns the dead letters by queue, oldest first.
    """
    now = SystemClock().now_ms()
    # The story takes about 40 minutes of fake time and ends a few minutes before now.
    clock = FakeClock(start_ms=now - 45 * 60 * 1000)
    service = QueueService(clock=clock)
    dead: dict[str, list[str]] = {}

    def fail(queue: str, error: str, worker: str, *, retryable: bool, **options: Any) -> str:
        service.submit(queue, {"to": f"user{len(dead.get(queue, []))}@example.com"}, **options)
        lease = service.claim([queue], worker_id=worker)[0]
        service.fail(
            lease["job_id"],
            worker_id=worker,
            lease_token=lease["lease_token"],
            error=error,
            retryable=retryable,
        )
        clock.advance(seconds=97)
        return str(lease["job_id"])

    def die(queue: str, error: str, worker: str, **options: Any) -> None:
        retryable = options.pop("retryable", False)
        dead.setdefault(queue, []).append(
            fail(queue, error, worker, retryable=retryable, **options)
        )

    def succeed(queue: str, worker: str, n: int) -> None:
        for i in range(n):
            service.submit(queue, {"n": i})
            lease = service.claim([queue], worker_id=worker)[0]
            service.ack(lease["job_id"], worker_id=worker, lease_token=lease["lease_token"])
        clock.advance(seconds=60)

    succeed("email", "mail-worker-1:4711", 40)
    succeed("billing", "billing-worker-1:5002", 12)
    for _ in range(3):
        die(
            "email",
            "SMTPAuthenticationError: (535, b'5.7.8 Username and Password not accepted')",
            "mail-worker-1:4711",
        )
        die("email", "ConnectionRefusedError: [Errno 111] smtp.internal:587", "mail-worker-2:4712")
    for _ in range(4):
        # Retryable, but with no retries left: "attempts exhausted".
        die(
            "billing",
            "CardDeclined: insufficient_funds (charge ch_3PZ…)",
            "billing-worker-1:5002",
            retryable=True,
            max_retries=0,
            priority="high",
        )
    for _ in range(2):  # RETRYING, due again in a few minutes
        fail(
            "billing",
            "HTTPError: 503 Service Unavailable from payments.internal",
            "billing-worker-1:5002",
            retryable=True,
            backoff="fixed",
            backoff_base_ms=3_600_000,
        )
    die(
        "thumbnails",
        "PIL.UnidentifiedImageError: cannot identify image file 'upload-8812'",
        "img-worker-1:6100",
    )
    die("reports", "TimeoutError: query exceeded statement_timeout (30 s)", "report-worker:7001")
    for i in range(3):
        service.submit("reports", {"report": i}, delay_ms=3600 * 1000)
    for i in range(12):
        service.submit("thumbnails", {"image": i}, priority="low")
        clock.advance(seconds=20)
    for i in range(30):
        service.submit("email", {"to": f"newsletter{i}@example.com"})
        clock.advance(seconds=5)
    clock.advance(seconds=600)
    for worker, queue, n in (
        ("mail-worker-1:4711", "email", 2),
        ("mail-worker-2:4712", "email", 1),
        ("img-worker-1:6100", "thumbnails", 2),
    ):
        service.claim([queue], worker_id=worker, max_jobs=n, lease_ms=3600 * 1000)
    return dead


def test_operator_filters_replays_and_purges_dead_letters(
    live_server: Any, browser: Any, screenshots: Path
) -> None:
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import Select, WebDriverWait

    dead = seed()
    make_operator()
    base = live_server.url

    def find(css: str) -> Any:
        return browser.find_element(By.CSS_SELECTOR, css)

    def until(condition: Any) -> None:
        WebDriverWait(browser, 10).until(condition)

    def navigate(element: Any) -> None:
        """Click something that loads a new page and wait until the new page has loaded (so no
        element of the old page is read after the click). The old page is marked in its
        window, which a new document does not share; not ``staleness_of``: while the old page
        goes, Chrome can answer its element with "Node with given id does not belong to the
        document", a ``WebDriverException`` that is not the ``StaleElementReferenceException``
        it waits for (a fresh clone's run failed so)."""
        browser.execute_script("window.relayOldPage = true;")
        element.click()
        WebDriverWait(browser, 10, ignored_exceptions=(WebDriverException,)).until(
            lambda b: b.execute_script(
                "return !window.relayOldPage && document.readyState === 'complete';"
            )
        )

    def messages() -> list[str]:
        return [m.text for m in browser.find_elements(By.CSS_SELECTOR, ".messagelist li")]

    # Log in.
    browser.get(f"{base}/admin/")
    find("#id_username").send_keys("olivia")
    find("#id_password").send_keys(PASSWORD)
    navigate(find("input[type=submit]"))
    assert find("#site-name").text == "Relay operator console"

    # The overview, linked from the home page (the navigation sidebar folded, for room).
    navigate(browser.find_element(By.LINK_TEXT, "Queue overview"))
    until(ec.title_contains("Queue overview"))
    find("#toggle-nav-sidebar").click()
    rows = {
        r.find_element(By.TAG_NAME, "th").text: r
        for r in browser.find_elements(By.CSS_SELECTOR, "#relay-queues tbody tr")
    }
    assert sorted(rows) == ["billing", "email", "reports", "thumbnails"]
    assert "mail-worker-1:4711: 2" in rows["email"].text
    assert len(browser.find_elements(By.CSS_SELECTOR, "#relay-failures tbody tr")) == 14
    browser.set_window_size(1440, 1280)  # the whole page
    browser.save_screenshot(str(screenshots / "overview.png"))
    browser.set_window_size(1440, 900)

    # Dead letters, filtered to one queue.
    browser.get(f"{base}/admin/queue_core/deadletter/")
    assert "12 dead letters" in find(".paginator").text
    browser.save_screenshot(str(screenshots / "dead-letters.png"))
    navigate(browser.find_element(By.CSS_SELECTOR, "#changelist-filter a[href='?queue=email']"))
    until(ec.url_contains("?queue=email"))
    ids = [
        c.get_attribute("value") for c in browser.find_elements(By.CSS_SELECTOR, ".action-select")
    ]
    assert sorted(ids) == sorted(dead["email"])

    # Replay two selected dead letters through the confirmation page.
    chosen = ids[:2]
    for box in browser.find_elements(By.CSS_SELECTOR, ".action-select")[:2]:
        box.click()
    Select(find("select[name=action]")).select_by_value("replay_selected")
    navigate(find("button[name=index]"))
    assert find("#relay-will").text == "2"
    assert Job.objects.filter(id__in=chosen, state="dead").count() == 2  # not yet
    navigate(find("#relay-confirm"))
    assert messages() == ["Replayed 2 dead letters."]
    assert browser.current_url.endswith("?queue=email")
    assert set(Job.objects.filter(id__in=chosen).values_list("state", flat=True)) == {"ready"}
    assert set(
        JobEvent.objects.filter(job_id__in=chosen, event="replayed").values_list("actor", flat=True)
    ) == {"olivia"}

    # Purge everything else that matches the filter.
    navigate(find("#relay-all-purge_selected button"))
    assert find("#relay-will").text == "4"
    assert "queue = email" in find(".relay-filters").text
    navigate(find("#relay-confirm"))
    assert messages() == ["Purged 4 dead letters."]
    assert not Job.objects.filter(queue="email", state="dead").exists()
    assert Job.objects.filter(queue="billing", state="dead").count() == 4
    assert JobEvent.objects.filter(event="purged", actor="olivia").count() == 4

    # Replay one from its detail page.
    target = dead["billing"][0]
    browser.get(f"{base}/admin/queue_core/deadletter/{target}/change/")
    assert "CardDeclined" in find(".field-last_error_full").text
    navigate(browser.find_element(By.XPATH, "//button[normalize-space()='Replay…']"))
    assert find("#relay-will").text == "1"
    navigate(find("#relay-confirm"))
    assert messages() == ["Replayed 1 dead letter."]
    assert browser.current_url.endswith(f"/admin/queue_core/job/{target}/change/")
    assert Job.objects.get(id=target).state == "ready"
    assert "replayed" in find(".field-history").text


@pytest.fixture(autouse=True)
def _fresh_queue_name_cache() -> Iterator[None]:
    """The changelist caches queue names for 30 s process-wide; start from none."""
    from django.core.cache import cache

    cache.clear()
    yield
    cache.clear()
