import pytest

from exatrain.launch import LaunchError, detect, expand_nodelist


def test_plain_process_is_not_a_job():
    assert detect({}) is None


def test_torchrun():
    env = detect({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                  "MASTER_ADDR": "node0", "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 8, 1, 4)
    assert (env.master_addr, env.master_port, env.source) == ("node0", 1234, "torchrun")


def test_slurm_master_from_nodelist():
    env = detect({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                  "SLURM_STEP_NODELIST": "nid[0012-0013,0020]", "SLURM_STEP_NUM_NODES": "3",
                  "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_JOB_ID": "777"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert env.master_addr == "nid0012" and env.source == "Slurm"
    assert 29500 <= env.master_port < 31500


def test_master_addr_overrides_the_launcher():
    env = detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "a1",
                  "MASTER_ADDR": "b2", "MASTER_PORT": "4000"})
    assert (env.master_addr, env.master_port) == ("b2", 4000)


def test_open_mpi_and_pmi():
    env = detect({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
                  "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                  "MASTER_ADDR": "h0"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.source) == \
        (2, 4, 0, 2, "Open MPI")
    env = detect({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MASTER_ADDR": "h0"})
    assert (env.rank, env.world_size, env.local_rank, env.source) == (1, 2, 1, "PMI")


def test_flux_and_lsf():
    env = detect({"FLUX_TASK_RANK": "3", "FLUX_JOB_SIZE": "4", "FLUX_TASK_LOCAL_ID": "1",
                  "FLUX_JOB_NNODES": "2", "MASTER_ADDR": "f0"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.source) == \
        (3, 4, 1, 2, "flux")
    env = detect({"JSM_NAMESPACE_RANK": "7", "JSM_NAMESPACE_SIZE": "12",
                  "JSM_NAMESPACE_LOCAL_RANK": "1", "JSM_NAMESPACE_LOCAL_SIZE": "6",
                  "LSB_MCPU_HOSTS": "batch1 1 c01n02 42 c01n03 42"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr) == (7, 12, 1, "c01n02")


def test_missing_rendezvous_host_says_what_to_export():
    with pytest.raises(LaunchError, match="flux.*export MASTER_ADDR"):
        detect({"FLUX_TASK_RANK": "0", "FLUX_JOB_SIZE": "2"})


def test_nodelist_expansion():
    assert expand_nodelist("nid[001-003,007],login1") == ["nid001", "nid002", "nid003", "nid007",
                                                          "login1"]
    assert expand_nodelist("gpu12") == ["gpu12"]


def test_a_stop_signal_while_a_launched_rank_starts_is_kept_for_the_trainer():
    """SIGUSR1 before the Trainer's handler exists would end the process (no checkpoint, no
    summary for a batch script to requeue on): held from `exatrain run`'s start, then taken
    over by StopOnSignal, so the run stops after its first step."""
    import os
    import signal

    from exatrain.launch.signals import hold_early_signals
    from exatrain.train.resilience.stop import StopOnSignal

    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        hold_early_signals()
        os.kill(os.getpid(), signal.SIGUSR1)  # delivered to the main thread at once
        stop = StopOnSignal().install()
        assert stop.signum == signal.SIGUSR1
        stop.restore()
        assert StopOnSignal().install().signum is None  # taken once
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_rank_that_starts_after_the_warning_finds_its_file(tmp_path, monkeypatch):
    """A batch script writes the wall-time warning's file (EXATRAIN_STOP_FILE) before it signals
    the job's steps; a rank whose step was made too late for the signal finds the file as its
    StopOnSignal is installed, and stops as on SIGUSR1. No file (yet): no stop."""
    import signal

    from exatrain.train.resilience.stop import StopOnSignal

    warning = tmp_path / "wall_time_warning.7.0"
    monkeypatch.setenv("EXATRAIN_STOP_FILE", str(warning))
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        stop = StopOnSignal().install()
        assert stop.signum is None
        stop.restore()
        warning.touch()
        stop = StopOnSignal().install()
        assert stop.signum == signal.SIGUSR1
        stop.restore()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
