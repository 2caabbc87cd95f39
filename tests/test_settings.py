"""One source per setting: each setting's help in the settings tree (roundalign.settings) is what the CLI, the sweep
schema's descriptions and docs/settings.md show (tools/docs_gen/settings.py writes the schema blocks and the tables):
the train keys, and the keys of the sweep's probe: and attribution: (the tree's settings of section sweep)."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from snakemake.utils import validate

from roundalign import settings as tree
from roundalign.cli import TRAIN_FLAGS, make_parser
from roundalign.probes.attribute import AttributeConfig
from roundalign.probes.probe import ProbeConfig
from roundalign.settings import settings_of
from roundalign.training.config import (ConfigError, TrainConfig, build_config, setting_choices, setting_default,
                                        setting_help, show_value)
from tools.docs_gen import settings as docs_gen

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "workflow/schemas/sweep.schema.yaml"
FIELDS = [f.name for f in dataclasses.fields(TrainConfig)]


@pytest.fixture(scope="module")
def gen():
    return docs_gen


@pytest.fixture(scope="module")
def train_parser():
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


@pytest.mark.parametrize("block, old, new, key", [
    ("# BEGIN train settings (with defaults)", "description: Peak learning rate (constant after warm-up).",
     "description: Peak learning rate.", "train.learning_rate"),
    ("# BEGIN attribution settings", "description: Bootstrap resamples over prompts.", "description: Resamples.",
     "attribution.resamples"),
], ids=["train", "sweep"])
def test_check_names_the_key_whose_schema_description_was_edited(gen, tmp_path, block, old, new, key):
    text = SCHEMA.read_text()
    at = text.index(old, text.index(block))
    edited = text[:at] + new + text[at + len(old):]
    schema = tmp_path / "sweep.schema.yaml"
    schema.write_text(edited)
    problems = gen.check(schema, ROOT / "docs/settings.md")
    assert len(problems) == 1 and f"{key}: description differs" in problems[0], problems
    res = subprocess.run([sys.executable, "-m", "tools.docs_gen.settings", "--check", "--schema", str(schema)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and f"{key}: description" in res.stderr, res.stderr
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
    def kernels(**over):
        return build_config(overrides={"model": "x", **over}).kernels

    assert kernels(backend="vllm", engine="vllm-cpu-compiled") == "compiled"
    assert kernels(backend="vllm", engine="vllm-cpu-eager") == "eager"
    assert kernels(engine="vllm-cpu-compiled") == "compiled"  # the emulated compiled CPU engine too
    assert kernels(engine="vllm-compiled") == "eager" and kernels(engine="vllm-eager") == "eager"
    assert kernels(engine="vllm-cpu-compiled", variant="fp32") == "eager"  # fp32: the only bitwise no-op
    assert kernels(backend="vllm", engine="vllm-cpu-compiled", kernels="eager") == "eager"
    assert kernels(engine="vllm-eager", kernels="compiled") == "compiled"


PARTS = ("probe", "attribution")


def _schema() -> dict:
    return yaml.safe_load(SCHEMA.read_text())


@pytest.mark.parametrize("part", PARTS)
def test_schema_probe_and_attribution_keys_are_the_trees_sweep_settings(gen, part):
    """Every key of the sweep's probe: and attribution: is one setting of section sweep, in the schema's order, and
    its schema entry (type, enum, items, bounds, default, description) is that setting's."""
    props = _schema()["properties"][part]["properties"]
    keys = [s.key for s in tree.sweep_settings(part)]
    assert [f"{part}.{k}" for k in props] == keys
    for key in keys:
        s = tree.setting(key)
        assert s.section == "sweep"
        assert props[key.partition(".")[2]] == gen.sweep_entry(key), key
        assert props[key.partition(".")[2]]["description"] == s.help, key


def test_a_sweep_key_that_feeds_a_command_setting_shows_its_help_and_says_what_null_means():
    """A sweep key that passes a setting to roundalign probe or attribute starts its help with that setting's (one
    text, not a restatement), narrows its choices or item choices only within it, and, where null inherits another
    key's value, ends by naming it (``none_means``); a key of the sweep's own has help of its own."""
    fed_keys = set()
    for part in PARTS:
        for s in tree.sweep_settings(part):
            assert s.help.strip() and s.help.endswith("."), s.key
            if s.feeds is None:
                continue
            fed = tree.setting(s.feeds)
            fed_keys.add(s.feeds)
            assert fed.section != "sweep" and s.help.startswith(fed.help), s.key
            valid = fed.valid()
            if s.choices is not None and valid is not None:
                assert set(s.choices) - {"same"} <= set(valid), s.key  # "same": probe.trainer_attn's None
            for item in s.item_choices or ():
                assert item in (fed.item_choices or valid), (s.key, item)
            if s.optional:
                assert s.default is None and s.none_means and s.help.endswith(f"null: {s.none_means}."), s.key
    assert {"engine", "attn", "trainer_attn", "engine_gemm", "variants", "num_prompts", "max_new_tokens",
            "context_tokens", "backend", "vllm_gpu_memory_utilization", "num_resamples", "seed"} <= fed_keys
    own = {s.key for part in PARTS for s in tree.sweep_settings(part) if s.feeds is None}
    assert own == {"probe.mem_mb", "probe.runtime_min", "attribution.enabled", "attribution.extra_args"}


def test_every_committed_sweep_config_validates_against_the_generated_probe_and_attribution_keys():
    """The configs' probe: and attribution: values are valid and their defaults filled from the tree's settings
    (an overlay without models: goes onto the smoke sweep, as the Snakefile puts it)."""
    smoke = yaml.safe_load((ROOT / "configs/smoke.yaml").read_text())
    for path in sorted((ROOT / "configs").glob("*.yaml")) + sorted((ROOT / "configs/pilots").glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        cfg = cfg if "models" in cfg else {**smoke, **cfg}
        given = {part: set(cfg.get(part) or {}) for part in PARTS}
        validate(cfg, str(SCHEMA), set_default=True)
        for part in PARTS:
            for s in tree.sweep_settings(part):
                name = s.key.partition(".")[2]
                if name not in given[part]:
                    want = list(s.default) if isinstance(s.default, tuple) else s.default
                    assert cfg[part][name] == want, (path.name, s.key)


def test_check_names_the_sweep_key_whose_setting_help_changed(gen, monkeypatch):
    """A sweep setting's help changed in the tree (here probe.attn's and attribution.extra_args'), and the committed
    schema and docs not rewritten: the check names each key; rewriting puts the new help into the probe: and
    attribution: blocks only."""
    text = SCHEMA.read_text()
    for key in ("probe.attn", "attribution.extra_args"):
        monkeypatch.setitem(tree.SETTINGS, key, dataclasses.replace(tree.SETTINGS[key], help=f"New help of {key}."))
    problems = gen.check()
    assert any("probe.attn: description differs" in p for p in problems), problems
    assert any("attribution.extra_args: description differs" in p for p in problems), problems
    assert any("docs/settings.md" in p and "probe.attn" in p and "attribution.extra_args" in p for p in problems), \
        problems
    rendered = gen.render_schema(text)
    new = yaml.safe_load(rendered)["properties"]
    assert new["probe"]["properties"]["attn"]["description"] == "New help of probe.attn."
    assert new["attribution"]["properties"]["extra_args"]["description"] == "New help of attribution.extra_args."
    changed = [line for line in rendered.splitlines() if line not in text.splitlines()]
    assert len(changed) == 2 and all("New help of" in line for line in changed), changed


def test_check_names_the_sweep_key_whose_default_or_bounds_changed(gen, monkeypatch):
    """Not only the help: a sweep setting's default or bound that the schema does not show is named too."""
    monkeypatch.setitem(tree.SETTINGS, "probe.prompts", dataclasses.replace(tree.SETTINGS["probe.prompts"], default=9))
    monkeypatch.setitem(tree.SETTINGS, "probe.mem_mb", dataclasses.replace(tree.SETTINGS["probe.mem_mb"], at_least=50))
    problems = gen.check(SCHEMA, ROOT / "docs/settings.md")
    assert any("probe.prompts: default differs" in p for p in problems), problems
    assert any("probe.mem_mb: minimum differs" in p for p in problems), problems


@pytest.mark.parametrize("part", PARTS)
def test_check_fails_where_a_sweep_block_marker_is_gone(gen, tmp_path, part):
    schema = tmp_path / "sweep.schema.yaml"
    schema.write_text("\n".join(line for line in SCHEMA.read_text().splitlines()
                                if not line.lstrip().startswith(f"# BEGIN {part} settings")) + "\n")
    problems = gen.check(schema, ROOT / "docs/settings.md")
    assert len(problems) == 1 and f"'# BEGIN {part} settings'" in problems[0], problems


@pytest.mark.parametrize("part", PARTS)
def test_docs_table_of_the_sweep_section_has_one_row_per_key_with_its_help(part):
    rows = _docs_tables()[f"Sweep `{part}:`"]
    settings = tree.sweep_settings(part)
    assert [r.split("|")[1].strip().strip("`") for r in rows] == [s.key for s in settings]
    for row, s in zip(rows, settings):
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert cells[1] == (f"`{s.feeds}`" if s.feeds else "(sweep)"), s.key
        assert cells[4] == s.help.replace("|", "\\|"), s.key
