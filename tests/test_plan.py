"""The memory planner (a2tgpo.plan): parameter counts, hand-derived terms, the paper study's
fit, the CLI and the DAG's refusal of a study that cannot fit."""

import dataclasses
import json
import subprocess
import sys

import pytest
import yaml

from a2tgpo.config import ConfigError
from a2tgpo.model.backbone import ArchitectureConfig, BackboneConfig, load_backbone_config
from a2tgpo.plan import (
    GIB,
    MIB,
    RESERVED_SLACK,
    Assumptions,
    count_parameters,
    model_sizes,
    plan_evals,
    plan_study,
    refusal,
)
from a2tgpo.study import load_study

PAPER = "config/paper.yaml"


def _meta_count(arch: ArchitectureConfig) -> tuple[int, int]:
    """transformers' own count: the model built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {f.name: getattr(arch, f.name) for f in dataclasses.fields(arch)}
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    sizes = [p.numel() for p in model.parameters()]
    return sum(sizes), max(sizes)


@pytest.mark.parametrize("backbone", ["qwen3-4b", "qwen3-8b", "qwen2.5-7b"])
def test_parameter_count_is_transformers_count(backbone):
    arch = load_backbone_config(f"config/backbones/{backbone}.yaml").architecture
    assert count_parameters(arch) == _meta_count(arch)


def test_parameter_count_of_a_small_untied_qwen2_by_hand():
    arch = ArchitectureConfig(model_type="qwen2", hidden_size=8, intermediate_size=16,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=4, vocab_size=10, tie_word_embeddings=False)
    # per layer: q, o 8·8 each, k, v 8·4 each (192), biases q 8 + k, v 4 each (16), MLP
    # 3·8·16 (384), two norms 16: 608; embedding and output layer 10·8 each, final norm 8
    assert count_parameters(arch) == (2 * 608 + 160 + 8, 128) == _meta_count(arch)


def test_model_sizes_prefer_config_json_and_check_the_backbone_file(tmp_path):
    arch = load_backbone_config("config/backbones/qwen3-4b.yaml").architecture
    found = dataclasses.asdict(arch) | {"architectures": ["Qwen3ForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(found))
    backbone = BackboneConfig(id="q", path=str(tmp_path), architecture=arch)
    assert model_sizes(backbone).arch == arch
    (tmp_path / "config.json").write_text(json.dumps(found | {"num_hidden_layers": 35}))
    with pytest.raises(ConfigError, match="architecture differs .* num_hidden_layers"):
        model_sizes(backbone)
    with pytest.raises(ConfigError, match="no config.json .* add one"):
        model_sizes(BackboneConfig(id="q", path=str(tmp_path / "missing")))


DEFAULT_SETS = ["main", "tree", "ablation"]  # config/paper.yaml grid.default


def _paper_plans(*overrides, sets=DEFAULT_SETS):
    return plan_study(load_study(PAPER, list(overrides)), sets)


def test_qwen3_8b_grpo_terms_by_hand():
    plans = {p.cell: p for p in _paper_plans(sets=["main"])}
    plan = plans["backbone~qwen3-8b/data~multi_hop/method~grpo/beta~0/seed~1"]
    terms = {ph: {t.name: t.bytes for t in ts} for ph, ts in plan.phases.items()}
    P, V, h = 8_190_735_360, 151_936, 4096  # Qwen3-8B: untied, 36 layers
    assert plan.params == P
    rollout = terms["rollout"]
    assert rollout["weights"] == 2 * P  # bf16
    # train.offload_optimizer (paper.yaml): the optimizer shard is on the GPU for the update
    # only; from one update's end to the next one's start it is in host memory
    assert "optimizer shard" not in rollout and "optimizer shard" not in terms["logprob"]
    assert terms["update"]["optimizer shard"] == 12 * P / 8  # fp32 master + m + v, 8 ranks
    # ZeRO-3 reference: a bf16 shard + the largest tensor (embedding V x h) gathered
    assert rollout["reference (zero3)"] == 2 * P / 8 + 2 * V * h
    assert rollout["vLLM engine (awake)"] == 0.58 * 96 * GIB
    # the job's own retrieval server (retrieval.http.serve job) shards the Flat index over the
    # node's 8 GPUs in fp16: 21,015,324 rows x 768 x 4 B (fp32 file) / 2 / 8 = 4.03e9 B each,
    # in every phase (it stays loaded all job long)
    shard = 21_015_324 * 768 * 4 / 2 / 8
    assert all(terms[ph]["retrieval server: index shard"] == shard for ph in terms)
    assert rollout["retrieval server: faiss scratch + context"] == 2 * GIB
    update = terms["update"]
    # 16384-token micro-batches (>= the 8192-token context), checkpointed: layer inputs
    # 36 x 16384 x 4096 x 2 B
    T, L = 16384, 8192
    assert update["activations (checkpointed)"] == 36 * T * h * 2
    # one layer recomputed: a = 4h + 7q + 2k + 4i (q = 32·128, k = 8·128, i = 12288) per
    # token, the mask rows x L^2 <= T x L, its activation gradients 2i + 2h per token; it
    # beats the log-prob chunk's backward (512 x V x 12 B) + the output layer's gradient
    a = 4 * h + 7 * 4096 + 2 * 1024 + 4 * 12288
    layer = (T * a + T * L + T * (2 * 12288 + 2 * h)) * 2
    assert update["backward peak"] == layer > 512 * V * 12 + 2 * V * h
    assert update["gradients"] == 2 * P / 8 + 4 * P / 8  # ZeRO-2 bf16 + fp32 partition
    # what the caching allocator reserves beyond the passes' tensors: RESERVED_SLACK of the
    # passes' terms (final hidden + gradient T x h x (2 + 4) B, the checkpointed layer inputs,
    # the backward peak); the resident terms, single large blocks, add nothing; none in the
    # rollout phase (the cache is emptied before the engine wakes)
    passes = T * h * 6 + 36 * T * h * 2 + layer
    assert update["allocator reserve"] == pytest.approx(RESERVED_SLACK * passes, rel=1e-12)
    assert "allocator reserve" not in rollout


def test_the_paper_grid_fits_8x96_gib_and_a_full_reference_copy_does_not():
    plans = _paper_plans()
    assert len(plans) == 84 and all(p.fits for p in plans), refusal(plans)
    # a full reference copy fits only beside the optimizer state offloaded while vLLM is awake
    assert all(p.fits for p in _paper_plans("train.reference=copy", sets=["main"]))
    copy = _paper_plans("train.reference=copy", "train.offload_optimizer=false")
    bad = [p for p in copy if not p.fits]
    # the 7-8B backbones' KL methods (Table 1: grpo, dapo, gspo, gigpo, igpo; Tree-GRPO on
    # Qwen2.5-7B) on both tracks: 2 x (2 x 5 + 1)
    assert len(bad) == 22, [p.cell for p in bad]
    assert all(p.cell.split("/")[0] in ("backbone~qwen3-8b", "backbone~qwen2.5-7b")
               for p in bad)
    assert all("reference (copy)" in {t.name for t in p.phases["rollout"]} for p in bad)
    message = refusal(copy)
    assert message.startswith("22 of 84 cells do not fit")
    assert "cell backbone~qwen3-8b/data~multi_hop/method~grpo/beta~0/seed~1: the rollout " \
           "phase needs" in message and "largest term: vLLM engine (awake)" in message


def test_plan_cli_prints_the_table_and_exits_1_when_a_cell_does_not_fit(tmp_path):
    out = subprocess.run([sys.executable, "-m", "a2tgpo.cli", "plan", PAPER, "--sets", "tree",
                          "--json", str(tmp_path / "plan.json")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "2 of 2 cells fit" in out.stdout and "GPU-hours" in out.stdout
    assert "on each job's own retrieval server" in out.stdout
    assert "evaluation jobs of qwen2.5-7b: per GPU" in out.stdout
    data = json.loads((tmp_path / "plan.json").read_text())
    assert [c["fits"] for c in data["cells"]] == [True, True]
    assert [(e["backbone"], e["fits"]) for e in data["evaluation"]] == [("qwen2.5-7b", True)]
    assert data["assumptions"] == dataclasses.asdict(Assumptions())
    bad = subprocess.run([sys.executable, "-m", "a2tgpo.cli", "plan", PAPER,
                          "train.gpu_memory_gb=40", "--sets", "tree"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "0 of 2 cells fit" in bad.stdout


def test_snakemake_dry_run_refuses_a_cell_that_cannot_fit(workdir):
    cfg = yaml.safe_load((workdir / PAPER).read_text())
    cfg["train"]["reference"] = "copy"
    cfg["train"]["offload_optimizer"] = False
    (workdir / "config/tight.yaml").write_text(yaml.safe_dump(cfg))
    run = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--configfile",
                          "config/tight.yaml"], cwd=workdir, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode != 0
    err = run.stdout + run.stderr
    # the DAG checks every set's cells: besides the default sets' 22, the `seeds` set's
    # grpo, dapo, gspo and igpo on the two 7-8B backbones, 2 tracks, seeds 2 and 3 (32)
    assert "invalid config: config (" in err and "): 54 of 166 cells do not fit" in err, \
        err[-3000:]
    assert "cell backbone~qwen3-8b/data~multi_hop/method~grpo/beta~0/seed~1" in err
    assert "largest term: vLLM engine (awake)" in err
    assert "Job stats" not in err  # nothing was scheduled


EIGHT_B_GRPO = "backbone~qwen3-8b/data~multi_hop/method~grpo/beta~0/seed~1"
# the paper's index before it is on disk: corpus rows x retrieval.index.dim x 4 B
INDEX = 21_015_324 * 768 * 4


def test_host_memory_of_a_training_node_by_hand():
    plan = {p.cell: p for p in _paper_plans(sets=["main"])}[EIGHT_B_GRPO]
    host = {t.name: t.bytes for t in plan.host}
    P = 8_190_735_360
    assert host == {
        "processes": 16 * 3 * GIB,  # a trainer and a vLLM engine per rank, 3 GiB each
        "policy weights": 8 * P * 2,  # bf16, per rank: loaded, later the asleep engine's
        # train.offload_optimizer: every rank's ZeRO-2 shard, 12 B x P / 8, pinned here
        "offloaded optimizer state": 8 * 12 * P / 8,
        "checkpoint save": 2 * GIB,  # rank 0 writes one 2 GiB shard at a time
        "retrieval server: index": INDEX,  # faiss reads the whole fp32 file
        "retrieval server: process": 3 * GIB}
    # train.mem_mb null: the request is the total x 1.25, rounded up to whole MiB
    need = 16 * 3 * GIB + 16 * P + 12 * P + 2 * GIB + INDEX + 3 * GIB
    assert plan.mem_request == -(-need * 1.25 // MIB) * MIB and plan.fits
    # paper.yaml syncs weights by handle (ipc); through host memory (bytes) each rank holds
    # 5.77 copies of its bf16 weights in transit: 4.77 measured on vLLM CPU + the GPU's .cpu()
    bytes_plan = {p.cell: p for p in _paper_plans("train.weight_sync=bytes",
                                                  sets=["main"])}[EIGHT_B_GRPO]
    extra = {t.name: t.bytes for t in bytes_plan.host}.items() - host.items()
    assert extra == {("weight sync in transit", 8 * P * 2 * 5.77)}


def test_a_memory_request_below_the_host_plan_is_refused_by_name():
    plans = _paper_plans("train.mem_mb=280000", sets=["main"])  # 273.4 GiB
    bad = [p for p in plans if not p.fits]
    # the 7-8B backbones' nodes need 312-327 GiB, the 4B's 218 GiB: 2 backbones x 2 tracks x
    # 10 methods. Qwen3-8B: 16 processes x 3 GiB + 8 ranks' bf16 weights 122.1 + the offloaded
    # optimizer shards 12 B x P = 91.5 + a 2 GiB save shard + the index 60.1 + its server 3
    assert len(bad) == 40 and all("qwen3-4b" not in p.cell for p in bad)
    message = refusal(plans)
    react = EIGHT_B_GRPO.replace("grpo", "react")
    assert f"cell {react}: needs 326.7 GiB of host memory, train.mem_mb requests 273.4; " \
           "largest term: policy weights 122.1 GiB" in message


def test_evaluation_jobs_count_the_servers_index_on_their_gpu_and_in_host_memory():
    # eval.engine_memory_share 0.9 (vLLM's usual share) beside the fp16 index on the job's
    # one GPU: 86.4 + 1 (CUDA context) + 30.06 (64.56e9 B / 2) + 2 (faiss) = 119.5 > 96 GiB
    evals = plan_evals(load_study(PAPER, ["eval.engine_memory_share=0.9"]))
    assert [e.fits for e in evals] == [False] * 3
    gpu = {t.name: t.bytes for t in evals[0].gpu}
    assert gpu["retrieval server: index shard"] == INDEX / 2
    assert abs(evals[0].gpu_need - (0.9 * 96 * GIB + GIB + INDEX / 2 + 2 * GIB)) < 1
    message = refusal([], evals)
    assert "evaluation jobs of backbone qwen3-8b: need 119.5 GiB per GPU" in message
    assert "lower eval.engine_memory_share" in message
    # host: 2 processes x 3 GiB + the 8B's bf16 weights + the index + the server's 3 GiB
    # = 84.4 GiB, more than 64000 MB (62.5 GiB)
    evals = plan_evals(load_study(PAPER, ["eval.mem_mb=64000"]))
    e8 = next(e for e in evals if e.backbone == "qwen3-8b")
    assert e8.host_need == 6 * GIB + 2 * 8_190_735_360 + INDEX + 3 * GIB and not e8.fits
    assert "evaluation jobs of backbone qwen3-8b: needs 84.4 GiB of host memory, " \
           "eval.mem_mb requests 62.5" in refusal([], evals)


def test_an_external_server_costs_the_jobs_nothing_and_a_file_on_disk_beats_the_estimate(
        tmp_path):
    plan = {p.cell: p for p in _paper_plans("retrieval.http.serve=external",
                                            sets=["main"])}[EIGHT_B_GRPO]
    names = {t.name for ts in plan.phases.values() for t in ts} | {t.name for t in plan.host}
    assert not any(n.startswith("retrieval server") for n in names)
    index = tmp_path / "e5_Flat.index"
    with open(index, "wb") as f:  # sparse: its size without the disk
        f.truncate(16 * GIB)
    plan = {p.cell: p for p in _paper_plans(f"retrieval.index.prebuilt={index}",
                                            sets=["main"])}[EIGHT_B_GRPO]
    rollout = {t.name: t.bytes for t in plan.phases["rollout"]}
    assert rollout["retrieval server: index shard"] == 16 * GIB / 2 / 8
    assert {t.name: t.bytes for t in plan.host}["retrieval server: index"] == 16 * GIB


def test_the_step_time_is_the_timing_model_on_the_configured_gpu():
    """A cell's seconds per step: a2tgpo/timing.py's rollouts of the step (the cell's schedule,
    engine share) + its validation's share + the passes (KL: a reference pass; IG: the fused
    pass) + the rest, on train.gpu_model; GPU-hours = steps x that x GPUs."""
    from a2tgpo import timing
    from a2tgpo.study import resolve_cell, study_cells

    cell = "backbone~qwen3-4b/data~multi_hop/method~grpo/beta~0/seed~1"
    for gpu, overrides in (("h20", ()), ("h100", ("train.gpu_model=h100",)),
                           ("h20", ("train.rollout.schedule=trajectory",))):
        study = load_study(PAPER, ["grid.sets.main.backbones=[qwen3-4b]", *overrides])
        plan = {p.cell: p for p in plan_study(study, ["main"])}[cell]
        cfg = next(cfg for c in study_cells(study)["main"]
                   if (cfg := resolve_cell(study, c.path)).cell == cell)
        spec = timing.GPUS[gpu]
        model = timing.ModelCost.of(cfg.backbone.architecture, 4_022_468_096)
        shape = timing.SHAPES["grpo"]
        step = timing.simulate_step(spec, model, shape, prompts=64, n=16, ranks=8,
                                    agent_cfg=cfg.rollout, schedule=cfg.rollout.schedule,
                                    memory_share=0.58)
        val = timing.simulate_step(spec, model, shape, prompts=500, n=1, ranks=8,
                                   agent_cfg=cfg.rollout, schedule=cfg.rollout.schedule,
                                   memory_share=0.58)
        passes = timing.training_seconds(model, step.lengths, step.prefixes, gpu=spec, gpus=8,
                                         mfu=0.4, reference=True, ig=None)
        want = step.seconds + val.seconds / 20 + sum(passes.values()) + timing.OTHER_S
        assert plan.step_s == pytest.approx(want, rel=1e-9), gpu
        assert plan.gpu_hours == pytest.approx(240 * want * 8 / 3600), gpu
        assert plan.gpu == spec


def test_the_step_time_simulations_are_kept_on_disk_under_a_digest_of_inputs_and_code(
        tmp_path, monkeypatch):
    """Every Snakemake start plans the study; its simulations are read back from the study's
    cache folder, bit for bit, unless an input, the package's code or the file itself changed."""
    from a2tgpo import plan as plan_mod
    from a2tgpo import timing

    calls = []
    simulate = timing.simulate_step
    monkeypatch.setattr(timing, "simulate_step",
                        lambda *a, **k: calls.append(k["prompts"]) or simulate(*a, **k))

    def plans(*overrides):
        plan_mod._rollouts.cache_clear()  # a new process: nothing in memory
        study = load_study(PAPER, ["grid.sets.main.backbones=[qwen3-4b]",
                                   "grid.sets.main.methods=[grpo]",
                                   f"cache_dir={tmp_path}", *overrides])
        return {p.cell: p.step_s for p in plan_study(study, ["main"])}

    first = plans()
    files = sorted((tmp_path / "a2tgpo" / "step_time").glob("*.json"))
    # one rollout and one validation shape: 64 prompts x 16 and 500 questions x 1 (paper.yaml)
    assert sorted(calls) == [64, 500] and len(files) == 2
    calls.clear()
    assert plans() == first and calls == []  # read back: the same floats, no simulation
    files[0].write_text("{")  # damaged (a write cut short elsewhere): simulated again
    assert plans() == first and len(calls) == 1
    assert json.loads(files[0].read_text())  # and rewritten whole
    calls.clear()
    plans("train.rollout.schedule=waves")  # another input (paper.yaml's is trajectory): two new
    assert sorted(calls) == [64, 500]
    calls.clear()
    monkeypatch.setattr(plan_mod, "_code_digest", lambda: "other code")
    assert plans() == first and sorted(calls) == [64, 500]


def test_aepo_cells_time_their_rollouts_in_waves_as_they_run_them(tmp_path, monkeypatch):
    # paper.yaml rolls out per trajectory, but AEPO branches after each wave under either
    # schedule (trees.rollout_aepo): its step's rollouts are timed in waves, its greedy
    # validation (chains) per trajectory
    from a2tgpo import plan as plan_mod
    from a2tgpo import timing

    calls = []
    simulate = timing.simulate_step
    monkeypatch.setattr(timing, "simulate_step", lambda *a, **k: calls.append(
        (k["prompts"], k["n"], k["schedule"])) or simulate(*a, **k))
    plan_mod._rollouts.cache_clear()
    study = load_study(PAPER, ["grid.sets.main.backbones=[qwen3-4b]",
                               "grid.sets.main.methods=[aepo, grpo]", f"cache_dir={tmp_path}"])
    plan_study(study, ["main"])
    assert sorted(calls) == [(64, 16, "trajectory"), (64, 16, "waves"), (500, 1, "trajectory")]


def test_an_explicit_gpu_spec_and_an_unknown_key():
    only_4b = "grid.sets.main.backbones=[qwen3-4b]"
    base = {p.cell: p.step_s for p in _paper_plans(only_4b, sets=["main"])}
    faster = {p.cell: p.step_s for p in _paper_plans(
        only_4b, "train.gpu_spec={bf16_tflops: 989}", sets=["main"])}
    # an H20 with an H100's compute: every GPU cell's passes (and compute-bound steps) faster
    assert all(faster[c] < base[c] for c in base if base[c] is not None)
    with pytest.raises(ConfigError, match="gpu_spec.hbm: one of hbm_tb_s, bf16_tflops, "
                                          "step_overhead_ms"):
        load_study(PAPER, ["train.gpu_spec={hbm: 3}"])
