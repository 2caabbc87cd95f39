"""What a new user's mistakes print: one or two lines naming the culprit and the valid choices, before any long
work, from the command line as they would type it (issue: "A house a newcomer can read", rough edges)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from snakemake.utils import validate

from roundalign.models.load import ModelConfigError, check_model_config, load_model
from roundalign.models.tiny import make_tiny
from roundalign.training.config import ConfigError
from roundalign.training.sweep import Sweep, explain_schema_errors

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny("qwen3", tmp_path_factory.mktemp("m") / "tiny", hidden=32, layers=1)


def _cli(*args, timeout=120):
    p = subprocess.run([sys.executable, "-m", "roundalign", *args], capture_output=True, text=True, timeout=timeout,
                       cwd=ROOT)
    return p.returncode, (p.stdout + p.stderr).strip().splitlines()


def _copy(tiny, tmp_path, **changes):
    d = tmp_path / "m"
    shutil.copytree(tiny, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_garbage_config_json_is_one_line_naming_the_file(tiny, tmp_path):
    d = _copy(tiny, tmp_path)
    (d / "config.json").write_text("{not json")
    rc, lines = _cli("train", "--model", str(d), "--out", str(tmp_path / "out"), "--steps", "1")
    assert rc != 0 and len(lines) == 1, lines
    assert f"{d / 'config.json'} is not valid JSON" in lines[0]


def test_a_non_qwen_model_is_refused_naming_the_supported_architectures(tiny, tmp_path):
    d = _copy(tiny, tmp_path, model_type="mistral")
    with pytest.raises(ModelConfigError, match="model_type 'mistral' is not supported; roundalign aligns "
                                               "qwen2/qwen3/llama"):
        check_model_config(d / "config.json")
    rc, lines = _cli("probe", "--model", str(d), "--out", str(tmp_path / "p.csv"))
    assert rc != 0 and len(lines) <= 2 and "qwen2/qwen3/llama" in lines[-1], lines


def test_weights_that_do_not_fit_the_config_name_the_tensor(tiny, tmp_path):
    d = _copy(tiny, tmp_path, intermediate_size=48)
    with pytest.raises(ModelConfigError, match=r"tensor model\.layers\.0\.mlp\.\w+_proj\.weight has shape .* implies"):
        load_model(str(d))
    d2 = _copy(tiny, tmp_path / "b", num_key_value_heads=3)
    with pytest.raises(ModelConfigError, match="num_attention_heads=4 is not a multiple of num_key_value_heads=3"):
        check_model_config(d2 / "config.json")
    d3 = _copy(tiny, tmp_path / "c", num_key_value_heads=None, head_dim=None, hidden_size=30)  # no KV-head count
    with pytest.raises(ModelConfigError, match="hidden_size=30 is not divisible by num_attention_heads=4"):
        check_model_config(d3 / "config.json")


def test_pretrain_tiny_names_the_bad_value(tiny, tmp_path):
    rc, lines = _cli("pretrain-tiny", "--model", str(tiny), "--out", str(tmp_path / "p"), "--steps", "0",
                     "--lr", "-1")
    assert rc != 0 and len(lines) == 1, lines
    assert "steps=0 (must be an integer >= 1)" in lines[0] and "learning_rate=-1.0 (must be > 0)" in lines[0]


def test_root_help_has_no_rst_markup_and_train_help_says_model_is_required():
    _, root = _cli("--help")
    assert not any("``" in line for line in root), root
    _, train = _cli("train", "--help")
    assert any("--model" in line and "required" in line for line in train), train


def test_a_misspelled_sweep_key_gets_the_closest_valid_key_not_the_schema(tmp_path):
    schema = ROOT / "workflow/schemas/sweep.schema.yaml"
    cfg = yaml.safe_load((ROOT / "configs/smoke.yaml").read_text())
    assert explain_schema_errors(cfg, schema) is None
    cfg["seedz"] = cfg.pop("seeds")
    cfg["train"]["learning_rat"] = cfg["train"].pop("learning_rate", 1e-4)
    cfg["variants"] = ["baseline", "fulll"]
    msg = explain_schema_errors(cfg, schema)
    lines = msg.splitlines()
    assert len(lines) <= 5, msg
    assert "unknown key 'seedz' in (top level); did you mean 'seeds'" in msg
    assert "unknown key 'learning_rat' in train; did you mean 'learning_rate'" in msg
    assert "variants.1: 'fulll' is not one of" in msg


def test_a_sweep_probe_setting_its_backend_does_not_use_is_refused_not_dropped():
    cfg = yaml.safe_load((ROOT / "configs/smoke.yaml").read_text())
    validate(cfg, str(ROOT / "workflow/schemas/sweep.schema.yaml"), set_default=True)
    assert cfg["probe"]["backend"] == "emulated"
    Sweep(cfg)  # as committed: trainer_attn same
    cfg["probe"]["trainer_attn"] = "sdpa"
    with pytest.raises(ConfigError, match=r"probe.trainer_attn='sdpa' is the vllm backend's .* use trainer_attn: same"):
        Sweep(cfg)
