"""``mtcore sweep``: the trainer's log lines parsed, a rank's tensor peak recorded through
torch's profiler (live blocks replayed, frees made off-thread ended by address reuse),
bad input refused before any run, and (slow) real layouts measured beside the plan:
the predicted per-rank peak within 15% of the measured one (issue 21)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from mtcore.cli.main import main
from mtcore.plan import constants, load_hardware
from mtcore.plan.layouts import layout_overrides
from mtcore.plan.sweep import (
    as_trained,
    compare,
    live_peak,
    parse_log,
    read_rank_peaks,
    shared_host,
    stage_of,
    tensor_peak,
)
from mtcore.training.overrides import load_config

MB = 1_000_000
# widened so that state and activations are a few hundred MB per rank (fp32), short steps
DENSE = [
    "--model.hidden_size", "512", "--model.num_layers", "8", "--model.num_heads", "8",
    "--model.num_kv_heads", "2", "--model.seq_len", "256",
    "--training.global_batch_size", "4", "--training.micro_batch_size", "1",
]  # fmt: skip
MOE = [*DENSE[:2], "--model.num_layers", "4", *DENSE[4:], "--model.moe.ffn_size", "512"]
BAND = 0.15

LOG = """\
rank 0: GPT (llama) 0.77M params
step 1/3 | loss 8.3000 | lr 2.00e-04 | grad norm 1.000 | 9,000 tokens/s | 0.010 TFLOP/s/rank | MFU n/a | mem 300.5 MiB | 0.90 s/step
step 2/3 | loss 8.2000 | lr 4.00e-04 | grad norm 1.000 | 9,000 tokens/s | 0.010 TFLOP/s/rank | MFU n/a | mem 350.0 MiB | 0.40 s/step
step 3/3 | loss 8.1000 | lr 6.00e-04 | grad norm 1.000 | 9,000 tokens/s | 0.010 TFLOP/s/rank | MFU n/a | mem 1.5 GiB | 0.50 s/step
"""


def test_parse_log_skips_the_warm_up_step_and_takes_the_peak():
    step_s, peak = parse_log(LOG)
    assert step_s == pytest.approx(0.45)
    assert peak == pytest.approx(1.5 * 1024**3)
    assert parse_log("no steps here") == (None, None)


def test_rank_peaks_and_their_stages(tmp_path):
    (tmp_path / "rank1").write_text("300\n")
    (tmp_path / "rank0").write_text("200\n")
    (tmp_path / "other").write_text("not a rank")
    assert read_rank_peaks(str(tmp_path)) == {0: 200, 1: 300}
    # tp2 x pp2 on 4 ranks: tp fastest, pp slowest
    assert [stage_of(r, 4, 2) for r in range(4)] == [0, 0, 1, 1]
    assert [stage_of(r, 2, 1) for r in range(2)] == [0, 0]


def test_live_peak_replays_allocations_and_ends_blocks_whose_addresses_return():
    events = [(0, 100), (200, 50), (0, -100), (0, 30)]  # A, B, free A, C at A's address
    assert live_peak(events) == 150
    # D is freed on a thread the profiler does not watch: no free event. E, handed out
    # inside D's addresses, proves D gone; F does not overlap and stays beside E.
    unseen = [(1000, 100), (1050, 20), (1200, 90)]
    assert live_peak(unseen) == 110  # E + F; D kept alive would have made it 210
    assert live_peak([(5, -8)]) == 0  # a free of a block allocated before recording


def test_tensor_peak_counts_this_threads_tensor_bytes():
    with tensor_peak() as peak:
        a = torch.ones(10_000_000)  # 40 MB
        b = torch.ones(5_000_000)  # 20 MB
        c = a * 2  # 40 MB more: 100 MB alive
        del a, c
        d = torch.ones(1_000_000)  # 4 MB, after 80 MB were freed
    assert 100 * MB <= peak[0] < 101 * MB
    del b, d


def test_a_block_freed_on_another_thread_ends_when_its_address_returns():
    with tensor_peak() as peak:
        held = [torch.ones(10_000_000)]  # 40 MB
        worker = threading.Thread(target=held.clear)  # its free is not reported
        worker.start()
        worker.join()
        again = torch.ones(10_000_000)  # the allocator hands the same pages out again
    assert 40 * MB <= peak[0] < 41 * MB
    del again


def test_a_rejected_layout_stops_before_any_run(capsys):
    code = main(
        ["sweep", "configs/default.yaml", "--layouts", "tp=2,pp=2", "tp=4,pp=1", "--nproc", "4"]
    )
    assert code == 2
    assert "2 key/value heads are not divisible by tp=4" in capsys.readouterr().err


def test_layouts_are_required(capsys):
    with pytest.raises(SystemExit):
        main(["sweep", "configs/default.yaml"])
    assert "--layouts needs one or more layouts" in capsys.readouterr().err


@pytest.mark.slow
def test_one_layout_measured_beside_the_plan():
    done = subprocess.run(
        [sys.executable, "-m", "mtcore.cli.main", "sweep", "configs/default.yaml",
         "--layouts", "tp=2,pp=1", "--nproc", "2", "--steps", "3", *DENSE],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("tp=2,pp=1"))
    measured_s, planned_s, _, measured_mb, planned_mb, ratio = (float(x) for x in row.split()[1:])
    assert measured_s > 0 and planned_s > 0
    assert 200 < measured_mb < 400  # the tensors of ~13M parameters and their AdamW state
    assert abs(planned_mb / measured_mb - 1) <= BAND, row
    assert ratio == pytest.approx(measured_mb / planned_mb, abs=0.01)
    assert f"GEMM_EFFICIENCY {constants.GEMM_EFFICIENCY}," in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "config,layout,model",
    [("configs/default.yaml", "tp=1,pp=2", DENSE), ("configs/moe.yaml", "tp=1,ep=2", MOE)],
    ids=["pp2", "ep2"],
)
def test_planned_peak_per_stage_within_15_percent_of_measured(config, layout, model):
    measured, predicted = compare(config, layout, 2, 3, model, load_hardware("cpu-host"))
    assert not measured.error, measured.error
    assert len(measured.rank_peaks) == 2
    pp = len(predicted.ranks)
    for rank, peak in measured.rank_peaks.items():
        planned = predicted.ranks[stage_of(rank, 2, pp)].peak
        assert abs(planned / peak - 1) <= BAND, (rank, planned / MB, peak / MB)


@pytest.mark.slow
def test_interleaving_with_as_many_microbatches_as_stages_holds_every_head():
    """configs/default.yaml as tp1 x pp2 x vpp2 on 4 ranks (dp 2: 2 micro-batches, as many
    as stages): the schedule runs every forward first, so the last stage holds both
    micro-batches' chunks and losses; planned within 15% of the measured peak (it read
    1.58 before the plan counted that, docs/plan.md)."""
    measured, predicted = compare(
        "configs/default.yaml", "tp=1,pp=2,vpp=2", 4, 3, [], load_hardware("cpu-host")
    )
    assert not measured.error, measured.error
    assert predicted.microbatches == 2 and predicted.peak_rank.stage == 1
    top = max(measured.rank_peaks, key=measured.rank_peaks.get)
    assert stage_of(top, 4, 2) == 1  # the measured peak is the last stage's too
    assert abs(predicted.peak_memory / measured.peak_bytes - 1) <= BAND, (
        predicted.peak_memory / MB,
        measured.peak_bytes / MB,
    )


def test_a_prediction_is_of_the_vocabulary_the_run_trains(tmp_path):
    """configs/llava.yaml asks for a 4096-token tokenizer; its captions give 331 ids,
    which the trainer pads to 384: the plan beside a measurement counts that head."""
    overrides = [*layout_overrides("tp=1,pp=1"), "--data.cache_dir", str(tmp_path)]
    config = load_config("configs/llava.yaml", overrides)
    assert config.model.vocab_size is None and config.data.vocab_size == 4096
    assert as_trained(config, 1).model.vocab_size == 384


def test_more_ranks_than_cores_share_a_core():
    """4 ranks on 2 cores: each planned with half a core's peaks and memory bandwidth
    (the GEMM table's fractions stay); 2 ranks on 2 cores: the file as it is."""
    hardware = load_hardware("cpu-host")
    shared, line = shared_host(hardware, 4, cores=2)
    assert shared.peak_tflops["fp32"] == hardware.peak_tflops["fp32"] / 2
    assert shared.memory_bandwidth_gbs == hardware.memory_bandwidth_gbs / 2
    assert shared.gemm_efficiency == hardware.gemm_efficiency
    assert (
        line == "4 ranks on 2 cores: each planned with 2/4 of a core's compute and memory bandwidth"
    )
    assert shared_host(hardware, 2, cores=2) == (hardware, None)


def test_missing_data_and_counts_that_are_not_numbers_stop_before_any_run(tmp_path, capsys):
    missing = tmp_path / "nope"
    code = main(["sweep", "configs/default.yaml", "--layouts", "tp=2,pp=2", "--nproc", "4",
                 "--data.paths", str(missing)])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mtcore sweep: error: data path does not exist: {missing}"]
    for flag in ("--nproc", "--steps"):
        with pytest.raises(SystemExit):
            main(["sweep", "configs/default.yaml", "--layouts", "tp=2", flag, "²"])
        assert f"{flag} needs a positive number, got '²'" in capsys.readouterr().err


def test_trace_and_output_are_read_and_a_layout_names_its_folder(capsys):
    from mtcore.cli.main import build_parser
    from mtcore.cli.sweep import _folder_name

    args = build_parser().parse_args(
        ["sweep", "configs/default.yaml", "--layouts", "tp=2,pp=2", "--trace", "--output", "out"]
    )
    assert (args.trace, args.output, args.layouts, args.overrides) == (True, "out", ["tp=2,pp=2"], [])
    assert build_parser().parse_args(["sweep", "--layouts", "tp=2"]).output == "runs/sweep"
    with pytest.raises(SystemExit):
        main(["sweep", "configs/default.yaml", "--layouts", "tp=2", "--output"])
    assert "--output needs a value" in capsys.readouterr().err
    assert _folder_name("tp=2,pp=2,recompute=full") == "tp=2,pp=2,recompute=full"
    assert _folder_name("tp=2/pp 2") == "tp=2_pp_2"
