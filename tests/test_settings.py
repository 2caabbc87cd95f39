"""One source per train setting: each TrainConfig field's help (``metadata["help"]``) is what the CLI, the sweep
schema's descriptions and docs/settings.md show (tools/docs_gen/settings.py writes the schema blocks and the table)."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from roundalign.training.config import (ConfigError, TrainConfig, build_config, setting_choices, setting_default,
                                        setting_help, show_value)

ROOT = Path(__file__).resolve().parents[1]
FIELDS = [f.name for f in dataclasses.fields(TrainConfig)]


@pytest.fixture(scope="module")
def gen():
    from tools.docs_gen import settings

    return settings


@pytest.fixture(scope="module")
def train_parser():
    from roundalign.cli import make_parser

    sub = next(a for a in make_parser()._actions if a.dest == "verb")
    return sub.choices["train"]


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_schema_and_docs_agree_with_the_field_help(gen):
    assert gen.check() == []
    res = subprocess.run([sys.executable, "-m", "tools.docs_gen.settings", "--check"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_every_setting_has_help_naming_each_of_its_choices():
    for key in FIELDS:
        help_ = setting_help(key)
        assert help_.strip() and help_ == _flat(help_) and help_.endswith("."), key
        for choice in setting_choices(key) or ():
            assert re.search(rf"(?<![\w+-]){re.escape(choice)}(?![\w+-])", help_), (key, choice)


def test_config_checks_the_choices_of_the_metadata():
    for key in FIELDS:
        choices = setting_choices(key)
        if choices:
            msg = f"{key}='nope' is not valid; choose one of: {', '.join(choices)}"
            with pytest.raises(ConfigError, match=re.escape(msg)):
                build_config(overrides={"model": "x", key: "nope"})


def test_schema_lists_every_train_key_with_its_help_choices_and_default(gen):
    import yaml

    schema = yaml.safe_load((ROOT / "workflow/schemas/sweep.schema.yaml").read_text())
    for place, props in gen._schema_props(schema).items():
        assert list(props) == [k for k in FIELDS if k not in ("model", "variant", "seed")], place
        for key, entry in props.items():
            assert entry["description"] == setting_help(key), (place, key)
            choices = setting_choices(key)
            if choices:
                assert [c for c in entry["enum"] if c is not None] == list(choices), (place, key)
            if place == "train":
                default = setting_default(key)
                assert entry["default"] == (list(default) if isinstance(default, tuple) else default), key
            else:
                assert "default" not in entry, key  # a default there would override the sweep's train:


def _docs_tables() -> dict[str, list[str]]:
    """docs/settings.md's table rows under each heading (the train table under the title)."""
    tables, heading = {}, "train"
    for line in (ROOT / "docs/settings.md").read_text().splitlines():
        if line.startswith("## "):
            heading = line.removeprefix("## ")
        elif line.startswith("| `"):
            tables.setdefault(heading, []).append(line)
    return tables


def test_docs_table_has_one_row_per_setting_with_its_help():
    rows = _docs_tables()["train"]
    assert [r.split("|")[1].strip().strip("`") for r in rows] == FIELDS
    for key, row in zip(FIELDS, rows):
        assert row.split(" | ")[-1].removesuffix(" |") == setting_help(key).replace("|", "\\|"), key


@pytest.mark.parametrize("command,cls", [("roundalign probe", "ProbeConfig"), ("roundalign attribute", "AttributeConfig")])
def test_probe_and_attribute_flags_are_their_configs_settings_with_the_trees_help(command, cls):
    """Each flag of probe and attribute that sets a config field is generated from the settings tree: the docs row,
    the parser's help and the config field name one setting, whose help they show."""
    from roundalign.cli import make_parser
    from roundalign.probes.attribute import AttributeConfig
    from roundalign.probes.probe import ProbeConfig
    from roundalign.settings import settings_of

    config = {"ProbeConfig": ProbeConfig, "AttributeConfig": AttributeConfig}[cls]
    rows = _docs_tables()[command]
    fields = settings_of(config)
    assert len(rows) == len(fields)
    sub = make_parser()._subparsers._group_actions[0].choices[command.split()[1]]
    actions = {a.dest: a for a in sub._actions}
    for row, (f, s) in zip(rows, fields):
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert cells[1] == f"`{s.key}`" and cells[4].startswith(s.help.replace("|", "\\|")), f.name
        assert actions[f.name].help.replace("%%", "%").startswith(s.help), f.name
        assert actions[f.name].default == (None if f.default is dataclasses.MISSING else f.default), f.name


def test_a_setting_a_run_would_not_use_is_refused_naming_it():
    """train, probe and attribute refuse a non-default value of a setting that their other settings leave unused."""
    from roundalign.probes.attribute import AttributeConfig
    from roundalign.probes.probe import ProbeConfig

    with pytest.raises(ConfigError, match=r"splitk_chunk=16 is not used.*engine_gemm splitk"):
        build_config(overrides={"model": "m", "splitk_chunk": 16})
    with pytest.raises(ConfigError, match=r"digits_op=sort is not used.*task digits"):
        build_config(overrides={"model": "m", "task": "arith", "digits_op": "sort"})
    with pytest.raises(ConfigError, match=r"vllm_mode=server is not used.*backend vllm"):
        build_config(overrides={"model": "m", "vllm_mode": "server"})
    with pytest.raises(ConfigError, match=r"engine_norm_reduction=inductor is not used.*compiled engine"):
        build_config(overrides={"model": "m", "engine": "vllm-eager", "engine_norm_reduction": "inductor"})
    assert build_config(overrides={"model": "m", "engine_gemm": "splitk", "splitk_chunk": 16}).splitk_chunk == 16
    with pytest.raises(ConfigError, match=r"splitk_chunk=8 is not used"):
        ProbeConfig(model="m", splitk_chunk=8)
    with pytest.raises(ConfigError, match=r"engine_attn=sdpa is not used.*backend emulated"):
        AttributeConfig(model="m", backend="vllm", engine_attn="sdpa")
    with pytest.raises(ConfigError, match=r"top_k=5 is not used.*backend vllm"):
        AttributeConfig(model="m", backend="emulated", engine="vllm-compiled", top_k=5)


def test_cli_flags_and_settings_list_show_the_field_help(train_parser):
    from roundalign.cli import TRAIN_FLAGS

    flags = {a.dest: a for a in train_parser._actions if a.dest in FIELDS}
    assert set(flags) == set(TRAIN_FLAGS)
    for key, action in flags.items():
        help_ = action.help.replace("%%", "%")
        if key == "model":
            assert help_ == f"required (here or as `model:` in --config): {setting_help(key)}"
        else:
            assert help_ == f"{setting_help(key)} (default {show_value(setting_default(key))})", key
    epilog = _flat(train_parser.epilog)
    for key in FIELDS:
        default = setting_default(key)
        head = "required" if default is dataclasses.MISSING else f"default {show_value(default)}"
        assert f" {key} ({head}) {setting_help(key)}" in epilog, key


def test_check_names_the_key_whose_schema_description_was_edited(gen, tmp_path):
    text = (ROOT / "workflow/schemas/sweep.schema.yaml").read_text()
    block = text.index("# BEGIN train settings (with defaults)")
    old = "description: Peak learning rate (constant after warm-up)."
    at = text.index(old, block)
    edited = text[:at] + "description: Peak learning rate." + text[at + len(old):]
    schema = tmp_path / "sweep.schema.yaml"
    schema.write_text(edited)
    problems = gen.check(schema, ROOT / "docs/settings.md")
    assert len(problems) == 1 and "train.learning_rate: description differs" in problems[0], problems
    res = subprocess.run([sys.executable, "-m", "tools.docs_gen.settings", "--check", "--schema", str(schema)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "train.learning_rate: description" in res.stderr, res.stderr
    # rewriting puts the field help back, and touches nothing outside the marked blocks
    assert gen.render_schema(edited) == text


def test_check_names_the_key_whose_docs_row_was_edited(gen, tmp_path):
    docs = tmp_path / "settings.md"
    docs.write_text((ROOT / "docs/settings.md").read_text().replace("AdamW weight decay.", "Weight decay."))
    problems = gen.check(ROOT / "workflow/schemas/sweep.schema.yaml", docs)
    assert problems == [f"{docs}: differs from TrainConfig's help (keys: weight_decay)"]


def test_the_train_configs_kernels_default_to_the_engines_mode_and_a_named_mode_stays():
    """TrainConfig's kernels=auto resolves to ``default_kernels``' choice when the config is built (run.json records
    the mode that ran): the trainer and ``apply_alignment`` pick the same kernels for an engine unless told, and a
    mode named explicitly stays."""
    from roundalign.training.config import build_config

    def kernels(**over):
        return build_config(overrides={"model": "x", **over}).kernels

    assert kernels(backend="vllm", engine="vllm-cpu-compiled") == "compiled"
    assert kernels(backend="vllm", engine="vllm-cpu-eager") == "eager"
    assert kernels(engine="vllm-cpu-compiled") == "compiled"  # the emulated compiled CPU engine too
    assert kernels(engine="vllm-compiled") == "eager" and kernels(engine="vllm-eager") == "eager"
    assert kernels(engine="vllm-cpu-compiled", variant="fp32") == "eager"  # fp32: the only bitwise no-op
    assert kernels(backend="vllm", engine="vllm-cpu-compiled", kernels="eager") == "eager"
    assert kernels(engine="vllm-eager", kernels="compiled") == "compiled"
