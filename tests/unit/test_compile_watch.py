"""`profiling.profiler.CompileWatch`: Triton compiles inside a rank's serving part are told apart from the warm-up's,
logged one by one and counted at the end (a first use while serving is latency some request pays)."""

from __future__ import annotations

import logging

import pytest

from afd.profiling import profiler as profiling


def compiled(hook, name: str) -> None:  # noqa: ANN001
    """What Triton passes its post-compile hook (the fields afd reads: the variant's repr)."""
    hook(key=name, repr=f"{name}[num_warps=4, num_ctas=1]({{'T': 'i32'}})", fn=object(), compile={},
         is_manual_warmup=False, already_compiled=False)  # fmt: skip


def test_compiles_while_serving_are_named_and_counted_apart(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[str] = []
    watch = profiling.CompileWatch(chained=lambda **kw: seen.append(kw["key"]))
    compiled(watch, "_moe_kernel")
    compiled(watch, "_rope_kernel")
    watch.serving = True
    with caplog.at_level(logging.INFO, logger="afd.profiling.profiler"):
        compiled(watch, "_mla_decode_kernel")
        compiled(watch, "_mla_decode_kernel")
    assert watch.before == 2 and len(watch.after) == 2
    assert seen == ["_moe_kernel", "_rope_kernel", "_mla_decode_kernel", "_mla_decode_kernel"]  # the chain holds
    assert caplog.text.count("Triton compiled _mla_decode_kernel[num_warps=4") == 2
    assert watch.summary() == ("Triton: 2 kernel variants compiled before serving, 2 while serving: _mla_decode_kernel")


def test_watching_installs_the_hook_once_and_summarizes(monkeypatch, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    knobs = pytest.importorskip("triton.knobs")
    monkeypatch.setattr(profiling, "_WATCH", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    watch = profiling.watch_compiles()
    assert watch is not None and profiling.watch_compiles() is watch
    assert knobs.runtime.jit_post_compile_hook is watch
    compiled(knobs.runtime.jit_post_compile_hook, "_norm_kernel")  # during the warm-up
    with caplog.at_level(logging.INFO, logger="afd.profiling.profiler"), profiling.watching_compiles(True):
        compiled(knobs.runtime.jit_post_compile_hook, "_swiglu_kernel")
    assert not watch.serving
    assert "1 kernel variants compiled before serving, 1 while serving: _swiglu_kernel" in caplog.text
    with profiling.watching_compiles(False):  # CPU ranks: nothing installed or logged
        pass
