import os
import signal
import subprocess
import sys

import pytest

from lm.training.preemption import StopSignals


def test_sigterm_is_one_request_however_often_it_comes():
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a scheduler and a launcher both signal: still one request
        assert signals.requested == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the previous handler is back


@pytest.mark.process
def test_a_second_ctrl_c_ends_the_process_at_once():
    code = ("import os, signal, time\n"
            "from lm.training.preemption import StopSignals\n"
            "with StopSignals() as s:\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    assert s.requested == 'SIGINT'\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(5)\n"
            "print('not reached')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == -signal.SIGINT and "not reached" not in result.stdout
