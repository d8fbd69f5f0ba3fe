"""What rank 0 prints: lines that say what they count, a bar with rate and ETA on a terminal,
and one unwrapped line per log interval with progress and ETA when the output is a file."""

from __future__ import annotations

import io

from rich.console import Console

from exatrain.observe.console import TrainConsole, comm_text

RECORD = {"step": 200, "loss": 0.25, "lr": 1e-3, "samples_per_s": 136.0, "step_s": 0.0588,
          "peak_mem_bytes": 350 * 2**20, "peak_mem_source": "rss", "state_bytes": 1843,
          "data_wait_s": 0.0031, "data_wait_fraction": 0.05,
          "bytes_per_step": {"pipe": 528, "trainer+pipe+data+shard+space+tensor": 4},
          "step_losses": [0.25, 0.25]}


def test_communication_is_named_per_axis_and_the_world_axis_is_all_ranks():
    assert comm_text(RECORD["bytes_per_step"]) == "comm/step pipe 528 B, all ranks 4 B"
    assert comm_text({}) == "comm/step -"
    assert comm_text({"data+space": 2048}, prefix="") == "data+space 2.0 KiB"


def test_a_file_gets_one_unwrapped_line_per_interval_with_progress_eta_and_input_wait():
    out = io.StringIO()
    console = TrainConsole(Console(file=out, width=80, force_terminal=False))
    bar = console.progress(total=2000, done=0)
    for _ in range(200):
        bar.advance()
    bar.log(RECORD)
    bar.log({"step": 200, "val_mae": 0.21})
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines                       # never wrapped at 80 columns
    train = lines[0]
    assert len(train) > 80
    assert train.startswith("step 200/2000 (10 %, ETA ")
    assert "comm/step pipe 528 B, all ranks 4 B" in train and "trainer+pipe" not in train
    assert "input wait 3.1 ms" in train and "136 samples/s" in train
    assert lines[1].startswith("step 200  val_mae 0.21")


def test_a_terminal_gets_a_bar_with_rate_input_wait_and_eta():
    out = io.StringIO()
    console = TrainConsole(Console(file=out, width=160, force_terminal=True))
    bar = console.progress(total=2000, done=0)
    assert bar.bar is not None
    bar.advance()
    bar.log(RECORD)
    task = bar.bar.tasks[0]
    assert task.fields["rate"] == "136 samples/s  input wait 3.1 ms"
    header = [getattr(c, "text_format", type(c).__name__) for c in bar.bar.columns]
    assert "TimeRemainingColumn" in header and "{task.fields[rate]}" in header
    bar.close()
    assert "136 samples/s" in out.getvalue()


def test_the_report_figure_calls_the_world_axis_all_ranks(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from exatrain.observe.figures import bytes_per_axis
    from exatrain.observe.runs import RunRecord

    run = RunRecord(tmp_path, summary={"plan": "Plan(data=2)", "bytes_per_step": {
        "data": 19115152, "trainer+pipe+data+shard+space+tensor": 4}})
    shown, real_savefig = [], plt.Figure.savefig

    def keep_labels(fig, *args, **kwargs):   # the tick labels, read as the figure is saved
        shown.extend(t.get_text() for ax in fig.axes for t in ax.get_xticklabels())
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", keep_labels)
    assert bytes_per_axis([run], tmp_path / "bytes.png").is_file()
    assert shown == ["data", "all ranks"]


def test_writing_data_shows_rate_and_eta_in_a_file_and_a_bar_on_a_terminal():
    from exatrain.observe.console import work_progress

    out = io.StringIO()
    report = work_progress(Console(file=out, width=80, force_terminal=False), "writing data")
    for done in range(0, 101):
        report(done, 100)
    lines = out.getvalue().splitlines()
    assert len(lines) == 11 and lines[0] == "writing data: 0/100 (0 %)"
    assert lines[5].startswith("writing data: 50/100 (50 %, ") and "/s, ETA " in lines[5]
    assert lines[-1].startswith("writing data: 100/100 (100 %, ")

    tty = io.StringIO()
    report = work_progress(Console(file=tty, width=120, force_terminal=True), "writing data")
    for done in range(0, 101):
        report(done, 100)
    assert "100/100" in tty.getvalue() and "ETA" in tty.getvalue() and "/s" in tty.getvalue()


def test_counts_print_as_model_sizes_are_written():
    from exatrain.observe.units import human_count

    assert [human_count(n, "params") for n in (999, 1000, 41_712, 999_999, 1.42e9, 1.5e12)] == [
        "999 params", "1 k params", "41.7 k params", "1 M params", "1.42 B params",
        "1.5 T params"]
    assert human_count(float("nan"), "params") == "-"


def test_rates_round_before_they_take_a_prefix():
    from exatrain.observe.units import human_rate

    assert [human_rate(n, "FLOP/s") for n in (999.96, 999_960, 1234, 4.63e10)] == [
        "1 kFLOP/s", "1 MFLOP/s", "1.23 kFLOP/s", "46.3 GFLOP/s"]
