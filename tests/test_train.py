"""The GRPO runner end to end on CPU: files, determinism, resume after SIGTERM/SIGKILL, collapse, the
bitwise mechanism through training, IS remedies, and bad input."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, TrainerCallback

from roundalign.cli import claim_free_master_port, main
from roundalign.engine import Engine
from roundalign.models.load import load_model, load_tokenizer
from roundalign.models.pretrain import pretrain_tiny
from roundalign.models.tiny import make_tiny
from roundalign.tasks.arith import arith_reward
from roundalign.training.config import ConfigError, build_config
from roundalign.training.heldout import HELDOUT_SEED, evaluate_heldout, heldout_problems
from roundalign.training.train import TIMING_KEYS, _dataset, build_grpo_args, run_train
from roundalign.training.trl_bridge import EngineSync, RoundalignGRPOTrainer

torch.set_num_threads(1)
QUIET = dict(log=lambda *_: None)
FAST = {"prompts_per_step": 8, "num_generations": 4, "per_device_batch_size": 32, "max_completion_length": 6,
        "learning_rate": 2e-3, "checkpoint_every": 2, "num_train_prompts": 256}


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    # A warm-started tiny model: it answers some problems, so rewards vary within groups, advantages are
    # non-zero and the weights really move (a random model would leave every run trivially identical).
    root = tmp_path_factory.mktemp("models")
    base = make_tiny("qwen2", root / "tiny", hidden=64, layers=2, seed=0)
    return str(pretrain_tiny(base, root / "tiny-sft", steps=400, **QUIET))


def cfg(model, **kw):
    return build_config(overrides={"model": model, **FAST, **kw})


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def deterministic(rows):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def test_run_writes_metrics_run_json_and_checkpoints_then_reports_done(sft_model, tmp_path):
    out = tmp_path / "run"
    res = run_train(cfg(sft_model, steps=4), out, **QUIET)
    assert (res.status, res.last_step, res.exit_code) == ("done", 4, 0)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in ("reward/mean", "reward/std", "reward/arith_reward/mean", "mismatch/token/k3", "mismatch/seq/k3",
                "mismatch/token/tokens_exact_frac", "mismatch/token/is_ratio_max", "mismatch/token/ess_frac",
                "mismatch/token/k3_over_entropy", "policy/entropy", "optim/grad_norm", "optim/lr",
                "completion/length_mean", "step_time_s", "tokens_per_s"):
        assert key in rows[0], key
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "done" and run["last_step"] == 4 and run["collapse"] is None
    assert run["config"]["variant"] == "full" and run["versions"]["trl"] == "1.16.0"
    assert sorted(p.name for p in (out / "checkpoints").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    state = json.loads((out / "checkpoints/checkpoint-4/roundalign_state.json").read_text())
    assert state["engine_syncs"] == 4  # the engine was re-synced after every optimizer step
    before = {p: p.read_bytes() for p in (out / "metrics.jsonl", out / "run.json")}
    again = run_train(cfg(sft_model, steps=4), out, **QUIET)
    assert again.status == "done" and {p: p.read_bytes() for p in before} == before


def test_same_seed_twice_gives_identical_metrics(sft_model, tmp_path):
    a = run_train(cfg(sft_model, steps=4, seed=1), tmp_path / "a", **QUIET)
    b = run_train(cfg(sft_model, steps=4, seed=1), tmp_path / "b", **QUIET)
    c = run_train(cfg(sft_model, steps=4, seed=2), tmp_path / "c", **QUIET)
    assert a.status == b.status == c.status == "done"
    assert deterministic(metrics(tmp_path / "a")) == deterministic(metrics(tmp_path / "b"))
    assert deterministic(metrics(tmp_path / "a")) != deterministic(metrics(tmp_path / "c"))
    # the policy really trains: non-zero gradient on some step
    assert any(r["optim/grad_norm"] > 0 for r in metrics(tmp_path / "a"))


class KillAt(TrainerCallback):
    """Sends this process SIGTERM while step ``step`` runs, as a scheduler's preemption would."""

    def __init__(self, step):
        self.step = step

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step == self.step - 1:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_checkpoints_and_rerun_resumes_to_the_uninterrupted_result(sft_model, tmp_path):
    full = run_train(cfg(sft_model, steps=6), tmp_path / "full", **QUIET)
    first = run_train(cfg(sft_model, steps=6), tmp_path / "cut", callbacks=[KillAt(3)], **QUIET)
    assert (first.status, first.last_step, first.exit_code) == ("preempted", 3, 143)
    assert (tmp_path / "cut/checkpoints/checkpoint-3").is_dir()  # saved on SIGTERM, between periodic saves
    cut = json.loads((tmp_path / "cut/run.json").read_text())
    assert (cut["status"], cut["preempted_by"]) == ("preempted", "signal")
    second = run_train(cfg(sft_model, steps=6), tmp_path / "cut", **QUIET)
    assert (second.status, second.last_step) == ("done", 6) and full.status == "done"
    assert deterministic(metrics(tmp_path / "cut")) == deterministic(metrics(tmp_path / "full"))
    assert json.loads((tmp_path / "cut/run.json").read_text())["resumed_from"] == [3]


def test_sigkill_mid_run_resumes_from_the_last_periodic_checkpoint(sft_model, tmp_path):
    # A real process killed without warning: metrics lines written after the newest checkpoint are
    # dropped on resume and recomputed, so the final file still equals an uninterrupted run's.
    args = ["--model", sft_model, "--variant", "full", "--steps", "16", *sum((["--set", f"{k}={v}"] for k, v in
                                                                               {**FAST, "checkpoint_every": 4}.items()),
                                                                              [])]
    ref = tmp_path / "ref"
    assert main(["train", *args, "--out", str(ref)]) == 0
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "roundalign", "train", *args, "--out", str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        ckpts = list((out / "checkpoints").glob("checkpoint-*/trainer_state.json"))
        lines = (out / "metrics.jsonl").read_text().count("\n") if (out / "metrics.jsonl").exists() else 0
        if ckpts and lines % 4 != 0:  # past a checkpoint, mid-interval
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait(timeout=60)
    if proc.returncode == 0:
        pytest.skip("the run finished before it could be killed (machine too fast for this timing)")
    assert proc.returncode == -signal.SIGKILL
    assert json.loads((out / "run.json").read_text())["status"] == "running"
    assert main(["train", *args, "--out", str(out)]) == 0
    assert deterministic(metrics(out)) == deterministic(metrics(ref))


class PoisonAt(TrainerCallback):
    """Writes NaN into one weight at the end of a step: the next step's logits and loss are NaN."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, model=None, **kw):
        if state.global_step == self.step:
            with torch.no_grad():
                model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")


@pytest.mark.parametrize("exit_code", [0, 3])
def test_nan_stops_the_run_as_collapsed(sft_model, tmp_path, exit_code):
    res = run_train(cfg(sft_model, steps=8, collapse_exit_code=exit_code), tmp_path / "r", callbacks=[PoisonAt(2)],
                    **QUIET)
    run = json.loads((tmp_path / "r/run.json").read_text())
    assert res.status == run["status"] == "collapsed" and res.exit_code == exit_code
    assert run["collapse"]["step"] == 3 and ("NaN" in run["collapse"]["reason"] or "nan" in run["collapse"]["reason"])
    assert res.last_step <= 3
    again = run_train(cfg(sft_model, steps=8, collapse_exit_code=exit_code), tmp_path / "r", **QUIET)
    assert again.status == "collapsed"  # a finished (collapsed) run is left alone


def test_full_stays_on_policy_through_training_while_baseline_does_not(sft_model, tmp_path):
    # Logits of `full` equal the engine's bitwise; the only remaining difference is the last fp32 op:
    # vLLM's sampler takes log_softmax, TRL's fused LM head an online logsumexp over vocab tiles, so the
    # two logprobs differ by fp32 rounding (~1e-7 nats). `baseline` differs by bf16 roundings (~1e-2).
    full = run_train(cfg(sft_model, steps=5, variant="full"), tmp_path / "full", **QUIET)
    base = run_train(cfg(sft_model, steps=5, variant="baseline"), tmp_path / "base", **QUIET)
    assert full.status == base.status == "done"
    for f, b in zip(metrics(tmp_path / "full"), metrics(tmp_path / "base")):
        assert b["mismatch/token/k3"] > 1e-7
        assert f["mismatch/token/k3"] < b["mismatch/token/k3"] / 1000
        assert f["mismatch/token/logp_abs_diff_max"] < 1e-5 < b["mismatch/token/logp_abs_diff_max"]
        assert b["mismatch/token/tokens_exact_frac"] == 0.0


def test_scoring_as_the_engine_makes_every_token_bitwise_through_training(sft_model, tmp_path):
    # scoring=engine: the trainer's logprob is the sampler's formula (fp32 logits / T, log-softmax): every token of
    # every step equals the engine's bit for bit, after each weight sync. TRL's head gives the same loss to fp32
    # rounding: step 1 (same weights, same samples) has the same gradient norm to 1e-4.
    trl = run_train(cfg(sft_model, steps=4, variant="full"), tmp_path / "trl", **QUIET)
    eng = run_train(cfg(sft_model, steps=4, variant="full", scoring="engine"), tmp_path / "eng", **QUIET)
    assert trl.status == eng.status == "done"
    rows, trl_rows = metrics(tmp_path / "eng"), metrics(tmp_path / "trl")
    assert any(r["optim/grad_norm"] > 0 for r in rows[:-1])  # the weights move, so the syncs matter
    for r in rows:
        assert (r["mismatch/token/logp_abs_diff_max"], r["mismatch/token/tokens_exact_frac"],
                r["mismatch/token/is_ratio_min"], r["mismatch/token/is_ratio_max"]) == (0.0, 1.0, 1.0, 1.0), r
    assert all(r["mismatch/token/tokens_exact_frac"] < 1.0 for r in trl_rows)
    assert rows[0]["optim/grad_norm"] == pytest.approx(trl_rows[0]["optim/grad_norm"], rel=1e-4)


def test_under_a_dose_full_stays_at_the_floor_through_training_and_heldout_is_recorded(sft_model, tmp_path):
    # a 3-bit dose at the regions of the eager engine: `full` rounds where and as the engine does (k3 at the fp32
    # log-softmax floor on every step), `baseline` does not, and far above its undosed mismatch
    kw = dict(steps=3, engine="vllm-eager", engine_dose_bits=3, heldout_prompts=8, heldout_samples=2)
    runs = {v: run_train(cfg(sft_model, variant=v, **kw), tmp_path / v, **QUIET) for v in ("full", "baseline")}
    assert all(r.status == "done" for r in runs.values())
    plain = run_train(cfg(sft_model, steps=3, engine="vllm-eager", variant="baseline"), tmp_path / "plain", **QUIET)
    assert plain.status == "done"
    full, base, undosed = (metrics(tmp_path / n) for n in ("full", "baseline", "plain"))
    for f, b, u in zip(full, base, undosed):
        assert f["mismatch/token/k3"] <= 1e-10 < b["mismatch/token/k3"]
        assert f["mismatch/token/logp_abs_diff_max"] < 1e-5
    assert sum(b["mismatch/token/k3"] for b in base) > 5 * sum(u["mismatch/token/k3"] for u in undosed)
    rec = {v: json.loads((tmp_path / v / "run.json").read_text()) for v in ("full", "baseline")}
    # the same warm start, engine and draws: the same initial held-out reward for every variant
    assert rec["full"]["heldout_initial"] == rec["baseline"]["heldout_initial"]
    for r in rec.values():
        h0, h1 = r["heldout_initial"], r["heldout_final"]
        assert h0["prompts"] == 8 and h0["samples_per_prompt"] == 2
        assert 0 <= h0["ci_low"] <= h0["reward"] <= h0["ci_high"] <= 1 and 0 <= h1["reward"] <= 1
    assert json.loads((tmp_path / "plain" / "run.json").read_text())["heldout_initial"] is None


def test_heldout_evaluation_equals_a_hand_count(sft_model):
    # the record's reward is the mean over problems of each problem's mean reward over its engine samples, scored
    # by the task's reward; recomputed here from the engine's own samples, decoded and graded by hand
    c = cfg(sft_model, engine="vllm-eager", heldout_prompts=6, heldout_samples=3)
    tok = load_tokenizer(sft_model)
    eng = Engine(load_model(sft_model), engine="vllm-eager")
    got = evaluate_heldout(eng, tok, c, arith_reward)
    probs = heldout_problems(c)
    train = {p["prompt"] for p in _dataset(c, tok)[0]}
    assert len({p["prompt"] for p in probs}) == 6 and not train & {p["prompt"] for p in probs}
    ids = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in probs for _ in range(3)]
    samples = eng.generate(ids, max_new_tokens=c.max_completion_length, seed=HELDOUT_SEED,
                           eos_token_id=tok.eos_token_id)
    per = []
    for i, p in enumerate(probs):
        hits = 0
        for s in samples[3 * i:3 * i + 3]:
            t = tok.decode(s.completion_ids, skip_special_tokens=True).lstrip()
            j = 1 if t.startswith("-") else 0
            while j < len(t) and t[j].isdigit():
                j += 1
            hits += t[:j] == p["answer"]  # the leading integer is the answer
        per.append(hits / 3)
    assert got["reward"] == pytest.approx(sum(per) / len(per), abs=1e-12)
    assert got["ci_low"] <= got["reward"] <= got["ci_high"]


@pytest.mark.parametrize("variant,key", [("tis", "is/clipped_frac"), ("mis", "is/masked_frac")])
def test_importance_sampling_remedies_use_trls_correction(sft_model, tmp_path, variant, key):
    res = run_train(cfg(sft_model, steps=2, variant=variant), tmp_path / variant, **QUIET)
    rows = metrics(tmp_path / variant)
    assert res.status == "done"
    for r in rows:
        assert key in r and 0.0 <= r[key] <= 1.0
        assert r["is/ratio_min"] <= 1.0 <= r["is/ratio_max"] * 1.0001  # TRL's own ratio statistics
        assert "mismatch/token/k3" in r


def test_fp16_variant_runs_both_sides_in_fp16(sft_model, tmp_path):
    res = run_train(cfg(sft_model, steps=2, variant="fp16"), tmp_path / "fp16", **QUIET)
    run = json.loads((tmp_path / "fp16/run.json").read_text())
    assert res.status == "done" and run["config"]["dtype"] == "fp16"
    # fp16 keeps 3 more mantissa bits than bf16: both sides still round differently (k3 > 0, baseline
    # numerics against the engine's), but the mismatch is smaller than bf16 baseline's on the same seed
    base = run_train(cfg(sft_model, steps=2, variant="baseline"), tmp_path / "bf16", **QUIET)
    assert base.status == "done"
    for f, b in zip(metrics(tmp_path / "fp16"), metrics(tmp_path / "bf16")):
        assert 0 < f["mismatch/token/k3"] < b["mismatch/token/k3"]


def test_math_task_runs_on_a_local_fixture(sft_model, tmp_path):
    fixture = Path(__file__).parent / "fixtures/math_small.jsonl"
    res = run_train(cfg(sft_model, steps=1, task="math", math_dataset=str(fixture), prompts_per_step=2,
                        per_device_batch_size=8, max_completion_length=4), tmp_path / "m", **QUIET)
    assert res.status == "done" and "reward/math_reward/mean" in metrics(tmp_path / "m")[0]


def test_bad_input_is_rejected_before_loading(sft_model, tmp_path, capsys):
    out = tmp_path / "never"

    def err(*args):
        assert main(["train", "--out", str(out), *args]) == 2
        return capsys.readouterr().err

    assert "variant='ropee'" in err("--model", sft_model, "--variant", "ropee")
    assert "baseline, rope, swiglu, norm, full, tis, mis, fp16" in err("--model", sft_model, "--variant", "x")
    assert "task='poetry'" in err("--model", sft_model, "--task", "poetry")
    assert "backend='tpu'" in err("--model", sft_model, "--backend", "tpu")
    assert "nope" in err("--model", str(tmp_path / "nope"))
    assert "inconsistent batch sizes" in err("--model", sft_model, "--set", "prompts_per_step=3",
                                             "--set", "per_device_batch_size=8")
    assert "unknown config key 'lr'" in err("--model", sft_model, "--set", "lr=1")
    assert "did you mean 'learning_rate'?" in err("--model", sft_model, "--set", "learning_rat=1")
    if subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True).returncode != 0:
        assert "pip install -e '.[harness,gpu]'" in err("--model", sft_model, "--backend", "vllm")
        # the real CPU engine lives in the second environment: the message says which and how to build it
        assert "make vllm-env" in err("--model", sft_model, "--backend", "vllm", "--engine", "vllm-cpu-compiled")
    assert not out.exists()
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("steps: [1, 2\n")
    assert "not valid YAML" in err("--model", sft_model, "--config", str(bad_yaml))


def test_rerun_with_another_config_refuses_to_mix(sft_model, tmp_path):
    run_train(cfg(sft_model, steps=1), tmp_path / "r", **QUIET)
    with pytest.raises(ConfigError, match=r"another config.*learning_rate"):
        run_train(cfg(sft_model, steps=1, learning_rate=1e-2), tmp_path / "r", **QUIET)


def test_a_finished_run_is_not_taken_as_done_for_a_rebuilt_model_at_the_same_path(sft_model, tmp_path):
    # guards against a sweep that re-warm-starts a policy at the same path silently re-exporting the earlier
    # model's finished run
    model = tmp_path / "policy"
    shutil.copytree(sft_model, model)
    done = run_train(cfg(str(model), steps=1), tmp_path / "r", **QUIET)
    assert done.status == "done" and json.loads((tmp_path / "r/run.json").read_text())["model_fingerprint"]
    assert run_train(cfg(str(model), steps=1), tmp_path / "r", **QUIET).status == "done"  # unchanged: nothing to do
    weights = load_file(model / "model.safetensors")
    name = sorted(weights)[-1]
    weights[name] = weights[name] * 1.01
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"the model at .* changed since this run started"):
        run_train(cfg(str(model), steps=1), tmp_path / "r", **QUIET)


def test_grpo_config_carries_our_settings(tmp_path):
    base = {"model": "m", "report_to": "tensorboard,wandb", "steps": 7, **FAST}
    args = build_grpo_args(build_config(overrides=base), tmp_path)
    assert args.report_to == ["tensorboard", "wandb"] and args.max_steps == 7
    assert (args.top_k, args.top_p, args.bf16, args.logging_steps) == (0, 1.0, False, 1)
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 32
    assert args.vllm_importance_sampling_correction is False  # alignment variants: raw effect, no IS
    tis = build_grpo_args(build_config(overrides={**base, "variant": "tis", "is_cap": 2.0}), tmp_path)
    assert (tis.vllm_importance_sampling_correction, tis.vllm_importance_sampling_mode,
            tis.vllm_importance_sampling_clip_max) == (True, "token_truncate", 2.0)
    mis = build_grpo_args(build_config(overrides={**base, "variant": "mis"}), tmp_path)
    assert (mis.vllm_importance_sampling_mode, mis.vllm_importance_sampling_clip_min) == ("sequence_mask", 1 / 3)
    assert build_grpo_args(build_config(overrides={"model": "m", **FAST}), tmp_path).report_to == []


def test_cli_exports_finished_runs_only(sft_model, tmp_path):
    args = ["train", "--model", sft_model, "--steps", "2", *sum((["--set", f"{k}={v}"] for k, v in FAST.items()), [])]
    assert main([*args, "--out", str(tmp_path / "run"), "--export", str(tmp_path / "exp")]) == 0
    assert (tmp_path / "exp/metrics.jsonl").read_text() == (tmp_path / "run/metrics.jsonl").read_text()
    assert json.loads((tmp_path / "exp/run.json").read_text())["status"] == "done"


@pytest.mark.parametrize("scoring", ["trl", "engine"])
def test_reference_model_rounds_like_the_policy(sft_model, tmp_path, scoring):
    # beta > 0: TRL builds a reference model. Aligned like the policy (and scored like it), their KL is exactly 0
    # before the first update and positive after it (unaligned, step 1 showed the alignment itself: ~4e-4 nats).
    res = run_train(cfg(sft_model, steps=2, beta=0.04, scoring=scoring), tmp_path / "kl", **QUIET)
    kl = [r["policy/kl"] for r in metrics(tmp_path / "kl")]
    assert res.status == "done" and kl[0] == 0.0 and kl[1] > 0.0


class MasterWatch(TrainerCallback):
    """Records, around every optimizer step, the fp32 masters, which of their entries got a gradient, and
    whether the model holds exactly the masters rounded to its dtype."""

    def __init__(self):
        self.initial, self.received, self.model_is_rounded_master, self.after_step = None, None, [], []

    def on_train_begin(self, args, state, control, optimizer=None, model=None, **kw):
        opt = optimizer.optimizer
        self.opt = opt
        by_id = {id(p): n for n, p in model.named_parameters()}
        self.names = [by_id[id(p)] for p, _ in opt.pairs]
        self.initial = [m.detach().clone() for _, m in opt.pairs]
        self.received = [torch.zeros_like(m) for m in self.initial]  # largest |gradient| seen per entry
        self.after_step.append([m.detach().clone() for _, m in opt.pairs])  # what the engine gets at step 1

    def on_pre_optimizer_step(self, args, state, control, **kw):
        for r, (_, m) in zip(self.received, self.opt.pairs):
            if m.grad is not None:
                torch.maximum(r, m.grad.abs(), out=r)

    def on_step_end(self, args, state, control, **kw):
        self.model_is_rounded_master.append(all(torch.equal(p, m.to(p.dtype)) for p, m in self.opt.pairs))
        self.after_step.append([m.detach().clone() for _, m in self.opt.pairs])


def test_fp32_master_weights_train_at_a_paper_learning_rate(sft_model, tmp_path, monkeypatch):
    # bf16 compute, fp32 master: at lr 1e-6 stepping bf16 weights loses almost every update (an update
    # below half a bf16 ulp rounds away); the fp32 masters keep them, and the model/engine hold the masters
    # rounded to bf16 after every step.
    synced = []
    original = EngineSync.sync_weights

    def recording_sync(self):
        original(self)
        layer = self.engine.model.layers[0]
        synced.append((self.engine.model.embed.clone(), layer.w_gate.clone(), layer.ln1.clone()))

    monkeypatch.setattr(EngineSync, "sync_weights", recording_sync)
    watch = MasterWatch()
    res = run_train(cfg(sft_model, steps=10, learning_rate=1e-6), tmp_path / "r", callbacks=[watch], **QUIET)
    assert res.status == "done" and len(synced) == 10
    assert all(watch.model_is_rounded_master)
    names = watch.names
    assert all(p.dtype == torch.bfloat16 for p, _ in watch.opt.pairs)
    assert all(m.dtype == torch.float32 for _, m in watch.opt.pairs)
    # the engine's weights at the start of step k+1 are the masters after step k, rounded to bf16
    idx = {n: i for i, n in enumerate(names)}
    for k, (embed, gate, ln1) in enumerate(synced):
        masters = watch.after_step[k]
        assert torch.equal(embed, masters[idx["model.embed_tokens.weight"]].bfloat16())
        assert torch.equal(gate, masters[idx["model.layers.0.mlp.gate_proj.weight"]].bfloat16())
        assert torch.equal(ln1, masters[idx["model.layers.0.input_layernorm.weight"]].bfloat16())
    # an entry "received a gradient" when its gradient exceeded Adam's epsilon (1e-8) at some step: below
    # it Adam's update is a fraction lr * |g| / eps of lr, under one fp32 ulp whatever the precision
    got = sum(int((r > 1e-8).sum()) for r in watch.received)
    changed = sum(int(((m != m0) & (r > 1e-8)).sum())
                  for m, m0, r in zip(watch.after_step[-1], watch.initial, watch.received))
    any_grad = sum(int((r > 0).sum()) for r in watch.received)
    bf16_changed = sum(int(((m.bfloat16() != m0.bfloat16()) & (r > 1e-8)).sum())
                       for m, m0, r in zip(watch.after_step[-1], watch.initial, watch.received))
    print(f"master entries changed: {changed}/{got} (|g|>1e-8), any grad {any_grad}; bf16-visible {bf16_changed}")
    assert got > 0 and changed / got >= 0.99, (changed, got)
    # norm weights near 1.0 move too (in bf16 they never would at this rate)
    i = idx["model.layers.0.input_layernorm.weight"]
    assert bool((watch.after_step[-1][i] != watch.initial[i]).any())
    # the final policy: HF format, fp32, equal to the masters
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "r/final")
    sd = final.state_dict()
    assert final.dtype == torch.float32
    for n, m in zip(names, watch.after_step[-1]):
        assert torch.equal(sd[n], m), n



@pytest.mark.parametrize("position_fix", [True, False])
def test_variable_length_prompts_stay_on_policy_with_positions_from_the_mask(sft_model, tmp_path, monkeypatch,
                                                                             position_fix):
    # TRL left-pads prompts of different token lengths; the engine (like vLLM) runs each from position 0.
    # With positions from the attention mask `full` stays bitwise-logit-equal to the engine; with transformers'
    # default arange positions the padded sequences sit at shifted RoPE positions and `full` drifts off policy.
    monkeypatch.setattr(RoundalignGRPOTrainer, "_position_fix", position_fix)
    kw = dict(steps=3, prompt_style="variable")
    full = run_train(cfg(sft_model, variant="full", **kw), tmp_path / "full", **QUIET)
    base = run_train(cfg(sft_model, variant="baseline", **kw), tmp_path / "base", **QUIET)
    assert full.status == base.status == "done"
    ratios = [b["mismatch/token/k3"] / max(f["mismatch/token/k3"], 1e-300)
              for f, b in zip(metrics(tmp_path / "full"), metrics(tmp_path / "base"))]
    print(f"position_fix={position_fix}: baseline/full k3 ratio per step {ratios}")
    if position_fix:
        assert all(r > 1000 for r in ratios), ratios
    else:
        assert not all(r > 1000 for r in ratios), ratios


# Top-level and zero_optimization keys of DeepSpeed 0.18.9 (deepspeed/runtime/constants.py, zero/config.py)
DS_TOP_KEYS = {"bf16", "fp16", "communication_data_type", "zero_optimization", "zero_allow_untested_optimizer",
               "gradient_accumulation_steps", "gradient_clipping", "train_micro_batch_size_per_gpu",
               "train_batch_size"}
DS_ZERO_KEYS = {"stage", "overlap_comm", "contiguous_gradients", "reduce_bucket_size", "stage3_prefetch_bucket_size",
                "stage3_param_persistence_threshold", "stage3_gather_16bit_weights_on_model_save"}


@pytest.mark.parametrize("variant,bf16,fp16", [("full", True, False), ("fp16", False, True)])
def test_zero3_computes_in_16_bit_with_fp32_masters(tmp_path, variant, bf16, fp16):
    # DeepSpeed is not installed on CPU: check the config against its key names and that our GRPO arguments
    # fill its "auto" precision keys (16-bit model, so ZeRO-3 keeps fp32 master partitions)
    ds = json.loads((Path(__file__).parents[1] / "configs/accelerate/zero3.json").read_text())
    assert set(ds) <= DS_TOP_KEYS and set(ds["zero_optimization"]) <= DS_ZERO_KEYS
    assert ds["zero_optimization"]["stage"] == 3 and ds["communication_data_type"] == "fp32"
    assert ds["bf16"]["enabled"] == ds["fp16"]["enabled"] == "auto" and ds["fp16"]["loss_scale"] == 0
    args = build_grpo_args(build_config(overrides={"model": "m", "variant": variant, **FAST}), tmp_path,
                           deepspeed=True)
    assert (args.bf16, args.fp16) == (bf16, fp16)
    single = build_grpo_args(build_config(overrides={"model": "m", "variant": variant, **FAST}), tmp_path,
                             deepspeed=False)
    assert (single.bf16, single.fp16) == (False, False)  # one process: no autocast, roundalign.training.optim's masters


def test_a_process_started_alone_takes_a_free_master_port(monkeypatch):
    # Two vLLM-backed runs side by side both bound accelerate's default 29500 (EADDRINUSE); a launcher's port stands.
    for key in ("WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    claim_free_master_port()
    first = int(os.environ["MASTER_PORT"])
    assert 0 < first < 65536 and first != 29500
    monkeypatch.setenv("MASTER_PORT", "29511")
    claim_free_master_port()
    assert os.environ["MASTER_PORT"] == "29511"
    monkeypatch.delenv("MASTER_PORT")
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun: the launcher sets the rendezvous
    claim_free_master_port()
    assert "MASTER_PORT" not in os.environ
