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


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: without xdist (or without -n) it is never called
def pytest_xdist_make_scheduler(config, log):
    # With `-n auto --dist loadgroup` (the README's command) each test file runs whole in one worker, so a file's
    # module fixtures (a built wheel, runs computed once) are made once and never twice at once; the Flower files share
    # one worker, so that no two deployments or Ray clusters start at once and a SuperNode's reply timeout is not
    # shared with another. The groups are this scheduler's scopes, not xdist_group marks: on pytest 9 xdist (3.8)
    # can no longer write a mark's group into the node id, and loadgroup then spread a file's tests over the workers.
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return "flower" if file.rsplit("/", 1)[-1].startswith("test_flower") else file

    return ByFile(config, log)
