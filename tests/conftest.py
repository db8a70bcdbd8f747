"""What every test may assume of the process it runs in, and how the suite shares the cores (pytest-xdist)."""
import signal

import pytest


def pytest_configure(config):
    # A suite started in the background by a shell without job control (`nohup python -m pytest &`, a CI runner)
    # inherits SIGINT ignored, and so would every run the tests start: their Ctrl-C would never arrive, and the tests
    # that send it would wait out their timeouts and fail. A handler (unlike "ignored") is reset to the default in a
    # started process, which then takes Ctrl-C as any terminal's would.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.addinivalue_line("markers", "xdist_group(name): the tests pytest-xdist runs in one worker, in order")


def pytest_collection_modifyitems(config, items):
    # With `-n auto --dist loadgroup` (the README's command) each test file runs whole in one worker, so a file's
    # module fixtures (a built wheel, runs computed once) are made once; the Flower files share one worker, so that
    # no two deployments or Ray clusters start at once and a SuperNode's reply timeout is not shared with another.
    for item in items:
        name = item.path.stem
        item.add_marker(pytest.mark.xdist_group("flower" if name.startswith("test_flower") else name))
