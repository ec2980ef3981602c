"""Progress reporting: plain lines when the output is not a terminal, the rich bar when it is."""

from __future__ import annotations

import io
import re

from echo2.progress import PlainReporter, RichReporter, make_reporter

METRICS = {"step": 3, "reward": 0.41234, "lag_mean": 1.0, "lag_max": 2, "rollouts": 8, "seconds": 21.34,
           "completion_tokens": 120}
STEP_LINE = re.compile(r"^step (\d+)/(\d+): reward (-?[0-9.]+), lag ([0-9.]+) \(max (\d+)\), (\d+) completions, "
                       r"([0-9.]+)s$")


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_reporter_prints_one_flushed_line_per_event(capsys):
    rep = PlainReporter()
    rep.start("r1", 16, 0)
    rep.eval("before", {"accuracy": 0.5, "n": 50})
    rep.step(METRICS, {"actors_alive": 1})
    rep.step({**METRICS, "step": 4, "reward": -0.25, "lag_mean": 0.5, "lag_max": 1, "seconds": 9.96}, {})
    rep.eval("after", {"accuracy": 0.98, "n": 50})
    rep.stop()
    out, err = capsys.readouterr()
    assert err == ""
    assert out.splitlines() == [
        "run r1: training to step 16 (from step 0)",
        "eval before: greedy accuracy 0.500 on 50 held-out problems",
        "step 3/16: reward 0.412, lag 1.0 (max 2), 8 completions, 21.3s",
        "step 4/16: reward -0.250, lag 0.5 (max 1), 8 completions, 10.0s",
        "eval after: greedy accuracy 0.980 on 50 held-out problems",
    ]
    assert all(STEP_LINE.match(line) for line in out.splitlines() if line.startswith("step "))


def test_plain_reporter_writes_to_its_stream_and_flushes():
    class Recording(io.StringIO):
        flushes = 0

        def flush(self):
            self.flushes += 1
            super().flush()

    stream = Recording()
    rep = PlainReporter(stream)
    rep.start("r1", 2, 1)
    rep.step({**METRICS, "step": 2}, {})
    assert stream.getvalue().splitlines()[-1] == "step 2/2: reward 0.412, lag 1.0 (max 2), 8 completions, 21.3s"
    assert stream.flushes >= 2  # every line is flushed: `make run > file` shows each step as it happens


def test_a_stream_that_is_not_a_terminal_gets_plain_lines():
    stream = io.StringIO()
    rep = make_reporter(stream, FakeTTY())
    assert isinstance(rep, PlainReporter) and not isinstance(rep, RichReporter)
    rep.start("r1", 4, 0)
    assert stream.getvalue() == "run r1: training to step 4 (from step 0)\n"
    # the bar's own stream redirected (2> file) while stdout is a terminal: plain lines too
    assert isinstance(make_reporter(FakeTTY(), io.StringIO()), PlainReporter)


def test_a_terminal_gets_the_rich_bar():
    rep = make_reporter(FakeTTY(), FakeTTY())
    assert isinstance(rep, RichReporter)
