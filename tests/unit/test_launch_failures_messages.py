"""What a failed launch says, in this process: an interrupt carries its signal, and a failure's explanation quotes only
the lines that explain it."""

from __future__ import annotations

import signal

from afd.runtime.launch import Interrupted, describe_exit, explain_failure


def test_interrupted_carries_its_signal() -> None:
    exc = Interrupted(signal.SIGHUP)
    assert isinstance(exc, KeyboardInterrupt) and exc.signum == signal.SIGHUP
    assert "SIGHUP" in str(exc)


def test_failure_explanation_quotes_only_lines_that_explain() -> None:
    info = "2026-11-30 10:00:00,123 afd.model.weights INFO attention model loaded: 48 tensors, torch.float32 on cpu\n"
    assert explain_failure(info) == ""
    error = "2026-11-30 10:00:01,456 afd.worker ERROR ffn rank 0: error: the DP wave failed\n"
    assert explain_failure(error + info) == "ffn rank 0: error: the DP wave failed"
    critical = "2026-11-30 10:00:02,000 afd.distributed.world CRITICAL world rank 1 (ffn 1): stopping because x\n"
    assert explain_failure(info + critical + info) == "world rank 1 (ffn 1): stopping because x"
    traceback = 'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\nValueError: bad\n'
    assert explain_failure(info + traceback + info) == "ValueError: bad"
    assert explain_failure("afd: error: unknown model 'nope'\n") == "error: unknown model 'nope'"
    assert describe_exit(-9) == "status -9 (killed by SIGKILL)" and describe_exit(1) == "status 1"
