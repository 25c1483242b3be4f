"""FLOP accounting, MFU against the peak of each part's precision, the cached matmul peak, padding efficiency."""

import datetime
import json
import logging

import pytest
import torch

from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise import perf
from conftest import tiny_config
from rollwise.config import AlgoConfig, TrainConfig
from rollwise.generate import TorchEngine
from rollwise.train.batching import collate, split_by_tokens
from rollwise.train.flops import reference_flops
from rollwise.train.trainer import Trainer
from rollwise.types import GenerationRequest, Prompt, SamplingParams, Sample, Status

INFO = {"vocab_size": 10, "hidden_size": 4, "params_matmul": 140, "layers": 2}
SMALL = 64  # matmul side of the peak measurements in these tests (fast; the real default is 2048)


def _sample(prompt: list[int], n: int, group: int = 0, advantage: float = 1.0) -> Sample:
    return Sample(Prompt(str(group), []), prompt, [5 + i % 7 for i in range(n)], [-1.0] * n, [1] * n,
                  Status.COMPLETED, group, reward=advantage, advantage=advantage)


def _seed_peak(dtype, threads: int, gflops: float, size: int = perf.MEASURE_SIZE, **extra) -> None:
    """Write a cache entry as `peak_entry` would have (real file I/O into the test's ROLLWISE_CACHE)."""
    entry = {"gflops": gflops, "dtype": str(dtype).removeprefix("torch."), "threads": threads, "date": "2024-01-01",
             "method": perf.method(size), "nominal_checked": True, **extra}
    perf._write_entry(perf._key(dtype, threads), entry)


def _entry(dtype, threads: int) -> dict:
    return perf._read_cache()[perf._key(dtype, threads)]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLWISE_CACHE", str(tmp_path))
    monkeypatch.setattr(perf, "_REMEASURED", set())
    monkeypatch.setattr(perf, "_MEASURED_HERE", set())
    return tmp_path / perf.PEAK_FILE


# -- FLOPs -------------------------------------------------------------------------------------------------
def test_flop_counter_hand_computed():
    c = perf.FlopCounter(INFO)
    # head = 10 * 4 = 40, body = 140 - 40 = 100, attention per context position = 4 * 2 * 4 = 32
    assert c.head == 40 and c.body == 100 and c.attn_per_ctx == 32
    # 3 tokens at context 5 with logits on 2: 2*100*3 + 32*5*3 + 2*40*2 = 600 + 480 + 160
    assert c.forward(3, 5, 2) == 1240
    # training = 3x forward (forward + backward), per pass, over the mean context / 2
    assert c.train(3, 2, 10, passes=2) == 6 * c.forward(3, 5, 2)
    # rollout: prefill 6 tokens at context 6/2 (no logits) = 1200 + 576; decode 24 fed tokens at context
    # 6 + 4/2 with 25 logit rows = 4800 + 32*8*24 + 2*40*25 = 4800 + 6144 + 2000
    assert c.rollout(6, 24, 25, prompt_len=6, response_len=4) == 1776 + 12944


def test_train_flops_count_every_pass_the_trainer_reports():
    c = perf.FlopCounter(INFO)
    trained = [_sample([1, 2, 3], 2), _sample([1, 2, 3], 4)]
    # one pass over the batch computed 9 real tokens (shared prompt 3 + responses 2 + 4); 2 PPO epochs
    metrics = {"train/tokens": 18.0, "train/passes/update": 2.0, "train/passes/old_logprobs": 1.0,
               "train/passes/reference": 1.0, "train/passes/critic": 1.0}
    # responses 6, mean context (5 + 7) / 2 = 6 -> attention at 3
    with_head = 2 * 100 * 9 + 32 * 3 * 9 + 2 * 40 * 6  # 3144: one forward with logits on the responses
    no_head = 2 * 100 * 9 + 32 * 3 * 9  # 2664: the critic's pass stops at the hidden states
    # 2 epochs x (forward + backward = 3 forwards) + old log-probs + reference (forward) + critic (no head)
    assert perf.train_flops(c, trained, metrics) == 3 * 2 * with_head + 2 * with_head + no_head
    single = {"train/tokens": 9.0, "train/passes/update": 1.0, "train/passes/old_logprobs": 0.0,
              "train/passes/reference": 0.0, "train/passes/critic": 0.0}
    assert perf.train_flops(c, trained, single) == 3 * with_head
    assert perf.train_flops(c, [], {}) == 0.0


def test_reference_pass_in_the_filter_stage_hand_computed():
    c = perf.FlopCounter(INFO)
    samples = [_sample([1, 2, 3], 2), _sample([1, 2, 3], 4), _sample([4, 5], 1, group=1)]
    # responses 7, mean context (5 + 7 + 3) / 3 = 5 -> attention at 2.5
    shared = 3 + 2 + 7  # each prompt once in its row
    plain = 3 + 3 + 2 + 7  # every row repeats its prompt
    assert reference_flops(c, samples, 1024, share_prompt=True) == 200 * shared + 80 * shared + 80 * 7
    assert reference_flops(c, samples, 1024, share_prompt=False) == 200 * plain + 80 * plain + 80 * 7
    # the same real tokens the trainer's micro-batches hold (what kl_penalties runs on)
    for share, tokens in ((True, shared), (False, plain)):
        batches = split_by_tokens(samples, 1024, share_prompt=share)
        assert sum(collate(b, 0, share_prompt=share).real_tokens for b in batches) == tokens


def _trainer_passes(**train) -> dict[str, float]:
    model, ref = tiny_llama(97, seed=4), tiny_llama(97, seed=4)
    algo = AlgoConfig(kl_coef=0.1, advantage="gae") if train.pop("critic", False) else AlgoConfig(kl_coef=0.1)
    trainer = Trainer(model, TrainConfig(lr=1e-3, precision="fp32", **train), algo, pad_id=0, ref_model=ref)
    samples = [_sample([3 + g, 4, 5, 6], n, group=g, advantage=a) for g in range(2) for n, a in ((2, 1.0), (3, -1.0))]
    metrics = trainer.step(samples)
    if train.get("minibatches_per_epoch", 1) == 1:  # real tokens of one pass: each prompt once, every response
        assert metrics["train/tokens"] == metrics["train/passes/update"] * (2 * 4 + 2 * (2 + 3))
    return {k.removeprefix("train/passes/"): v for k, v in metrics.items() if k.startswith("train/passes/")}


def test_trainer_reports_the_passes_it_ran():
    # one epoch, one minibatch: the old log-probs are the current ones (no extra pass); the reference runs
    assert _trainer_passes() == {"update": 1.0, "old_logprobs": 0.0, "reference": 1.0, "critic": 0.0}
    # several updates per batch with recomputed old log-probs: one extra forward before the first update
    several = _trainer_passes(ppo_epochs=2, minibatches_per_epoch=2, old_logprobs="recompute", critic=True)
    assert several == {"update": 2.0, "old_logprobs": 1.0, "reference": 1.0, "critic": 1.0}


# -- MFU against the peak of each precision ---------------------------------------------------------------
def test_mfu_figures_use_each_parts_peak_time_weighted():
    flops = {"rollout": 4e9, "train": 3e9}
    seconds = {"rollout": 2.0, "reward": 1.0, "train": 3.0}
    out = perf.mfu_figures(flops, seconds, generate_s=2.0, peaks=(4.0, 2.0))  # rollout bf16 4, train fp32 2
    assert out["perf/rollout_mfu"] == pytest.approx(4e9 / 2 / 4e9)
    assert out["perf/train_mfu"] == pytest.approx(3e9 / 3 / 2e9)
    # capacity: rollout 2 s x 4 + reward 1 s x max(4, 2) + train 3 s x 2 = 18 GFLOP
    assert out["perf/mfu"] == pytest.approx(7 / 18)
    # the filter stage's reference pass counts at the train peak
    out = perf.mfu_figures({**flops, "filter": 1e9}, {**seconds, "filter": 0.5}, 2.0, (4.0, 2.0))
    assert out["perf/mfu"] == pytest.approx(8 / 19)
    # async: the generation process's cores add step time x the rollout peak; the rollout MFU is over its own time
    out = perf.mfu_figures(flops, {"rollout": 1.0, "train": 3.0}, generate_s=2.5, peaks=(4.0, 2.0), concurrent=True)
    assert out["perf/mfu"] == pytest.approx(7 / (4 * (4 + 2)))
    assert out["perf/rollout_mfu"] == pytest.approx(4e9 / 2.5 / 4e9)
    # a part without a CPU peak (on a GPU): no figure, rather than a wrong one
    out = perf.mfu_figures(flops, seconds, 2.0, (None, 2.0))
    assert out["perf/rollout_mfu"] is None and out["perf/mfu"] is None and out["perf/train_mfu"] == 0.5


def test_peak_of_each_dtype_and_thread_count_is_chosen(cache):
    _seed_peak(torch.float32, 1, 100.0)
    _seed_peak(torch.bfloat16, 1, 400.0)
    _seed_peak(torch.float32, 2, 150.0)
    assert perf.PeakSpec(torch.bfloat16, torch.float32, threads=1).peaks() == (400.0, 100.0)
    assert perf.PeakSpec(torch.float32, torch.bfloat16, threads=1).peaks() == (100.0, 400.0)
    async_spec = perf.PeakSpec(torch.float32, torch.float32, threads=1, rollout_threads=2, concurrent=True)
    assert async_spec.peaks() == (150.0, 100.0)
    row = perf.checked_mfu({"rollout": 8e10, "train": 1e10}, {"rollout": 1.0, "train": 1.0}, 1.0,
                           perf.PeakSpec(torch.bfloat16, torch.float32, threads=1))
    assert row["perf/peak_gflops_rollout"] == 400.0 and row["perf/peak_gflops_train"] == 100.0
    assert row["perf/rollout_mfu"] == pytest.approx(0.2) and row["perf/train_mfu"] == pytest.approx(0.1)
    assert row["perf/mfu_suspect"] == 0.0
    gpu = perf.checked_mfu({"rollout": 1e9}, {"rollout": 1.0}, 1.0,
                           perf.PeakSpec(torch.bfloat16, torch.float32, threads=1, rollout_on_cpu=False))
    assert gpu["perf/peak_gflops_rollout"] is None and gpu["perf/rollout_mfu"] is None


def test_a_step_of_a_run_reports_its_passes_and_both_peaks(cache, tiny_model_dir):
    from rollwise.loop import rl_step
    from rollwise.build import open_run

    _seed_peak(torch.float32, 1, 1000.0)  # the run uses 1 thread (model.threads = 1); no measurement here
    _seed_peak(torch.bfloat16, 1, 3000.0)
    cfg = tiny_config(tiny_model_dir, **{"model.dtype": "bfloat16", "train.precision": "fp32", "algo.kl_coef": 0.1,
                                         "train.ppo_epochs": 2, "train.minibatches_per_epoch": 2,
                                         "train.old_logprobs": "recompute", "eval.n": 0,
                                         "reward.fn": "toy_plugins:digit_fraction"})  # dense: groups vary
    run = open_run(cfg, cache.parent / "run")
    row, batch = rl_step(run)
    assert row["perf/peak_gflops_rollout"] == 3000.0 and row["perf/peak_gflops_train"] == 1000.0
    assert "perf/peak_gflops_fp32" not in row
    passes = {k: row[f"train/passes/{k}"] for k in ("update", "old_logprobs", "reference", "critic")}
    assert passes == {"update": 2.0, "old_logprobs": 1.0, "reference": 1.0, "critic": 0.0}
    flops = (perf.rollout_flops(run.flops, run.rollouts.stats, batch.scored)
             + perf.train_flops(run.flops, batch.trained, row))
    assert row["perf/step_tflop"] == pytest.approx(flops / 1e12)
    assert row["perf/mfu_suspect"] == 0.0
    assert all(0 < row[k] <= 1 for k in perf.MFU_KEYS) and 0 < row["perf/rollout_padding_eff"] <= 1
    # beside the measured peak, the datasheet one (on a CPU: cores x base clock x FLOP/cycle), same FLOPs
    nominal = perf.nominal_gflops(torch.float32, 1)
    assert row["perf/peak_gflops_train_datasheet"] == nominal
    if nominal is not None:
        assert row["perf/train_mfu_datasheet"] == pytest.approx(row["perf/train_mfu"] * 1000.0 / nominal)


def test_datasheet_peaks_by_gpu_name_and_precision():
    from rollwise.perf_datasheet import gpu_datasheet_gflops

    assert gpu_datasheet_gflops("NVIDIA H100 80GB HBM3", torch.bfloat16) == pytest.approx(989_400)
    assert gpu_datasheet_gflops("NVIDIA H100 PCIe", torch.bfloat16) == pytest.approx(756_500)
    assert gpu_datasheet_gflops("NVIDIA H200", torch.float32) == pytest.approx(66_900)  # no TF32 by default
    assert gpu_datasheet_gflops("NVIDIA A100-SXM4-80GB", torch.bfloat16) == pytest.approx(312_000)
    assert gpu_datasheet_gflops("NVIDIA L40S", torch.bfloat16) == pytest.approx(362_050)
    assert gpu_datasheet_gflops("NVIDIA GeForce RTX 4090", torch.bfloat16) is None  # never a guess


# -- the cached peak ---------------------------------------------------------------------------------------
def test_cache_entry_records_value_date_method_and_threads(cache):
    value = perf.matmul_peak_gflops(torch.float32, threads=1, size=SMALL)
    stored = json.loads(cache.read_text())
    (entry,) = stored.values()
    assert entry["gflops"] == value > 0
    assert entry["threads"] == 1 and entry["dtype"] == "float32"
    assert entry["method"] == perf.method(SMALL) and entry["method"].startswith(f"best of {perf.BEST_OF}, {SMALL}^3")
    assert datetime.datetime.fromisoformat(entry["date"]).year >= 2024
    assert perf.matmul_peak_gflops(torch.float32, threads=1, size=SMALL) == value  # cached: not measured again
    assert json.loads(cache.read_text()) == stored


def test_old_or_other_method_entries_are_measured_again(cache):
    cache.write_text(json.dumps({perf._key(torch.float32, 1): 107.0}))  # the old format: a bare number
    assert perf.matmul_peak_gflops(torch.float32, threads=1, size=SMALL) != 107.0
    assert _entry(torch.float32, 1)["method"] == perf.method(SMALL)


def test_a_cached_peak_far_below_nominal_is_measured_again_once(cache):
    nominal = perf.nominal_gflops(torch.float32, 1)
    if nominal is None:
        pytest.skip("no nominal rate known for this CPU's ISA")
    low = 0.001 * nominal
    _seed_peak(torch.float32, 1, low, size=SMALL, nominal_checked=False)
    again = perf.matmul_peak_gflops(torch.float32, threads=1, size=SMALL)
    entry = _entry(torch.float32, 1)
    assert again > low and entry["nominal_checked"] is True and entry["date"] != "2024-01-01"
    assert perf.matmul_peak_gflops(torch.float32, threads=1, size=SMALL) == again  # once per entry
    # a figure close to nominal is left alone
    _seed_peak(torch.float32, 1, nominal, size=SMALL, nominal_checked=False)
    assert perf.matmul_peak_gflops(torch.float32, threads=1, size=SMALL) == nominal


def test_nominal_rate_from_cpuinfo_is_conservative():
    avx512 = "model name\t: Some CPU @ 2.50GHz\ncpu MHz\t\t: 2600.000\nflags\t\t: fma avx2 avx512f avx512_bf16\n"
    assert perf.nominal_gflops(torch.float32, 4, cpuinfo=avx512) == pytest.approx(4 * 2.5 * 32)  # lower clock
    assert perf.nominal_gflops(torch.bfloat16, 4, cpuinfo=avx512) == pytest.approx(4 * 2.5 * 64)
    avx2 = "model name\t: Other\ncpu MHz\t\t: 3000.0\nflags\t\t: fma avx2\n"
    assert perf.nominal_gflops(torch.float32, 2, cpuinfo=avx2) == pytest.approx(2 * 3.0 * 16)
    assert perf.nominal_gflops(torch.bfloat16, 2, cpuinfo=avx2) is None  # emulated bf16: unknown
    assert perf.nominal_gflops(torch.float32, 2, cpuinfo="flags\t: neon\n") is None


def test_mfu_above_one_remeasures_the_peak(cache):
    _seed_peak(torch.float32, 1, 1e-3, size=SMALL)  # measured on a busy machine, say
    spec = perf.PeakSpec(torch.float32, torch.float32, threads=1)
    row = perf.checked_mfu({"rollout": 1e8, "train": 1e8}, {"rollout": 1.0, "train": 1.0}, 1.0, spec, size=SMALL)
    assert _entry(torch.float32, 1)["gflops"] == row["perf/peak_gflops_train"] > 1e-3
    assert row["perf/mfu_suspect"] == 0.0 and 0 < row["perf/train_mfu"] <= 1 and 0 < row["perf/mfu"] <= 1


def test_mfu_still_above_one_is_flagged_not_reported(cache, caplog):
    _seed_peak(torch.float32, 1, 1e-3, size=SMALL)
    spec = perf.PeakSpec(torch.float32, torch.float32, threads=1)
    flops = {"rollout": 1e9, "train": 1e16}  # more than any CPU does in a second: a FLOP-count bug, say
    with caplog.at_level(logging.WARNING, logger="rollwise.perf"):
        row = perf.checked_mfu(flops, {"rollout": 1.0, "train": 1.0}, 1.0, spec, size=SMALL, step=3)
    assert row["perf/mfu_suspect"] == 1.0
    assert row["perf/train_mfu"] is None and row["perf/mfu"] is None  # never reported as a figure
    assert 0 < row["perf/rollout_mfu"] <= 1  # the sound figure stays
    assert any(r.getMessage().startswith("MFU > 1 is a bug: step 3") for r in caplog.records)
    measured = _entry(torch.float32, 1)
    assert measured["gflops"] > 1e-3  # it was re-measured first
    perf.checked_mfu(flops, {"rollout": 1.0, "train": 1.0}, 1.0, spec, size=SMALL)
    assert _entry(torch.float32, 1) == measured  # once per process: not again on the next step


def test_remeasure_peaks_and_main_print_the_cache(cache, capsys):
    out = perf.remeasure_peaks(["float32"], threads=1, size=SMALL)
    assert set(out) == {"float32"} and out["float32"]["threads"] == 1
    assert perf.main(["--dtype", "float32", "--threads", "1", "--size", str(SMALL)]) == 0
    printed = capsys.readouterr().out
    assert str(cache) in printed and perf.method(SMALL) in printed and "float32:" in printed


def test_measure_matmul_gflops_is_positive():
    assert perf.measure_matmul_gflops(size=128, repeats=2) > 0


# -- rollout padding efficiency ----------------------------------------------------------------------------
def test_rollout_padding_eff_never_exceeds_one_with_shared_prefill_and_aborts():
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), seed=2, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    a, b = (tok(t, add_special_tokens=False).input_ids for t in ("What is 7 + 3?", "9 + 9 = ?"))
    long, short = SamplingParams(max_new_tokens=10, temperature=1.0, seed=1), SamplingParams(max_new_tokens=2)
    engine = TorchEngine(model, tok, max_batch_size=6)
    engine.abort([99])  # aborted before admission: returns at once, computes nothing
    reqs = [GenerationRequest(i, a, long) for i in range(8)] + [GenerationRequest(8, b, short),
                                                                GenerationRequest(99, b, long)]
    # as partial rollouts do: the first finished request aborts the rest mid-generation
    first = engine.generate(reqs, on_finish=lambda r: engine.abort(list(range(8))) if r.request_id == 8 else None)
    aborted = [r for r in first if r.status == Status.ABORTED and r.request_id < 8]
    assert aborted and all(r.response_ids for r in aborted)
    # ... and continues them (each context = prompt + its own tokens, prefilled again)
    engine.generate([GenerationRequest(r.request_id, a, long, r.response_ids, r.logprobs) for r in aborted])
    s = engine.stats
    assert s.prefill_sequences >= 2 and s.prefill_tokens > 0
    assert s.padding_eff <= 1.0
    assert s.padding_eff == (s.prefill_tokens + s.active_slot_steps) / s.computed_tokens
    # the old count (every sampled token as computed) exceeded 1 here
    assert (s.prefill_tokens + s.generated_tokens) / s.computed_tokens > 1.0


def test_padding_eff_counts_idle_slots_without_the_fused_decoder():
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), seed=2, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    prompt = tok("What is 7 + 3?", add_special_tokens=False).input_ids
    engine = TorchEngine(model, tok, fused=False)  # decodes every slot of the cache, active or not
    lengths = (2, 9, 9, 9)
    out = engine.generate([GenerationRequest(i, prompt, SamplingParams(max_new_tokens=n, temperature=0.0))
                           for i, n in enumerate(lengths)])
    assert [len(r.response_ids) for r in out] == list(lengths)  # no early EOS (else the counts below change)
    s = engine.stats
    # one prefill of the shared prompt; decode step 1 feeds 4 slots, steps 2-8 feed 3 of the 4 slots computed
    assert s.prefill_sequences == 1 and s.prefill_tokens == len(prompt)
    assert s.active_slot_steps == 4 + 7 * 3 and s.computed_tokens == len(prompt) + 4 + 7 * 4
    assert s.padding_eff == pytest.approx((len(prompt) + 25) / (len(prompt) + 32))


@pytest.mark.slow
def test_generation_process_reports_its_own_time_and_threads(cache):
    from rollwise.generate import GenerationProcess
    from rollwise.generate.groups import new_groups
    from rollwise.rollout import ProcessRollouts

    _seed_peak(torch.float32, 1, 1000.0)  # the child warms the peak of its threads: cached, so not measured
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), seed=2, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    prompt = tok("What is 7 + 3?", add_special_tokens=False).input_ids
    with GenerationProcess(model, tok, threads=1) as process:
        rollouts = ProcessRollouts(process)
        rollouts.submit(0, new_groups([(Prompt("p", []), prompt)], 4, 0), SamplingParams(max_new_tokens=5))
        job = rollouts.wait(0)
    assert job.generate_s > 0 and rollouts.threads == 1  # the child's own generation seconds and threads
    s = rollouts.stats
    assert s.prefill_sequences == 1 and s.active_slot_steps == 4 * 4 and 0 < s.padding_eff <= 1
    spec = perf.PeakSpec(torch.float32, torch.float32, threads=1, rollout_threads=rollouts.threads, concurrent=True,
                         train_on_cpu=False)
    assert spec.peaks() == (1000.0, None)  # the rollout is held to the peak of the generation process's threads
